"""First steps of new modules of a class already captured with other sizes, in one process.

A notebook user re-creates a model with another batch size (or a test suite builds many):
each new ORTModule's first step, with Dynamo's memory of the earlier modules' sizes cleared
before its first capture (ortlab's default, Note [A new module's first capture uses its own
sizes] in ``ortlab/_compat/torch.py``) and, in a second fresh process, kept (what ortlab did
before: ``--keep-sizes`` stubs out the clearing). The 4-layer GPT, batch 4, then 6, then 8.

    python benchmarks/first_step_again.py | tee benchmarks/results/first_step_again.txt
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(keep_sizes: bool, batches: list[int]) -> None:
    import torch  # torch first, as users' scripts do

    import ortlab
    import ortlab.ortmodule
    from ortlab.models import GPT, GPTConfig, make_batch

    if keep_sizes:
        ortlab.ortmodule.forget_sizes_seen = lambda module: None  # type: ignore[assignment]
    for batch in batches:
        torch.manual_seed(0)
        om = ortlab.ORTModule(GPT(GPTConfig()))
        idx, targets = make_batch("gpt", batch, torch.Generator().manual_seed(batch))
        start = time.perf_counter()
        om(idx, targets).backward()
        first = time.perf_counter() - start
        capture = om.report.captures[0]
        symbolic = any(
            isinstance(v := n.meta.get("val"), torch.SymInt)
            or (isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape))
            for g in capture.graphs if g.graph_module is not None
            for n in g.graph_module.graph.nodes if n.op == "placeholder")
        print(f"  batch {batch}: first step {first:5.2f} s, capture {capture.capture_s:5.2f} s, "
              f"sizes {'symbolic' if symbolic else 'static'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="4,6,8")
    parser.add_argument("--keep-sizes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        run(args.keep_sizes, batches)
        return
    print(f"== new ORTModules of the 4-layer GPT in one process, batch {args.batches} in turn ==")
    for keep, title in ((False, "ortlab (Dynamo's memory of earlier sizes cleared)"),
                        (True, "Dynamo's memory kept (ortlab before 2026-11-25)")):
        print(title, flush=True)
        command = [sys.executable, __file__, "--child", "--batches", args.batches] + (["--keep-sizes"] if keep else [])
        subprocess.run(command, check=True)
    import platform

    import onnxruntime
    import torch
    from train_step import _cpu_model  # benchmarks/ is the script's folder

    print(f"command: python benchmarks/first_step_again.py ({time.strftime('%Y-%m-%d')}); "
          f"CPU: {_cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
          f"Python {platform.python_version()}")


if __name__ == "__main__":
    main()
