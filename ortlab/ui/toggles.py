"""Recompute and fallback toggles: change what the engine does, see what it cost.

The logic lives in plain classes (``RecomputeToggles``, ``FallbackToggles``) that tests
drive without a browser; ``.widget()`` builds the ipywidgets view on top of them.
Applying calls ``ORTModule.reconfigure`` (the engine re-captures with the new
choice), then runs one measuring step on the example inputs and puts gradients and
buffers back, so the user's training is not disturbed: the next training step uses
the new choice.

Each row (a saved activation, an op) links to its node in the module's own graphs
(``ortlab.ui._module_graphs``), shown in a netron view under the table: the node's
nn.Module and source line are in netron's sidebar.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import re
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ortlab._compat.torch import OpOverload
from ortlab.config import BUDGET, RECOMPUTE_PRESETS, describe_recompute, parse_budget, parse_recompute
from ortlab.errors import CaptureError, ConfigError, UnsupportedInputError
from ortlab.inspect.loss import default_loss
from ortlab.inspect.timing import Timing, compare_timings
from ortlab.ortmodule import ORTModule
from ortlab.partition.recompute import RecomputePlan
from ortlab.placement import selector_matches
from ortlab.provenance import module_path, op_name
from ortlab.stages import label
from ortlab.ui._html import esc, fmt_bytes, table
from ortlab.ui._links import Linker
from ortlab.ui.netron_view import HEIGHT

__all__ = ["RecomputeToggles", "FallbackToggles", "ApplyResult", "OpRow"]

logger = logging.getLogger(__name__)


def _cells(values: list[str], widths: list[int], wrap: tuple[int, ...] = ()) -> str:
    """One table row of a widget: ``values`` (already HTML) in columns ``widths`` (px) wide.

    Columns in ``wrap`` (names, modules, reasons) wrap onto more lines rather than lose their end (a long
    module path, the node link after a name); the others are cut with an ellipsis and say all in a tooltip.
    """
    spans = []
    for i, (v, w) in enumerate(zip(values, widths)):
        fit = ("white-space:normal;overflow-wrap:anywhere;line-height:16px;padding:6px 6px 6px 0" if i in wrap
               else "white-space:nowrap;overflow:hidden;text-overflow:ellipsis;padding-right:6px")
        title = html.escape(re.sub(r"<[^>]+>", "", v).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"),
                            quote=True)
        spans.append(f"<span title=\"{title}\" style='display:inline-block;width:{w}px;{fit};vertical-align:top'>"
                     f"{v}</span>")
    return f"<div style='font-size:12px;line-height:28px'>{''.join(spans)}</div>"


def _header(names: list[str], widths: list[int]) -> str:
    """The header of a widget table, over the rows' checkbox column."""
    return f"<div style='padding-left:28px'>{_cells([f'<b>{esc(n)}</b>' for n in names], widths)}</div>"


def _name(linker: Linker, text: str, url: str | None) -> str:
    """A row's name linked to its node; without one (folded or optimized away), a tooltip says so."""
    if url is None and linker.active:
        return f"<span title='no node of its own in the graphs onnxruntime runs (optimized away)'>{text}</span>"
    return linker.link(text, url)


def _table_box(w: Any, rows: list[Any]) -> Any:
    return w.VBox(rows, layout=w.Layout(max_height="320px", overflow="auto", display="block"))


def _viewer(linker: Linker, urls: list[str | None]) -> str:
    """The netron view the rows' links open in, showing the first linked row's node."""
    return linker.viewer(next((u for u in urls if u), None), HEIGHT)


def _linker(om: ORTModule) -> Linker:
    from ortlab.ui._module_graphs import module_linker

    return module_linker(om)


@dataclasses.dataclass
class ApplyResult:
    """What applying a new choice changed."""

    before_bytes: int
    after_bytes: int
    before: Timing
    after: Timing
    choice: object

    @property
    def before_step_s(self) -> float:
        return self.before.median

    @property
    def after_step_s(self) -> float:
        return self.after.median

    def __str__(self) -> str:
        return f"saved activations {self.before_bytes:,} -> {self.after_bytes:,} bytes; " + compare_timings(
            self.before, self.after)


@dataclasses.dataclass
class FallbackApplyResult:
    """What applying new fallback ops changed: ops in PyTorch, and the step time."""

    before_torch_ops: int
    after_torch_ops: int
    before: Timing
    after: Timing

    def __str__(self) -> str:
        return (f"ops in PyTorch {self.before_torch_ops} -> {self.after_torch_ops}; "
                + compare_timings(self.before, self.after))


class _Measured:
    """Runs measuring steps on example inputs without disturbing training state."""

    def __init__(self, om: ORTModule, inputs: tuple, kwargs: dict, loss_fn: Callable | None) -> None:
        if not isinstance(om, ORTModule):
            raise UnsupportedInputError(
                f"toggles work on an ortlab.ORTModule, got {type(om).__name__}: wrap it with ortlab.ORTModule(model)."
            )
        self.om, self.inputs, self.kwargs, self.loss_fn = om, inputs, kwargs, loss_fn

    def step(self) -> float:
        """One forward+backward; returns seconds. Grads and buffers are restored."""
        params = [p for p in self.om.parameters() if p.requires_grad]
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        buffers = {k: b.clone() for k, b in self.om.named_buffers()}
        # A measuring step is no training step: a monitor watching the module does not see it (its loss
        # panel showed the example batch's loss flat, and the re-captures' seconds as step times).
        watcher = self.om.set_call_watcher(None)
        try:
            start = time.perf_counter()
            out = self.om(*self.inputs, **self.kwargs)
            loss = (self.loss_fn or default_loss)(out)
            if loss is None:
                raise ConfigError("the model's output has no floating tensor that requires grad; pass loss_fn=...")
            loss.backward()
            seconds = time.perf_counter() - start
        finally:
            self.om.set_call_watcher(watcher)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            for k, b in self.om.named_buffers():
                b.copy_(buffers[k])
        return seconds

    def ensure_captured(self) -> None:
        if not self.om.report.captures:
            self.step()

    def timed(self, steps: int = 7) -> Timing:
        """``steps`` steps after the engine has captured (see Note [Noisy timings are not findings]); a step that
        captured again (a guard failed: new shapes, a changed option) is left out and one more is taken."""
        self.ensure_captured()
        self.step()  # one more warm-up: the first run of new sessions allocates
        samples: list[float] = []
        for _ in range(3 * steps):
            captures = len(self.om.report.captures)
            seconds = self.step()
            if len(self.om.report.captures) == captures:
                samples.append(seconds)
            if len(samples) == steps:
                break
        return Timing(tuple(samples))


class _WhenCaptured:
    """A stage sink redrawing a toggles widget once a training capture's backward is exported.

    A cell that calls ``model.reconfigure(recompute=...)`` and trains re-captures the
    module; the widget shown earlier then shows the policy and plan in force. It asks
    only for a stage the engine makes anyway (``exported``; the plan is known by then),
    and holds the toggles weakly: the engine's backend, which torch keeps, holds the
    sink. A redraw that raises (a closed widget) stops it.
    """

    def __init__(self, toggles: RecomputeToggles) -> None:
        self._toggles: weakref.ref[RecomputeToggles] | None = weakref.ref(toggles)

    def wants(self, stage: str) -> bool:
        return self._toggles is not None and stage == "exported"

    def accept(self, artifact: Any) -> None:
        toggles = self._toggles() if self._toggles is not None else None
        if toggles is None or not artifact.label.endswith("backward"):
            return
        try:
            if toggles._captured_in_code is not None:
                toggles._captured_in_code()
        except Exception as e:  # a closed widget, a module gone: stop following
            logger.debug("recompute toggles stop following captures: %s", e)
            self._toggles = None


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
        self._captured_in_code: Callable[[], None] | None = None  # the shown widget's redraw
        self._following = False  # a _WhenCaptured sink was added to the module
        self.points: list[Any] = []  # the last trade_off()

    @property
    def plan(self) -> RecomputePlan:
        plan = _plan(self.run.om)
        if plan is None:
            raise CaptureError(
                "no training graph was captured, so there are no saved activations: the example inputs need "
                "a backward (grad enabled and parameters that require grad)."
            )
        return plan

    def recomputed(self) -> set[str]:
        """Names the pending choice recomputes: the plan in force, with the pending rows on it."""
        preset, added, removed = parse_recompute(self.pending)
        in_force = {a.name for a in self.plan.recomputed}
        if parse_recompute(self.run.om.options.recompute)[0] != preset:
            in_force = set()  # another preset: its plan is known after Apply
        return (in_force | set(added)) - set(removed)

    def preset(self, name: str) -> None:
        if name not in RECOMPUTE_PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {tuple(RECOMPUTE_PRESETS)}.")
        self.pending = name

    def budget(self, value: object) -> None:
        """Pend a memory budget: ``0.5`` of the bytes saved without recompute, or ``"300MB"``
        (Note [A memory budget] in ortlab.partition.recompute)."""
        parse_budget(value)
        self.pending = (BUDGET, value)

    def trade_off(self, policies: Any = None, steps: int = 5,
                  progress: Callable[[str], None] | None = None) -> list[Any]:
        """Each policy (default: none, auto, layerwise, budgets of 75/50/25/10%) re-captured and
        measured: saved bytes and step time with spread (``ortlab.ui.tradeoff.TradePoint``). The
        module runs the policy in force again afterwards. ``ortlab.ui.tradeoff.figure`` draws them."""
        from ortlab.ui import tradeoff

        self.points = tradeoff.measure(self, policies or tradeoff.TRADE_OFF_POLICIES, steps, progress)
        return self.points

    def toggle(self, name: str, recompute: bool) -> None:
        """Recompute (or save) one activation on top of the pending preset: ``("layerwise", "+name")``.

        The preset's own choices stay (see Note [Rows never add bytes] in ortlab.partition.recompute).
        """
        known = {a.name for a in self.plan.activations}
        if name not in known:
            raise ConfigError(f"{name!r} is not a saved activation; known: {sorted(known)[:8]}...")
        preset, added, removed = parse_recompute(self.pending)
        added, removed = [a for a in added if a != name], [r for r in removed if r != name]
        preset_recomputes = name in {a.name for a in self.plan.recomputed} and \
            parse_recompute(self.run.om.options.recompute)[0] == preset and \
            name not in parse_recompute(self.run.om.options.recompute)[1]
        if recompute and not preset_recomputes:
            added.append(name)
        elif not recompute and preset_recomputes:
            removed.append(name)
        rows = [*(f"+{a}" for a in added), *(f"-{r}" for r in removed)]
        head = tuple(self.pending[:2]) if preset == BUDGET else (preset,)  # a budget keeps its value
        self.pending = (*head, *rows) if rows or preset == BUDGET else preset

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

    def urls(self, linker: Linker | None = None) -> dict[str, str | None]:
        """Each saved activation's node in netron (the module's own graphs), by name; None where none."""
        linker = linker or _linker(self.run.om)
        index = next(c.index for c in self.run.om.report.captures if c.plan is self.plan)
        return {a.name: linker.fx_node(label(index, "forward"), a.name) or linker.fx_node(label(index, "backward"), a.name)
                for a in self.plan.activations}

    def widget(self) -> Any:
        """An ipywidgets view: presets, one checkbox per saved activation (its name linked to
        netron), Apply, and the netron view the links open in."""
        import ipywidgets as w

        from ortlab.ui._snapshot import Snapshot, attach

        linker = _linker(self.run.om)
        snapshot = Snapshot("the recompute toggles", render=self.snapshot_html)  # redrawn after each change
        widths = [270, 150, 80, 60, 70, 110]  # 740 px + the box: one line in an 800 px output
        choices = {**{p: p for p in RECOMPUTE_PRESETS}, **{describe_recompute((BUDGET, b)): (BUDGET, b)
                                                           for b in (0.75, 0.5, 0.25, 0.1)}}
        tips = [*RECOMPUTE_PRESETS.values(), *(f"recompute the fewest FLOPs that keep the saved activations within "
                                               f"{b:.0%} of those saved without recompute" for b in (0.75, 0.5, 0.25, 0.1))]

        def choice_of(policy: object) -> str | None:
            head = describe_recompute(policy).split(" +")[0].split(" -")[0]
            return head if head in choices else None

        presets = w.ToggleButtons(options=list(choices), tooltips=tips, value=choice_of(self.pending),
                                  style={"button_width": "104px"})
        boxes: dict[str, Any] = {}
        cells: dict[str, Any] = {}

        def row_html(a: Any, url: str | None) -> str:
            # What a user knows it as first (blocks.0.ln1: LayerNorm output), the FX node after it.
            node = _name(linker, f"<code>{esc(a.name)}</code>", url)
            return _cells([f"{esc(a.label)} <small>{node}</small>", f"<code>{esc(a.op)}</code>",
                           esc("x".join(map(str, a.shape)) or "scalar"), esc(a.dtype), fmt_bytes(a.bytes),
                           esc(a.module or "<root>")], widths, wrap=(0, 5))

        urls = self.urls(linker)
        rows = []
        for a in self.plan.activations:
            boxes[a.name] = w.Checkbox(value=a.recomputed, indent=False, layout=w.Layout(width="28px"))
            cells[a.name] = w.HTML(row_html(a, urls[a.name]))
            rows.append(w.HBox([boxes[a.name], cells[a.name]]))
        status = w.HTML(self._summary())
        apply = w.Button(description="Apply", button_style="primary")
        viewer = w.HTML(_viewer(linker, list(urls.values())))

        def on_preset(change: dict) -> None:
            if change["new"]:
                chosen = choices[change["new"]]
                self.preset(chosen) if isinstance(chosen, str) else self.budget(chosen[1])

        def on_box(name: str) -> Callable[[dict], None]:
            return lambda change: self.toggle(name, change["new"])

        def redraw(note: str) -> None:
            """Rows, preset and policy as the module runs now (after Apply, or a capture from code)."""
            linker.forget()  # the module re-captured: new graphs
            new_urls = self.urls(linker)
            in_force = self.run.om.options.recompute
            for a in self.plan.activations:
                if a.name in boxes:
                    boxes[a.name].value = a.recomputed
                    cells[a.name].value = row_html(a, new_urls.get(a.name))
            presets.value = choice_of(in_force)
            self.pending = in_force  # the observers above edited it; what is pending now is what runs
            viewer.value = _viewer(linker, list(new_urls.values()))
            status.value = self._summary() + note
            snapshot.refresh()

        applying = [False]  # Apply redraws by itself; a capture from code redraws through the sink

        def on_apply(_: object) -> None:
            status.value = "<i>re-capturing and measuring...</i>"
            applying[0] = True
            try:
                result = self.apply()
            finally:
                applying[0] = False
            redraw(f"<br><b>{esc(result)}</b>")

        def captured_in_code() -> None:
            if not applying[0]:
                redraw("<br><i>re-captured from code: this is the policy the module runs now</i>")

        presets.observe(on_preset, names="value")
        for name, box in boxes.items():
            box.observe(on_box(name), names="value")
        apply.on_click(on_apply)
        self._captured_in_code = captured_in_code  # the last widget shown follows captures from code
        if not self._following:
            self.run.om.add_stage_sink(_WhenCaptured(self))
            self._following = True
        title = w.HTML("<b>Saved activations</b> (checked = recomputed in the backward; a name opens its node in netron)")
        header = w.HTML(_header(["activation (FX node)", "op", "shape", "dtype", "bytes", "module"], widths))
        measure = w.Button(description="Measure the trade-off", tooltip="re-capture and time every preset and "
                           "budgets of 75/50/25/10%: saved bytes against step time", layout=w.Layout(width="200px"))
        plot = w.Box(layout=w.Layout(width="100%"))

        def apply_point(policy: object) -> None:
            self.pending = policy
            on_apply(None)
            draw_points()

        def draw_points() -> None:
            plot.children = [self._trade_off_view(w, apply_point)]

        def on_measure(_: object) -> None:
            def progress(text: str) -> None:
                status.value = f"<i>{esc(text)}</i>"

            self.trade_off(progress=progress)
            redraw("")
            draw_points()
            snapshot.refresh()

        measure.on_click(on_measure)
        if self.points:  # measured from code (toggles.trade_off()) before the widget was shown
            draw_points()
        box = w.VBox([title, presets, header, _table_box(w, rows), w.HBox([apply, measure]), status, plot, viewer])
        return attach(box, snapshot)

    def snapshot_html(self) -> str:
        """The toggles' state as plain HTML: the policy, each saved activation, the last Apply and
        the measured trade-off (what a reopened notebook shows, ``ortlab.ui._snapshot``)."""
        from ortlab.ui import tradeoff

        parts = [self._summary()]
        if self.history:
            parts.append(f"last Apply: {esc(self.history[-1])}")
        rows = [[esc(a.label), f"<code>{esc(a.name)}</code>", f"<code>{esc(a.op)}</code>",
                 esc("x".join(map(str, a.shape)) or "scalar"), fmt_bytes(a.bytes), "yes" if a.recomputed else "no"]
                for a in self.plan.activations]
        parts.append(table(["activation", "FX node", "op", "shape", "bytes", "recomputed"], rows, limit=40))
        if self.points:
            best = tradeoff.best_points(self.points)
            parts.append("<b>trade-off</b> (step time: median, min-max)" + table(
                ["policy", "saved bytes", "step time", "cost", "best on both axes"],
                [[esc(p.label), f"{p.saved_bytes:,}", esc(p.timing), esc(p.cost), "yes" if p in best else ""]
                 for p in self.points]))
        return "<br>".join(parts)

    def _trade_off_view(self, w: Any, apply_point: Callable[[object], None]) -> Any:
        """The measured points as a FigureWidget whose points apply on click; where FigureWidget does
        not render, a plain figure and a menu of the points."""
        import plotly.graph_objects as go

        from ortlab.ui import tradeoff
        from ortlab.ui._monitor_figure import widgets_render_here

        points = self.points
        fig = tradeoff.figure(points, in_force=self.run.om.options.recompute)
        best = ", ".join(p.label for p in tradeoff.best_points(points))
        note = w.HTML(f"best on both axes: {esc(best)}. Bars: the fastest and slowest of the measured steps; "
                      "points whose bars overlap differ by noise.")
        if widgets_render_here():
            try:
                view = go.FigureWidget(fig)

                def clicked(trace: Any, where: Any, _state: Any) -> None:
                    if where.point_inds:
                        apply_point(points[where.point_inds[0]].policy)

                view.data[1].on_click(clicked)
                return w.VBox([view, note])
            except Exception as e:  # noqa: BLE001 - anywidget missing: the plain figure and a menu instead
                logger.info("trade-off view: no FigureWidget (%s)", e)
        menu = w.Dropdown(options=[(p.label, i) for i, p in enumerate(points)], description="apply")
        go_button = w.Button(description="Apply point")
        go_button.on_click(lambda _: apply_point(points[menu.value].policy))
        out = w.Output()
        with out:
            from IPython.display import display
            display(fig)
        return w.VBox([out, w.HBox([menu, go_button]), note])

    def _summary(self) -> str:
        p = self.plan
        text = (f"policy in force <code>{esc(describe_recompute(self.run.om.options.recompute))}</code>: "
                f"{len(p.recomputed)} recomputed, {p.saved_bytes:,} bytes saved (without recompute {p.baseline_bytes:,})")
        if p.recompute_flops:
            text += f"; {esc(p.cost)}"
        if p.note:
            text += f"<br><b>{esc(p.note)}</b>"
        for row, why in p.rejected.items():
            text += f"<br>left out <code>+{esc(row)}</code>: {esc(why)}"
        return text

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
    nodes: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (graph label, FX node)


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
        self.history: list[FallbackApplyResult] = []

    def rows(self) -> list[OpRow]:
        """Every op type per module across the captured graphs, with its placement."""
        counts: Counter[tuple[str, str]] = Counter()
        torch_reason: dict[tuple[str, str], str] = {}
        nodes: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for capture in self.run.om.report.captures:
            for graph in capture.graphs:
                where = graph.label
                fell = {f.node: f.reason for f in graph.fallbacks if f.scope == "op"}
                whole = next((f.reason for f in graph.fallbacks if f.scope == "graph"), None)
                if graph.graph_module is None:
                    continue
                for node in graph.graph_module.graph.nodes:
                    if node.op != "call_function" or not isinstance(node.target, OpOverload):
                        continue
                    key = (op_name(node), module_path(node))
                    counts[key] += 1
                    nodes.setdefault(key, []).append((where, node.name))
                    reason = whole or fell.get(node.name)
                    if reason:
                        torch_reason[key] = reason
        return [
            OpRow(op, module, n, "PyTorch" if (op, module) in torch_reason else "onnxruntime",
                  torch_reason.get((op, module), ""), nodes[(op, module)])
            for (op, module), n in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        ]

    @staticmethod
    def url(row: OpRow, linker: Linker) -> str | None:
        """The row's first node in netron (for an op that runs in PyTorch: the partition reading its value)."""
        return next((url for where, name in row.nodes if (url := linker.fx_node(where, name))), None)

    def send(self, op: str, module: str | None = None, to_pytorch: bool = True) -> None:
        """Mark ``op`` (within ``module`` if given) for PyTorch, or back to onnxruntime."""
        entry = f"{op}@{module}" if module else op
        if to_pytorch and entry not in self.pending:
            self.pending.append(entry)
        if not to_pytorch:
            self.pending = [e for e in self.pending if e != entry]

    def apply(self) -> FallbackApplyResult:
        """Re-capture with the pending ``fallback_ops``; ``rows()`` then gives the new placement."""
        before_ops, before_s = self._torch_ops(), self.run.timed()
        self.run.om.reconfigure(fallback_ops=list(self.pending))
        after_s = self.run.timed()
        result = FallbackApplyResult(before_ops, self._torch_ops(), before_s, after_s)
        self.history.append(result)
        return result

    def _torch_ops(self) -> int:
        return sum(g.torch_nodes for c in self.run.om.report.captures for g in c.graphs)

    def widget(self) -> Any:
        """An ipywidgets view: one checkbox per op type and module (the op linked to its first
        node in netron), where it runs and why, Apply, and the netron view the links open in."""
        import ipywidgets as w

        from ortlab.ui._snapshot import Snapshot, attach

        linker = _linker(self.run.om)
        snapshot = Snapshot("the fallback toggles", render=self.snapshot_html)  # redrawn after each Apply
        widths = [170, 40, 140, 90, 330]
        status = w.HTML()
        grid = _table_box(w, [])
        viewer = w.HTML()

        def render() -> None:
            items, urls = [], []
            for row in self.rows():
                pending = any(selector_matches(row.op, row.module, s) for s in self.pending)
                box = w.Checkbox(value=pending, indent=False, layout=w.Layout(width="28px"))
                box.observe(lambda ch, r=row: self.send(r.op, r.module or None, ch["new"]), names="value")
                urls.append(self.url(row, linker))
                color = "#b00" if row.where == "PyTorch" else "#070"
                text = _cells([_name(linker, f"<code>{esc(row.op)}</code>", urls[-1]), f"x{row.count}",
                               esc(row.module or "<root>"), f"<span style='color:{color}'>{row.where}</span>",
                               esc(row.reason)], widths, wrap=(0, 2, 4))
                items.append(w.HBox([box, w.HTML(text)]))
            grid.children = items
            viewer.value = _viewer(linker, urls)
            status.value = f"fallback_ops = <code>{esc(repr(self.pending))}</code>"

        apply = w.Button(description="Apply", button_style="primary")

        def on_apply(_: object) -> None:
            status.value = "<i>re-capturing and measuring...</i>"
            result = self.apply()
            linker.forget()  # the module re-captured: new graphs
            render()
            status.value += f"<br><b>{esc(result)}</b>"
            snapshot.refresh()

        apply.on_click(on_apply)
        render()
        title = w.HTML("<b>Ops</b> (checked = send to PyTorch; an op opens its first node in netron)")
        header = w.HTML(_header(["op", "count", "module", "runs in", "why"], widths))
        return attach(w.VBox([title, header, grid, apply, status, viewer]), snapshot)

    def snapshot_html(self) -> str:
        """The ops, where each runs and why, and the last Apply, as plain HTML (``ortlab.ui._snapshot``)."""
        parts = [f"fallback_ops = <code>{esc(repr(list(self.run.om.options.fallback_ops)))}</code>"]
        if self.history:
            parts.append(f"last Apply: {esc(self.history[-1])}")
        parts.append(table(["op", "count", "module", "runs in", "why"], [
            [f"<code>{esc(r.op)}</code>", f"x{r.count}", esc(r.module or "<root>"), r.where, esc(r.reason)]
            for r in self.rows()], limit=40))
        return "<br>".join(parts)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())
