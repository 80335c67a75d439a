"""The CPU provider's rewrites (``ortlab/runtime/cpu_rewrites.py``) on and off, side by side.

Three contenders train the same model in one process, their steps alternating: eager PyTorch,
ortlab with the rewrites replaced by a no-op, and ortlab as it is. Prints what the rewrites did
(the report's notes), each contender's median step and last loss, and the ratios.

    python benchmarks/cpu_rewrites.py --model resnet18 --steps 30
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import ortlab
import ortlab.pipeline.part as part
from ortlab.runtime.cpu_rewrites import CpuRewrites
from train_step import LARGE_MODELS, MODELS, _cpu_model, build_model, train_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=[*MODELS, *LARGE_MODELS])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}; CPU: {_cpu_model()}; {torch.get_num_threads()} threads")
    model, draw, _ = build_model(args.model)
    g = torch.Generator().manual_seed(0)
    batches = [draw(g) for _ in range(args.batches)]
    real = part.rewrite_for_cpu
    contenders = {}
    try:
        for label in ("eager", "off", "on"):
            m = copy.deepcopy(model)
            part.rewrite_for_cpu = real if label == "on" else (lambda model, level: CpuRewrites())
            wrapped = m if label == "eager" else ortlab.ORTModule(m)
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            start = time.perf_counter()
            train_step(wrapped, opt, batches[0])  # the first step builds the sessions, with or without
            print(f"{label}: first step {time.perf_counter() - start:.2f} s")
            if label == "on":
                for c in wrapped.report.captures:
                    for graph in c.graphs:
                        for note in graph.notes:
                            if "Where node(s)" in note or "convolution" in note:
                                print(f"  {note}")
            contenders[label] = (wrapped, opt)
    finally:
        part.rewrite_for_cpu = real
    times: dict[str, list[float]] = {k: [] for k in contenders}
    losses: dict[str, float] = {}
    for i in range(args.steps):
        for label, (wrapped, opt) in contenders.items():
            ms, loss, _ = train_step(wrapped, opt, batches[(i + 1) % len(batches)])
            times[label].append(ms)
            losses[label] = loss.item()
    for label in contenders:
        print(f"{label:6s} median {statistics.median(times[label]):9.2f} ms   last loss {losses[label]:.6f}")
    eager, off, on = (statistics.median(times[k]) for k in ("eager", "off", "on"))
    print(f"rewrites on vs off {off / on:.3f}x; off vs eager {eager / off:.3f}x; on vs eager {eager / on:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
