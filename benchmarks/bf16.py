"""bfloat16 training steps (``torch.autocast("cpu", dtype=torch.bfloat16)``): eager, ortlab by default
(on a CPU with bf16 units the graph runs whole on OpenVINO, Note [bfloat16 graphs on the CPU]) and
ortlab pinned to onnxruntime's CPU provider (its missing bf16 kernels run in PyTorch).

Each contender trains its own copy of the same GPT on the same batches; steps alternate A B C A B C
after a warm-up; medians. Losses are printed: bf16 contenders agree to bf16 precision, not exactly.

Usage:
    python benchmarks/bf16.py --steps 30
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402, I001
import torch.nn.functional as F  # noqa: E402
import ortlab  # noqa: E402
from ortlab.models import GPT, GPTConfig, make_batch  # noqa: E402
from ortlab.runtime.providers import bf16_provider  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, bf16 provider here: {bf16_provider() or 'none'}")
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    contenders = {
        "eager": copy.deepcopy(base),
        "ortlab": ortlab.ORTModule(copy.deepcopy(base)),
        "ortlab-cpu-ep": ortlab.ORTModule(copy.deepcopy(base), providers=["CPUExecutionProvider"]),
    }
    optims = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in contenders.items()}

    def step(name: str, batch: tuple) -> float:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = contenders[name](x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        optims[name].step()
        optims[name].zero_grad()
        return loss.item()

    g = torch.Generator().manual_seed(0)
    first = {}
    for name in contenders:
        start = time.perf_counter()
        step(name, make_batch("gpt", 8, torch.Generator().manual_seed(0)))
        first[name] = time.perf_counter() - start
        for _ in range(2):
            step(name, make_batch("gpt", 8, torch.Generator().manual_seed(0)))
    times: dict[str, list[float]] = {n: [] for n in contenders}
    losses: dict[str, float] = {}
    for _ in range(args.steps):
        batch = make_batch("gpt", 8, g)
        for name in contenders:
            start = time.perf_counter()
            losses[name] = step(name, batch)
            times[name].append(time.perf_counter() - start)
    eager_ms = statistics.median(times["eager"]) * 1e3
    print(f"GPT d=256, 4 layers, T=128, batch 8, autocast bf16, {args.steps} alternating steps")
    print(f"{'contender':<15}{'median ms':>10}{'vs eager':>10}{'first s':>9}{'last loss':>11}")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"{name:<15}{ms:>10.2f}{eager_ms / ms:>9.2f}x{first[name]:>9.2f}{losses[name]:>11.4f}")
    for name in ("ortlab", "ortlab-cpu-ep"):
        om = contenders[name]
        fallbacks = len(om.report.fallbacks)
        providers = sorted({p.runner.session.get_providers()[0] for c in om.report.captures for gr in c.graphs
                            for p in gr.parts})
        print(f"{name}: runs on {', '.join(providers)}; {fallbacks} op(s) in PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
