"""Memory against time: each recompute policy as a point, measured.

``RecomputeToggles.trade_off()`` re-captures the module under each policy (``none``, ``auto``,
``layerwise`` and budgets of 75/50/25/10%), takes the bytes the plan saves and the measured
step time (median and spread of several steps after the capture), and puts the module back on
the policy it ran. ``figure()`` draws the points: saved bytes across, step time up, with the
points no other point beats on both axes joined. In the toggles widget a click on a point
applies its policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ortlab.config import describe_recompute

__all__ = ["TRADE_OFF_POLICIES", "TradePoint", "best_points", "figure"]

TRADE_OFF_POLICIES: tuple[object, ...] = (
    "none", "auto", "layerwise", ("budget", 0.75), ("budget", 0.5), ("budget", 0.25), ("budget", 0.1),
)


@dataclasses.dataclass
class TradePoint:
    """One policy, measured: what its plan saves and how long a step takes under it.

    Attributes:
        policy: the ``recompute`` option.
        saved_bytes: bytes its plan saves for the backward.
        timing: step times after its capture (``ortlab.ui.toggles.Timing``).
        cost: the plan's predicted recompute cost (``RecomputePlan.cost``).
        note: the plan's note (a budget that could not be met, a preset replaced).
    """

    policy: object
    saved_bytes: int
    timing: Any
    cost: str = ""
    note: str = ""

    @property
    def label(self) -> str:
        return describe_recompute(self.policy)


def best_points(points: Sequence[TradePoint]) -> list[TradePoint]:
    """The points no other point beats on both axes (fewer or equal bytes and a faster or equal
    median step, one of them strictly), by bytes."""
    def beaten(p: TradePoint) -> bool:
        return any(q.saved_bytes <= p.saved_bytes and q.timing.median <= p.timing.median
                   and (q.saved_bytes < p.saved_bytes or q.timing.median < p.timing.median) for q in points)

    return sorted((p for p in points if not beaten(p)), key=lambda p: p.saved_bytes)


def _unit(points: Sequence[TradePoint]) -> tuple[str, float]:
    top = max((p.saved_bytes for p in points), default=0)
    return ("MiB", 2**20) if top >= 2**20 else ("KiB", 2**10)


def figure(points: Sequence[TradePoint], in_force: object | None = None) -> Any:
    """A plotly figure of the measured points; the best ones joined, the policy in force ringed."""
    import plotly.graph_objects as go

    unit, scale = _unit(points)
    best = best_points(points)
    steps = len(points[0].timing.samples) if points else 0
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=[p.saved_bytes / scale for p in best], y=[1000 * p.timing.median for p in best], mode="lines",
        line={"dash": "dot", "color": "#2a7"}, name="best on both axes", hoverinfo="skip"))
    fig.add_trace(go.Scatter(
        x=[p.saved_bytes / scale for p in points], y=[1000 * p.timing.median for p in points],
        mode="markers+text", text=[p.label for p in points], textposition=_text_positions(points, scale),
        name="policies",
        customdata=[[i] for i in range(len(points))],
        marker={"size": [14 if describe_recompute(p.policy) == _label(in_force) else 9 for p in points],
                "color": ["#2a7" if p in best else "#888" for p in points],
                "line": {"width": [3 if describe_recompute(p.policy) == _label(in_force) else 0 for p in points],
                         "color": "#000"}},
        error_y={"type": "data", "symmetric": False,
                 "array": [1000 * (p.timing.high - p.timing.median) for p in points],
                 "arrayminus": [1000 * (p.timing.median - p.timing.low) for p in points]},
        hovertext=[f"{p.label}: {p.saved_bytes:,} bytes saved; step {p.timing}; {p.cost}"
                   + (f"<br>{p.note}" if p.note else "") for p in points],
        hoverinfo="text"))
    fig.update_layout(
        title={"text": "Recompute policies: saved activations against step time (click a point to apply it)",
               "font": {"size": 13}},
        xaxis_title=f"saved activations ({unit})",
        yaxis_title=f"step time (ms): median, bars min-max of {steps} steps",
        height=380, margin={"l": 60, "r": 20, "t": 50, "b": 50}, showlegend=False)
    return fig


def _text_positions(points: Sequence[TradePoint], scale: float) -> list[str]:
    """Labels of points that sit together (plans saving about the same bytes) go round them, not on one another."""
    around = ["top center", "bottom center", "middle right", "middle left", "top right", "bottom right"]
    span = max((p.saved_bytes for p in points), default=0) / scale or 1
    placed: list[tuple[float, int]] = []
    out = []
    for p in points:
        x = p.saved_bytes / scale
        near = sum(1 for other, _ in placed if abs(other - x) < 0.04 * span)
        placed.append((x, near))
        out.append(around[near % len(around)])
    return out


def _label(policy: object | None) -> str | None:
    return None if policy is None else describe_recompute(policy)


def measure(toggles: Any, policies: Sequence[object] = TRADE_OFF_POLICIES, steps: int = 5,
            progress: Callable[[str], None] | None = None) -> list[TradePoint]:
    """Each policy re-captured and timed on the toggles' example inputs; the module then runs
    the policy it ran before (its gradients and buffers are untouched, see ``_Measured``)."""
    om = toggles.run.om
    in_force = om.options.recompute
    points: list[TradePoint] = []
    try:
        for i, policy in enumerate(policies):
            if progress is not None:
                progress(f"measuring {describe_recompute(policy)} ({i + 1}/{len(policies)}): re-capture, then {steps} steps")
            om.reconfigure(recompute=policy)
            timing = toggles.run.timed(steps)
            plan = toggles.plan
            points.append(TradePoint(policy, plan.saved_bytes, timing, plan.cost, plan.note))
    finally:
        om.reconfigure(recompute=in_force)
        if progress is not None:
            progress(f"back to {describe_recompute(in_force)}: re-capture")
        toggles.run.step()  # the plan and graphs the toggles show are the policy's in force again
    return points
