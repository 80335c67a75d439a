"""The stepper in a notebook: each stage as HTML, and a widget to run and browse them.

``Stage._repr_html_`` and ``Lab._repr_html_`` render through :func:`stage_html` and
:func:`lab_html` (plain HTML, no widget library needed), which this module registers
(``ortlab.inspect.views``) when it is imported; :class:`StepperWidget` adds
buttons (ipywidgets, imported when it is built). Rows of the tables (a saved
activation, an op that falls back to PyTorch) link to that node in a netron view of
the stage's ONNX graph when a graph view is open (the shared netron server is
running, see ``ortlab.ui.netron_view``); links open in the lab's netron frame, or in
a new tab when there is none.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

from ortlab.errors import ConfigError
from ortlab.inspect.lab import Lab
from ortlab.inspect.lab_stage import Stage
from ortlab.inspect.views import register_view
from ortlab.ui._html import badge, esc, fmt_bytes, fmt_seconds, table
from ortlab.ui._links import Linker

__all__ = ["stage_html", "lab_html", "StepperWidget", "stepper"]

TOP_OPS = 25


# ---------------------------------------------------------------------------- stage tables
def _ops_table(stage: Stage) -> str:
    diff = stage.diff
    rows = []
    for op, n in stage.op_counts.items():
        delta = ""
        if diff is not None:
            if op in diff.added:
                delta = f"<span style='color:#1a7f37'>+{esc(diff.added[op])}</span>"
            elif op in diff.removed:
                delta = f"<span style='color:#cf222e'>-{esc(diff.removed[op])}</span>"
        rows.append([f"<code>{esc(op)}</code>", esc(n), delta])
    if diff is not None:
        gone = [op for op in diff.removed if op not in stage.op_counts]
        rows += [[f"<code style='color:#999'>{esc(op)}</code>", "0",
                  f"<span style='color:#cf222e'>-{esc(diff.removed[op])}</span>"] for op in gone]
    return table(["op", "count", f"vs {stage.previous}" if stage.previous else ""], rows, TOP_OPS)


def _diff_html(stage: Stage) -> str:
    d = stage.diff
    if d is None:
        return ""
    if not d.changed:
        return (f"<p style='font-size:12px'>No change in op counts from <b>{esc(stage.previous)}</b> "
                f"({esc(d.after)} ops).</p>")
    def chips(ops: dict[str, int], sign: str, color: str) -> str:
        return " ".join(f"<code style='color:{color}'>{esc(op)} {sign}{esc(n)}</code>"
                        for op, n in list(ops.items())[:12])
    parts = [f"<b>{esc(d.before)}</b> &rarr; <b>{esc(d.after)}</b> ops from <b>{esc(stage.previous)}</b>"]
    if d.added:
        parts.append("added " + chips(d.added, "+", "#1a7f37"))
    if d.removed:
        parts.append("removed " + chips(d.removed, "-", "#cf222e"))
    return "<p style='font-size:12px'>" + "<br>".join(parts) + "</p>"


def _graphs_table(stage: Stage, linker: Linker) -> str:
    if not stage.graph_op_counts and not stage.artifacts:
        return ""
    rows = []
    labels = list(dict.fromkeys([*stage.graph_op_counts, *stage.artifacts]))
    for label in labels:
        counts = stage.graph_op_counts.get(label, {})
        rel = stage.artifacts.get(label, "")
        name = esc(os.path.basename(rel))
        if rel and stage.kind == "onnx" and linker.active:
            path = _artifact(stage, label)
            name = linker.link(name, linker.url(path) if path is not None else None)
        rows.append([f"<code>{esc(label)}</code>", esc(sum(counts.values())), name,
                     f"<code>{esc(f'lab[{stage.name!r}].view({label!r})')}</code>" if rel else ""])
    return "<h4 style='margin:8px 0 2px'>Graphs</h4>" + table(["graph", "ops", "file", "open"], rows, 20)


def _artifact(stage: Stage, label: str) -> str | None:
    """The stage's file ``label``; None for one leading out of the lab folder (no link to it)."""
    try:
        return stage.artifact(label)
    except ConfigError:
        return None


def _breaks_table(stage: Stage) -> str:
    if not stage.graph_breaks:
        return "<p style='font-size:12px'>No graph breaks: one graph per call.</p>" if stage.name == "captured" else ""
    rows = [[esc(b.reason), esc(b.count), f"<code>{esc(b.location)}</code>" if b.location else "",
             f"<details><summary>details</summary><pre style='white-space:pre-wrap;font-size:11px'>"
             f"{esc(b.detail)}</pre></details>" if b.detail and b.detail != b.reason else ""]
            for b in stage.graph_breaks]
    return ("<h4 style='margin:8px 0 2px'>Graph breaks (the code around each runs in PyTorch)</h4>"
            + table(["reason", "count", "where", ""], rows))


def _number(value: object) -> float:
    """A summary figure as a number (0 for one that is missing or not a number)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _activations_table(stage: Stage, linker: Linker) -> str:
    if not stage.activations:
        return ""
    rows = []
    for a in sorted(stage.activations, key=lambda r: -r.bytes):
        name = linker.link(f"<code>{esc(a.name)}</code>", linker.activation(a))
        rows.append([esc(a.graph), name, f"<code>{esc(a.op)}</code>", esc("x".join(map(str, a.shape)) or "scalar"),
                     esc(a.dtype), fmt_bytes(a.bytes), esc(a.module or "<root>"), f"<small>{esc(a.source)}</small>",
                     ("recomputed" + (f": {esc(a.reason)}" if a.reason else "")) if a.recomputed else "saved"])
    s = stage.summary
    head = (f"<h4 style='margin:8px 0 2px'>Saved activations: {esc(s.get('saved', 0))} saved, "
            f"{esc(s.get('recomputed', 0))} recomputed, {fmt_bytes(_number(s.get('saved_bytes')))} "
            f"(without recompute {fmt_bytes(_number(s.get('baseline_bytes')))})</h4>")
    return head + table(["graph", "name", "op", "shape", "dtype", "bytes", "module", "source", ""], rows, 30)


def _fallbacks_table(stage: Stage, linker: Linker) -> str:
    if not stage.fallbacks:
        return "<p style='font-size:12px'>Nothing runs in PyTorch.</p>" if stage.name == "exported" else ""
    rows = []
    for f in stage.fallbacks:
        what = f"<code>{esc(f.op or f.scope)}</code>" + (f" ({esc(f.node)})" if f.node else "")
        rows.append([esc(f.where), linker.link(what, linker.fallback(f)), esc(f.module or ""),
                     f"<small>{esc(f.source)}</small>", esc(f.reason)])
    return ("<h4 style='margin:8px 0 2px'>Runs in PyTorch instead of onnxruntime</h4>"
            + table(["graph", "op", "module", "source", "why"], rows, 30))


def _summary(stage: Stage) -> str:
    skip = {"saved", "recomputed", "saved_bytes", "baseline_bytes"}
    items = []
    for k, v in stage.summary.items():
        if k in skip:
            continue
        if isinstance(v, float):
            v = fmt_seconds(v) if k.endswith("_s") else f"{v:.6g}"
        items.append(f"<b>{esc(k.replace('_', ' '))}</b>: {esc(v)}")
    return f"<p style='font-size:12px'>{' &middot; '.join(items)}</p>" if items else ""


def stage_html(stage: Stage) -> str:
    """One stage: status, op counts and their change, timings, tables and files.

    Example:
        >>> from IPython.display import HTML; HTML(stage_html(lab["split"]))   # doctest: +SKIP
    """
    linker = Linker.for_stage(stage)
    index = stage.lab.stages.index(stage) + 1 if stage.lab is not None else ""
    head = (f"<div style='font-family:sans-serif;font-size:13px'><h3 style='margin:4px 0'>"
            f"{index}{'. ' if index else ''}{esc(stage.title or stage.name)} {badge(stage.status)} "
            f"<small style='color:#666'><code>{esc(stage.name)}</code>"
            f"{' &middot; ' + fmt_seconds(stage.seconds) if stage.seconds is not None else ''}"
            f"{' &middot; ' + esc(stage.total_ops) + ' ops' if stage.op_counts else ''}</small></h3>"
            f"<p style='color:#444;margin:2px 0'>{esc(stage.description)}</p>")
    parts = [head]
    if stage.error:
        parts.append(f"<pre style='color:#cf222e;white-space:pre-wrap'>{esc(stage.error)}</pre>")
    if stage.notes:
        items = "".join(f"<li>{esc(n)}</li>" for n in stage.notes)
        parts.append(f"<ul style='font-size:12px;margin:2px 0'>{items}</ul>")
    if stage.status == "pending":
        call = esc(f"lab.run({stage.name!r})")
        parts.append(f"<p style='font-size:12px'>Not run yet: <code>{call}</code>.</p></div>")
        return "".join(parts)
    parts += [_summary(stage), _diff_html(stage), _breaks_table(stage)]
    if stage.op_counts:
        parts.append("<h4 style='margin:8px 0 2px'>Op counts</h4>" + _ops_table(stage))
    parts += [_activations_table(stage, linker), _fallbacks_table(stage, linker), _graphs_table(stage, linker)]
    if stage.timings:
        rows = [[esc(k), fmt_seconds(v)] for k, v in stage.timings.items()]
        parts.append("<details><summary style='font-size:12px'>Timings</summary>"
                     + table(["what", "time"], rows) + "</details>")
    if not linker.active and stage.kind == "onnx" and stage.artifacts:
        call = esc(f"lab[{stage.name!r}].view()")
        parts.append(f"<p style='font-size:12px;color:#666'>Open a graph with <code>{call}</code>; "
                     "table rows then link to their nodes.</p>")
    elif stage.activations and linker.activation(stage.activations[0]) is None:
        exported = stage.lab is not None and any(s.name == "exported" and s.status == "done" for s in stage.lab.stages)
        todo = "open a graph with <code>lab['exported'].view()</code>" if exported else \
            "run the <code>exported</code> stage and open its graph with <code>lab['exported'].view()</code>"
        parts.append(f"<p style='font-size:12px;color:#666'>Rows link to their node in netron once there is an "
                     f"ONNX graph to show them in: {todo}, then display this stage again.</p>")
    parts.append("</div>")
    return "".join(parts)


def lab_html(lab: Lab) -> str:
    """The lab at a glance: every stage with its status, ops, change and time.

    Example:
        >>> from IPython.display import HTML; HTML(lab_html(lab))     # doctest: +SKIP
    """
    rows = []
    for i, s in enumerate(lab.stages, 1):
        change = ""
        if s.diff is not None and s.status == "done":
            change = f"{esc(s.diff.before)} &rarr; {esc(s.diff.after)}" if s.diff.changed else "no change"
        rows.append([str(i), f"<code>{esc(s.name)}</code>", esc(s.title), badge(s.status),
                     esc(s.total_ops) if s.op_counts else "", change, fmt_seconds(s.seconds),
                     esc(s.error or (s.notes[0] if s.status == "skipped" and s.notes else ""))])
    meta = lab.meta
    inputs = ", ".join(meta.get("inputs", []))
    pending = next((s.name for s in lab.stages if s.status == "pending"), None)
    hint = (f"Next: <code>lab.next()</code> runs <code>{esc(pending)}</code>; <code>lab.run()</code> runs all."
            if pending else "All stages ran: display one with <code>lab['name']</code>, open its graph with "
            "<code>.view()</code>.")
    return (f"<div style='font-family:sans-serif;font-size:13px'><h3 style='margin:4px 0'>ortlab lab: "
            f"{esc(meta.get('model', ''))}({esc(inputs)})</h3>"
            f"<p style='font-size:12px;color:#666;margin:2px 0'>{esc(lab.folder)}</p>"
            + table(["#", "stage", "", "status", "ops", "change", "time", "note"], rows)
            + f"<p style='font-size:12px'>{hint}</p></div>")


# ----------------------------------------------------------------------------------- widget
class StepperWidget:
    """Buttons to run the next stage or all, a stage picker, and the graph of the stage.

    Example:
        >>> StepperWidget(ortlab.explore(model, x)).widget      # doctest: +SKIP
    """

    def __init__(self, lab: Lab) -> None:
        import ipywidgets as w

        from ortlab.ui._snapshot import Snapshot

        self.lab = lab
        self.snapshot = Snapshot("the stepper", render=self.snapshot_html)  # for a reopened notebook
        self.stage = w.Dropdown(options=self._options(), description="stage")
        self.graph = w.Dropdown(options=[], description="graph")
        self.next_button = w.Button(description="Run next", icon="step-forward", button_style="primary")
        self.all_button = w.Button(description="Run all", icon="fast-forward")
        self.view_button = w.Button(description="View graph", icon="project-diagram")
        self.overview = w.HTML(lab_html(lab))
        self.body = w.HTML()
        self.viewer = w.HTML()
        self.next_button.on_click(lambda _: self._run(lambda: self.lab.next(raise_errors=False)))
        self.all_button.on_click(lambda _: self._run(lambda: self.lab.run(raise_errors=False)))
        self.view_button.on_click(lambda _: self._view())
        self.stage.observe(lambda change: self._show(change["new"]), names="value")
        self.widget = w.VBox([
            w.HBox([self.next_button, self.all_button]),
            self.overview,
            w.HBox([self.stage, self.graph, self.view_button]),
            self.viewer,  # right under its button: the view opens where it was asked for
            self.body,
        ])
        current = lab.current
        self._show(current.name if current is not None else lab.stages[0].name)
        # Stages run from other cells (lab.run(...)) redraw the overview too. The lab holds
        # the stepper weakly: a stepper nobody shows any more is dropped, not kept alive.
        method = weakref.WeakMethod(self._staged)

        def staged(stage: Stage) -> None:
            live = method()
            if live is None:
                raise ReferenceError("the stepper is gone")
            live(stage)

        lab.on_stage(staged)

    def _options(self) -> list[tuple[str, str]]:
        return [(f"{i}. {s.name} ({s.status})", s.name) for i, s in enumerate(self.lab.stages, 1)]

    def _run(self, step: Callable[[], Stage]) -> None:
        self.next_button.disabled = self.all_button.disabled = True
        try:
            stage = step()
        except Exception as e:  # every stage ran, or an earlier one failed: say so in the page
            self.body.value = f"<pre style='color:#cf222e'>{esc(e)}</pre>"
            stage = None
        finally:
            self.next_button.disabled = self.all_button.disabled = self.lab.done
        self.overview.value = lab_html(self.lab)
        self.stage.options = self._options()
        if stage is not None:
            self.stage.value = stage.name
            self._show(stage.name)

    def _staged(self, stage: Stage) -> None:
        """A stage ran (from a button or any cell): redraw the overview and picker, show that stage."""
        self.overview.value = lab_html(self.lab)
        self.stage.options = self._options()  # resets the value (the observer shows it)
        self.stage.value = stage.name
        self._show(stage.name)

    def _show(self, name: str) -> None:
        stage = self.lab[name]
        self.body.value = stage_html(stage)
        graphs = list(stage.artifacts)
        self.graph.options = graphs
        self.graph.value = graphs[0] if graphs else None  # ipywidgets leaves it unselected (blank) otherwise
        self.view_button.disabled = not stage.artifacts
        self.snapshot.refresh()  # the saved copy follows the stage shown (ortlab.ui._snapshot)

    def snapshot_html(self) -> str:
        """Every stage, and the one shown, as plain HTML (what a reopened notebook shows)."""
        shown = self.lab[self.stage.value] if self.stage.value else None
        return lab_html(self.lab) + (stage_html(shown) if shown is not None and shown.status != "pending" else "")

    def _view(self) -> None:
        stage = self.lab[self.stage.value]
        try:
            view = stage.view(graph=self.graph.value)
            self.viewer.value = view.html(scroll=True) if hasattr(view, "html") else view._repr_html_()
            self.body.value = stage_html(stage)  # rows now link into the view
        except Exception as e:  # missing netron, unreadable file: show why
            self.viewer.value = f"<pre style='color:#cf222e'>{esc(e)}</pre>"


def stepper(lab: Lab) -> Any:
    """The stepper widget of ``lab`` (``lab.widget()``).

    Example:
        >>> stepper(ortlab.explore(model, x))        # doctest: +SKIP
    """
    from ortlab.ui._snapshot import attach

    stepper = StepperWidget(lab)
    return attach(stepper.widget, stepper.snapshot)


register_view("stage_html", stage_html)
register_view("lab_html", lab_html)
register_view("lab_widget", stepper)
