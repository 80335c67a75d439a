"""Recompute and fallback toggles: change what the engine does, see what it cost.

The logic lives in plain classes (``RecomputeToggles``, ``FallbackToggles``) that tests
drive without a browser; ``.widget()`` builds the ipywidgets view on top of them.
Applying calls ``ORTModule.reconfigure`` (the engine re-captures with the new
choice), then runs one measuring step on the example inputs and puts gradients and
buffers back, so the user's training is not disturbed: the next training step uses
the new choice.
"""

from __future__ import annotations

import dataclasses
import html
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ortlab.capture.provenance import module_path, op_name
from ortlab.ortmodule import ORTModule
from ortlab.partition.recompute import RecomputePlan

__all__ = ["RecomputeToggles", "FallbackToggles", "ApplyResult", "OpRow"]

PRESETS = ("none", "auto", "layerwise")


def _LABELLED(w: Any) -> dict[str, Any]:  # noqa: N802 - reads as a constant at the call sites
    """Checkbox settings that show the whole description (ipywidgets clips it by default)."""
    return {"layout": w.Layout(width="auto"), "style": {"description_width": "initial"}}


@dataclasses.dataclass
class ApplyResult:
    """What applying a new choice changed."""

    before_bytes: int
    after_bytes: int
    before_step_s: float
    after_step_s: float
    choice: object

    def __str__(self) -> str:
        ratio = self.after_step_s / self.before_step_s if self.before_step_s else float("nan")
        return (
            f"saved activations {self.before_bytes:,} -> {self.after_bytes:,} bytes; "
            f"step {1000 * self.before_step_s:.1f} -> {1000 * self.after_step_s:.1f} ms ({ratio:.2f}x)"
        )


class _Measured:
    """Runs measuring steps on example inputs without disturbing training state."""

    def __init__(self, om: ORTModule, inputs: tuple, kwargs: dict, loss_fn: Callable | None) -> None:
        if not isinstance(om, ORTModule):
            raise TypeError(f"toggles work on an ortlab.ORTModule, got {type(om).__name__}")
        self.om, self.inputs, self.kwargs, self.loss_fn = om, inputs, kwargs, loss_fn

    def step(self) -> float:
        """One forward+backward; returns seconds. Grads and buffers are restored."""
        params = [p for p in self.om.parameters() if p.requires_grad]
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        buffers = {k: b.clone() for k, b in self.om.named_buffers()}
        start = time.perf_counter()
        out = self.om(*self.inputs, **self.kwargs)
        loss = self.loss_fn(out) if self.loss_fn is not None else _as_loss(out)
        loss.backward()
        seconds = time.perf_counter() - start
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            for k, b in self.om.named_buffers():
                b.copy_(buffers[k])
        return seconds

    def ensure_captured(self) -> None:
        if not self.om.report.captures:
            self.step()

    def timed(self) -> float:
        """Median of five steps (after the engine has captured)."""
        self.ensure_captured()
        return sorted(self.step() for _ in range(5))[2]


def _as_loss(out: object) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("the model's output has no tensor that requires grad; pass loss_fn=...")
    return sum(t.float().sum() for t in leaves)


def _plan(om: ORTModule) -> RecomputePlan | None:
    return next((c.plan for c in om.report.captures if c.plan is not None), None)


class RecomputeToggles:
    """Choose what the backward recomputes: presets or one saved activation at a time.

    Args:
        om: the ORTModule to steer.
        *inputs: example inputs for measuring steps.
        loss_fn: turns the output into a scalar loss (default: sum of its tensors).

    Example:
        >>> t = RecomputeToggles(om, idx, targets)      # doctest: +SKIP
        >>> t.preset("layerwise"); print(t.apply())    # doctest: +SKIP
    """

    def __init__(self, om: ORTModule, *inputs: Any, loss_fn: Callable | None = None, **kwargs: Any) -> None:
        self.run = _Measured(om, inputs, kwargs, loss_fn)
        self.run.ensure_captured()
        current = om.options.recompute
        self.pending: str | tuple[str, ...] = current
        self.history: list[ApplyResult] = []

    @property
    def plan(self) -> RecomputePlan:
        plan = _plan(self.run.om)
        if plan is None:
            raise RuntimeError("no training graph was captured; the example inputs need a backward")
        return plan

    def recomputed(self) -> set[str]:
        """Names the pending choice recomputes (for presets: what the current plan does)."""
        if isinstance(self.pending, tuple):
            return set(self.pending)
        return {a.name for a in self.plan.recomputed} if self.pending == self.run.om.options.recompute else set()

    def preset(self, name: str) -> None:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {PRESETS}")
        self.pending = name

    def toggle(self, name: str, recompute: bool) -> None:
        """Recompute (or save) one activation; switches to an explicit selection."""
        known = {a.name for a in self.plan.activations}
        if name not in known:
            raise KeyError(f"{name!r} is not a saved activation; known: {sorted(known)[:8]}...")
        chosen = self.recomputed()
        chosen = chosen | {name} if recompute else chosen - {name}
        self.pending = tuple(sorted(chosen)) or "none"

    def apply(self) -> ApplyResult:
        """Re-capture with the pending choice and measure saved bytes and step time."""
        before_bytes, before_s = self.plan.saved_bytes, self.run.timed()
        self.run.om.reconfigure(recompute=self.pending)
        after_s = self.run.timed()
        result = ApplyResult(before_bytes, self.plan.saved_bytes, before_s, after_s, self.pending)
        self.history.append(result)
        return result

    def rows(self) -> list[dict[str, object]]:
        return [dataclasses.asdict(a) for a in self.plan.activations]

    def widget(self) -> Any:
        """An ipywidgets view: presets, one checkbox per saved activation, Apply."""
        import ipywidgets as w

        presets = w.ToggleButtons(options=list(PRESETS), value=self.pending if isinstance(self.pending, str) else None)
        boxes: dict[str, Any] = {}
        rows = []
        for a in self.plan.activations:
            label = f"{a.name}  {a.op}  {'x'.join(map(str, a.shape))}  {a.dtype}  {a.bytes:,} B  {a.module or '-'}"
            box = w.Checkbox(value=a.recomputed, description=label, indent=False, **_LABELLED(w))
            boxes[a.name] = box
            rows.append(w.HBox([box]))
        status = w.HTML(self._summary())
        apply = w.Button(description="Apply", button_style="primary")

        def on_preset(change: dict) -> None:
            if change["new"]:
                self.preset(change["new"])

        def on_box(name: str) -> Callable[[dict], None]:
            return lambda change: self.toggle(name, change["new"])

        def on_apply(_: object) -> None:
            status.value = "<i>re-capturing and measuring...</i>"
            result = self.apply()
            for a in self.plan.activations:
                if a.name in boxes:
                    boxes[a.name].value = a.recomputed
            status.value = self._summary() + f"<br><b>{html.escape(str(result))}</b>"

        presets.observe(on_preset, names="value")
        for name, box in boxes.items():
            box.observe(on_box(name), names="value")
        apply.on_click(on_apply)
        table = w.VBox(rows, layout=w.Layout(max_height="320px", overflow="auto", display="block"))
        return w.VBox([w.HTML("<b>Saved activations</b> (checked = recomputed in the backward)"), presets, table, apply, status])

    def _summary(self) -> str:
        p = self.plan
        return f"policy <code>{html.escape(p.policy)}</code>: {len(p.recomputed)} recomputed, {p.saved_bytes:,} bytes saved (without recompute {p.baseline_bytes:,})"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


@dataclasses.dataclass
class OpRow:
    """Ops of one type in one module, and where they run."""

    op: str
    module: str
    count: int
    where: str
    reason: str = ""


class FallbackToggles:
    """Send ops (by type, optionally within one module) to PyTorch and back.

    Example:
        >>> t = FallbackToggles(om, x)                       # doctest: +SKIP
        >>> t.send("aten.gelu", module="blocks.0"); t.apply()  # doctest: +SKIP
    """

    def __init__(self, om: ORTModule, *inputs: Any, loss_fn: Callable | None = None, **kwargs: Any) -> None:
        self.run = _Measured(om, inputs, kwargs, loss_fn)
        self.run.ensure_captured()
        self.pending: list[str] = list(om.options.fallback_ops)

    def rows(self) -> list[OpRow]:
        """Every op type per module across the captured graphs, with its placement."""
        counts: Counter[tuple[str, str]] = Counter()
        torch_reason: dict[tuple[str, str], str] = {}
        for capture in self.run.om.report.captures:
            for graph in capture.graphs:
                fell = {f.node: f.reason for f in graph.fallbacks if f.scope == "op"}
                whole = next((f.reason for f in graph.fallbacks if f.scope == "graph"), None)
                if graph.graph_module is None:
                    continue
                for node in graph.graph_module.graph.nodes:
                    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                        continue
                    key = (op_name(node), module_path(node))
                    counts[key] += 1
                    reason = whole or fell.get(node.name)
                    if reason:
                        torch_reason[key] = reason
        return [
            OpRow(op, module, n, "PyTorch" if (op, module) in torch_reason else "onnxruntime", torch_reason.get((op, module), ""))
            for (op, module), n in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        ]

    def send(self, op: str, module: str | None = None, to_pytorch: bool = True) -> None:
        """Mark ``op`` (within ``module`` if given) for PyTorch, or back to onnxruntime."""
        entry = f"{op}@{module}" if module else op
        if to_pytorch and entry not in self.pending:
            self.pending.append(entry)
        if not to_pytorch:
            self.pending = [e for e in self.pending if e != entry]

    def apply(self) -> list[OpRow]:
        """Re-capture with the pending ``fallback_ops``; returns the new placement."""
        self.run.om.reconfigure(fallback_ops=list(self.pending))
        self.run.ensure_captured()
        return self.rows()

    def widget(self) -> Any:
        import ipywidgets as w

        status = w.HTML()
        grid = w.VBox(layout=w.Layout(max_height="360px", overflow="auto", display="block"))

        def render() -> None:
            items = []
            for row in self.rows():
                pending = f"{row.op}@{row.module}" in self.pending or row.op in self.pending
                label = f"{row.op} x{row.count} in {row.module or '<root>'}"
                box = w.Checkbox(value=pending, description=label, indent=False, **_LABELLED(w))
                box.observe(lambda ch, r=row: self.send(r.op, r.module or None, ch["new"]), names="value")
                color = "#b00" if row.where == "PyTorch" else "#070"
                text = f"<span style='color:{color}'>{row.where}</span> {html.escape(row.reason)}"
                items.append(w.HBox([box, w.HTML(text)]))
            grid.children = items
            status.value = f"fallback_ops = <code>{html.escape(repr(self.pending))}</code>"

        apply = w.Button(description="Apply", button_style="primary")

        def on_apply(_: object) -> None:
            status.value = "<i>re-capturing...</i>"
            self.apply()
            render()

        apply.on_click(on_apply)
        render()
        return w.VBox([w.HTML("<b>Ops</b> (checked = send to PyTorch)"), grid, apply, status])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
