"""How much a monitor slows training down: paired timings of watched and plain blocks of steps.

Usage:
    python benchmarks/monitor_overhead.py                 # tiny MLP, 300 steps x 12 pairs

``tests/ui/test_monitor.py`` imports :func:`measure_overhead` from here to hold the
monitor to its budget.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["measure_overhead"]


def measure_overhead(
    make_model: Callable[[], torch.nn.Module] | None = None,
    batch: int = 64,
    steps: int = 200,
    rounds: int = 15,
    threads: int | None = 1,
    **monitor_options: Any,
) -> dict[str, Any]:
    """Time a training loop with and without a monitor (widget view, profiling on).

    One ORTModule trains in pairs of blocks of ``steps`` steps, one watched and one
    not, in random order, so capture, caches and machine noise hit both sides
    alike. The overhead is the median over pairs of (watched / plain time) - 1.

    Args:
        make_model: builds an MLP-like module taking ``(batch, in_features)``
            (default ``ortlab.models.TinyMLP``, the worst case: the shorter the
            step, the larger the monitor's share).
        batch: rows per step.
        steps: steps per block.
        rounds: pairs of blocks.
        threads: PyTorch threads while measuring (restored after); one keeps a
            tiny model's timings steady on a busy machine, ``None`` leaves it.
        **monitor_options: passed to :func:`monitor`.

    Returns:
        ``plain_ms``/``monitored_ms`` (median step times), ``overhead`` (median
        paired slowdown), ``monitor_fraction`` (the monitor's own accounting of
        its work), ``profiles``, ``redraws``-worth ``redraw_ms`` and ``steps``.

    Example:
        >>> measure_overhead(steps=200)["overhead"] < 0.05     # doctest: +SKIP
        True
    """
    import ortlab
    from ortlab.models import TinyMLP

    model = (make_model or TinyMLP)()
    om = ortlab.ORTModule(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, linears[0].in_features, generator=gen)
    y = torch.randint(0, linears[-1].out_features, (batch,), generator=gen)
    opt = torch.optim.SGD(om.parameters(), lr=0.01)

    def block(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = torch.nn.functional.cross_entropy(om(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / n

    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _measure(om, block, steps, rounds, monitor_options)
    finally:
        torch.set_num_threads(saved_threads)


def _measure(om: Any, block: Callable[[int], float], steps: int, rounds: int, options: dict) -> dict[str, Any]:
    import random

    from ortlab.ui.monitor import monitor

    block(50)  # capture and warm up
    mon = monitor(om, **{"show": False, **options})
    mon.widget()  # redraw a real FigureWidget (no front end attached)
    mon.detach()
    order = random.Random(0)
    plain, watched, ratios = [], [], []
    for _ in range(rounds):
        first_watched = order.random() < 0.5
        times = {}
        for watch in (first_watched, not first_watched):
            if watch:
                mon.attach()
            times[watch] = block(steps)
            if watch:
                mon.detach()
        plain.append(times[False])
        watched.append(times[True])
        ratios.append(times[True] / times[False])
    mon.close()
    return {
        "plain_ms": float(np.median(plain)) * 1e3,
        "monitored_ms": float(np.median(watched)) * 1e3,
        "overhead": float(np.median(ratios)) - 1.0,
        "monitor_fraction": mon.overhead["fraction"],
        "profiles": len(mon.profiles),
        "redraw_ms": mon._schedule.cost["redraw"] * 1e3,
        "steps": mon.steps,
    }


if __name__ == "__main__":
    import json
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(json.dumps(measure_overhead(steps=300, rounds=12), indent=1))
