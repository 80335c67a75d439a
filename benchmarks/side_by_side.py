"""Training steps of eager PyTorch and an ORTModule in turns in one process, for the small benchmarks
(``upsample.py``, ``avg_pool.py``, ``conv_transpose.py``): A B A B, so a busy moment of the machine hits both."""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import ortlab


def arguments(doc: str, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line: ``--steps`` (25) and ``--warmup`` (8), beside the caller's own arguments."""
    parser = parser or argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=8)
    return parser.parse_args()


def twins(make: Callable[[], nn.Module]) -> tuple[nn.Module, ortlab.ORTModule]:
    """An eager model and an ORTModule of another with the same weights (fallback warnings silenced: the
    summary's parts say where each graph ran)."""
    warnings.simplefilter("ignore", ortlab.FallbackWarning)
    torch.manual_seed(0)
    eager = make()
    model = ortlab.ORTModule(make())
    model.load_state_dict(eager.state_dict())
    return eager, model


def in_turns(eager: nn.Module, model: ortlab.ORTModule, step: Callable[[nn.Module], torch.Tensor], steps: int,
             warmup: int) -> tuple[float, float, dict[str, float]]:
    """``step(module)`` returns a loss, whose backward is run; the medians of eager's and ortlab's steps after
    ``warmup`` (seconds) and each one's last loss."""
    times: dict[str, list[float]] = {"eager": [], "ortlab": []}
    losses: dict[str, float] = {}
    for _ in range(steps):
        for name, module in (("eager", eager), ("ortlab", model)):
            start = time.perf_counter()
            loss = step(module)
            loss.backward()
            times[name].append(time.perf_counter() - start)
            losses[name] = loss.item()
    return statistics.median(times["eager"][warmup:]), statistics.median(times["ortlab"][warmup:]), losses


def summary(eager_s: float, ortlab_s: float, model: ortlab.ORTModule, losses: dict[str, float]) -> str:
    """``eager 19.3 ms ortlab 24.8 ms ratio 0.78x parts [1, 1] (g0.forward OpenVINOExecutionProvider, ...)`` and the
    losses."""
    graphs = [g for c in model.report.captures for g in c.graphs]
    providers = [f"{g.label} " + "+".join(sorted({p.runner.session.get_providers()[0] for p in g.parts}))
                 for g in graphs]
    return (f"eager {eager_s * 1e3:.1f} ms ortlab {ortlab_s * 1e3:.1f} ms ratio {eager_s / ortlab_s:.2f}x "
            f"parts {[len(g.parts) for g in graphs]} ({', '.join(providers)}) "
            f"losses eager {losses['eager']:.6f} ortlab {losses['ortlab']:.6f}")
