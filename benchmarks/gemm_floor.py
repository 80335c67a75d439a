"""A training step's GEMM floor, and each contender's distance to it (issue 44).

The floor is the time of the step's matrix products alone: every ``mm``, ``addmm``, ``bmm``,
``baddbmm`` and ``convolution`` (and ``convolution_backward``) one eager step of the model runs,
forward and backward, recorded with their shapes by a ``TorchDispatchMode``, then each replayed
alone on fresh tensors of those shapes with PyTorch's kernels (MKL / oneDNN), median of
``--reps`` runs, summed. No contender's step can do less of that work (ortlab's onnxruntime
kernels run the same products; a contender with faster GEMMs than PyTorch's could go below it,
which the table would show as a ratio under 1). The contenders' steps come from
``train_step.py --alone`` (each in fresh processes, in turns), so the ratios are the step's
median over the floor: 1.0 would be a step that is all GEMM time.

Usage:
    python benchmarks/gemm_floor.py --model gpt
    python benchmarks/gemm_floor.py --model gpt --contenders eager,compile,ortlab --rounds 2 --steps 20
    python benchmarks/gemm_floor.py --model resnet18 --floor-only
    python benchmarks/gemm_floor.py --model gpt,mlp,resnet18-32,resnet18-224,mobilenet,phi3,gpt-neox --rounds 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_step import build_model  # noqa: E402

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
         aten.convolution_backward.default}


class _Record(TorchDispatchMode):
    """Every GEMM-like op of a step with its arguments' shapes and dtypes (tensors) or values (the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in GEMMS:
            spec = [("T", tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor)
                    else ("V", tuple(a) if isinstance(a, list) else a) for a in args]  # lists: hashable
            self.calls.append((func, tuple(spec), tuple(sorted(kwargs.items()))))
        return func(*args, **kwargs)


def _replay(call: tuple, reps: int) -> float:
    """Seconds of one call alone: the median of ``reps`` runs on fresh random tensors."""
    func, spec, kwargs = call
    args = [torch.randn(s[1], dtype=s[2]) if s[0] == "T" else s[1] for s in spec]
    for _ in range(2):
        func(*args, **dict(kwargs))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        func(*args, **dict(kwargs))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_floor(name: str, reps: int) -> tuple[float, int, dict[str, float]]:
    """(seconds of the step's GEMMs alone, how many, seconds per op kind) for model ``name``."""
    torch.manual_seed(0)
    model, draw, _ = build_model(name)
    batch = draw(torch.Generator().manual_seed(0))
    loss = model(*batch)
    loss.backward()  # warm: lazy init outside the recording
    model.zero_grad(set_to_none=True)
    record = _Record()
    with record:
        model(*batch).backward()
    counts: dict[tuple, int] = {}
    for call in record.calls:
        counts[call] = counts.get(call, 0) + 1
    total, kinds = 0.0, {}
    for call, n in counts.items():
        s = _replay(call, reps) * n
        total += s
        kind = call[0]._opname
        kinds[kind] = kinds.get(kind, 0.0) + s
    return total, len(record.calls), kinds


_ROUND = re.compile(r"^\s*(\S+) (\S+) round \d+: median ([\d.]+) ms, first step (\d+) ms")


def step_runs(name: str, contenders: str, rounds: int, steps: int, warmup: int) -> dict[str, list[tuple[float, float]]]:
    """Each contender's (step median, first step) in ms per process, from ``train_step.py --alone``
    (fresh processes, in turns)."""
    cmd = [sys.executable, str(HERE / "train_step.py"), "--model", name, "--contenders", contenders, "--alone",
           "--rounds", str(rounds), "--steps", str(steps), "--warmup", str(warmup)]
    print("+", " ".join(cmd[1:]), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    print(out, flush=True)
    runs: dict[str, list[tuple[float, float]]] = {}
    for line in out.splitlines():
        m = _ROUND.match(line)
        if m and m.group(1) == name:
            runs.setdefault(m.group(2), []).append((float(m.group(3)), float(m.group(4))))
    return runs


def _spread(values: list[float], fmt: str = ".1f") -> str:
    """``median (min-max)`` of ``values``."""
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt", help="a model of train_step.py, or a comma list of them")
    parser.add_argument("--contenders", default="eager,compile,ortlab")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--floor-only", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    table = []
    for name in [m.strip() for m in args.model.split(",") if m.strip()]:
        floor, count, kinds = gemm_floor(name, args.reps)
        parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        print(f"[{name}] GEMM floor {floor * 1e3:.2f} ms a step ({count} GEMM-like calls: {parts})", flush=True)
        if args.floor_only:
            continue
        runs = step_runs(name, args.contenders, args.rounds, args.steps, args.warmup)
        eager = statistics.median(ms for ms, _ in runs.get("eager", [(float("nan"), 0)]))
        for c, rs in runs.items():
            steps = [ms for ms, _ in rs]
            med = statistics.median(steps)
            table.append((name, c, _spread(steps), f"{eager / med:.2f}x", f"{med / (floor * 1e3):.2f}",
                          f"{floor * 1e3:.1f}", _spread([first / 1e3 for _, first in rs], ".1f")))
    if table:
        print("\n| model | contender | step ms, median (min-max of processes) | vs eager | step / GEMM floor "
              "| GEMM floor ms | first step s |")
        print("|---|---|---|---|---|---|---|")
        for row in table:
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
