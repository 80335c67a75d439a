"""FusedAdam's step beside torch.optim.AdamW's (foreach and fused) on a GPT's parameters.

The parameters of ``ortlab.models.GPT(GPTConfig())`` get random gradients once; each
optimizer updates its own copy of them. Steps alternate between the optimizers (A B C A
B C ...), after warm-up steps, and the table gives each one's median and quartiles:

* ``torch.optim.AdamW(foreach=True)``: PyTorch's multi-tensor path;
* ``torch.optim.AdamW(fused=True)``: PyTorch's fused CPU kernel;
* ``ortlab.optim.FusedAdam``: one onnxruntime run over every parameter, in place.

On 2 cores (benchmarks/results/optim.txt) FusedAdam runs near the foreach path
(0.78x) and far from the fused kernel (5.3x faster than foreach): the ONNX graph is 14
elementwise ops per parameter, each a pass over memory, where the fused kernel makes one
pass; onnxruntime's CPU provider fuses none of them.

Usage:
    python benchmarks/optim.py [steps]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402, I001
import onnxruntime  # noqa: E402
from ortlab.models import GPT, GPTConfig  # noqa: E402
from ortlab.optim import FusedAdam  # noqa: E402


def _params(base: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(p.detach().clone()) for p in base]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def main(steps: int) -> None:
    torch.manual_seed(0)
    base = list(GPT(GPTConfig()).parameters())
    grads = [torch.randn_like(p) * 1e-2 for p in base]
    count = sum(p.numel() for p in base)
    optimizers = {
        "torch AdamW foreach": torch.optim.AdamW(_params(base, grads), lr=1e-3, foreach=True),
        "torch AdamW fused": torch.optim.AdamW(_params(base, grads), lr=1e-3, fused=True),
        "ortlab FusedAdam": FusedAdam(_params(base, grads), lr=1e-3),
    }
    for opt in optimizers.values():  # warm-up: state allocation, FusedAdam's session
        for _ in range(3):
            opt.step()
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(steps):
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    ps = [opt.param_groups[0]["params"] for opt in optimizers.values()]
    drift = max((a - b).abs().max().item() for a, b in zip(ps[0], ps[2]))
    print(f"GPT(GPTConfig()): {len(base)} parameter tensors, {count / 1e6:.2f} M values; {steps} steps each, "
          "alternating, after 3 warm-up steps")
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; torch "
          f"{torch.__version__}, onnxruntime {onnxruntime.__version__}")
    reference = statistics.median(times["torch AdamW foreach"])
    print(f"{'optimizer':<22}{'median ms':>10}{'p25 ms':>9}{'p75 ms':>9}{'vs foreach':>12}")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        med = statistics.median(ts)
        print(f"{name:<22}{med * 1e3:>10.2f}{q[0] * 1e3:>9.2f}{q[2] * 1e3:>9.2f}{reference / med:>11.2f}x")
    print(f"max |FusedAdam - AdamW foreach| over the parameters after {steps + 3} steps: {drift:.1e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps", nargs="?", type=int, default=50, help="measured steps per optimizer (default 50)")
    main(parser.parse_args().steps)
