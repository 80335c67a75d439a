"""The ``ortlab`` command line.

Example:
    $ ortlab demo --steps 200 --out ortlab_demo_out
    $ python -m ortlab demo --model mlp --steps 50
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import ortlab
from ortlab.errors import OrtlabError
from ortlab.models import GPT, MLP, GPTConfig, make_batch

Batch = tuple[torch.Tensor, torch.Tensor]

SMALL_GPT = GPTConfig(d_model=128, n_layers=2, block_size=64)
"""A GPT that trains in a few minutes on two CPU cores."""

SPEED_STEPS = 20
"""Alternating steps per side when the demo compares ortlab with eager PyTorch."""


def _build(kind: str, small: bool) -> tuple[nn.Module, Callable[[torch.Generator], Batch], float]:
    """Return the demo model, a batch sampler and the AdamW learning rate that trains it."""
    torch.manual_seed(0)
    if kind == "gpt":
        cfg = SMALL_GPT if small else GPTConfig()
        return GPT(cfg), lambda g: make_batch("gpt", 8, g, vocab=cfg.vocab, block_size=cfg.block_size), 3e-3
    return MLP(), lambda g: make_batch("mlp", 64, g), 1e-3


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> tuple[float, float]:
    """Run one training step; return the loss and the wall time in ms."""
    start = time.perf_counter()
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item(), (time.perf_counter() - start) * 1e3


def _speed(ort_model: nn.Module, ort_opt: torch.optim.Optimizer, eager: nn.Module, lr: float,
           draw: Callable[[torch.Generator], Batch], steps: int) -> tuple[float, float]:
    """Median step times in ms of ``ort_model`` and ``eager``, taking alternate steps on the same batches."""
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # warm-up: allocator, AdamW state
        _step(eager, eager_opt, draw(gen))
    ort_ms, eager_ms = [], []
    for _ in range(steps):
        batch = draw(gen)
        ort_ms.append(_step(ort_model, ort_opt, batch)[1])
        eager_ms.append(_step(eager, eager_opt, batch)[1])
    return statistics.median(ort_ms), statistics.median(eager_ms)


def speed_summary(ort_ms: float, eager_ms: float, steps: int) -> str:
    """The demo's speed line: ortlab's speed as a multiple of eager PyTorch's, with both step times.

    Example:
        >>> speed_summary(13.2, 12.3, 20)
        "speed: ortlab 0.93x eager PyTorch's (median step: eager 12.3 ms, ortlab 13.2 ms; 20 alternating steps each; above 1x ortlab is faster)"
    """
    return (f"speed: ortlab {eager_ms / ort_ms:.2f}x eager PyTorch's (median step: eager {eager_ms:.1f} ms, "
            f"ortlab {ort_ms:.1f} ms; {steps} alternating steps each; above 1x ortlab is faster)")


def demo(steps: int, out: Path, kind: str, small: bool) -> int:
    """Train a reference model through ORTModule, show its report, compare its speed with eager PyTorch.

    Args:
        steps: Training steps to run.
        out: Folder that receives the saved ONNX stages.
        kind: ``"gpt"`` or ``"mlp"``.
        small: Use the small GPT config (ignored for the MLP).

    Returns:
        The process exit code.
    """
    model, draw, lr = _build(kind, small)
    eager = copy.deepcopy(model)
    out.mkdir(parents=True, exist_ok=True)
    print(f"model: {kind}, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"torch threads {torch.get_num_threads()}")
    ort_model = ortlab.ORTModule(
        model, debug_options=ortlab.DebugOptions(save_onnx=True, onnx_prefix="demo", save_path=str(out))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)

    losses: list[float] = []
    first = ""
    with tqdm(range(steps), desc="training", unit="step") as bar:
        for i in bar:
            loss, ms = _step(ort_model, opt, draw(gen))
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.4f}")
            if i == 0:  # the report as the first step left it, shown once the bar is done
                report = getattr(ort_model, "report", None)
                text = str(report) if report is not None else "(this ORTModule exposes no first-step report)"
                first = f"first step took {ms / 1e3:.1f} s (capture, export, session build)\n{text}"
    print(first)

    n = min(10, len(losses))
    if n:
        print(f"loss: {statistics.fmean(losses[:n]):.4f} (mean of the first {n} steps) -> "
              f"{statistics.fmean(losses[-n:]):.4f} (mean of the last {n})")

    ort_ms, eager_ms = _speed(ort_model, opt, eager, lr, draw, SPEED_STEPS)
    print(speed_summary(ort_ms, eager_ms, SPEED_STEPS))

    files = sorted(p for p in out.rglob("*") if p.is_file())
    print(f"{len(files)} files in {out}/:")
    for p in files:
        print(f"  {p.relative_to(out)}  ({p.stat().st_size / 1024:.1f} KiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ortlab`` console script.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The process exit code.
    """
    parser = argparse.ArgumentParser(prog="ortlab", description="Train PyTorch modules through onnxruntime.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a small model through ORTModule and compare it with eager PyTorch")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--out", type=Path, default=Path("ortlab_demo_out"), help="folder for the saved ONNX stages")
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    p.add_argument("--small", action=argparse.BooleanOptionalAction, default=True,
                   help="small GPT (d_model=128, 2 layers, block 64) that trains quickly on a CPU; "
                        "--no-small for the full reference GPT")
    args = parser.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    try:
        return demo(args.steps, args.out, args.model, args.small)
    except OrtlabError as exc:
        print(f"ortlab demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
