"""The stepper in a notebook: each stage as HTML, and a widget to run and browse them.

``Stage._repr_html_`` and ``Lab._repr_html_`` render through :func:`stage_html` and
:func:`lab_html` (plain HTML, no widget library needed); :class:`StepperWidget` adds
buttons (ipywidgets, imported when it is built). Rows of the tables (a saved
activation, an op that falls back to PyTorch) link to that node in a netron view of
the stage's ONNX graph when a graph view is open (the shared netron server is
running, see ``ortlab.ui.netron_view``); links open in the lab's netron frame, or in
a new tab when there is none.
"""

from __future__ import annotations

import glob
import html
import logging
import os
from collections.abc import Callable
from typing import Any

from ortlab.inspect.stages import ActivationRow, FallbackRow, Lab, Stage, onnx_node_index, parse_stage_file

__all__ = ["stage_html", "lab_html", "StepperWidget", "stepper"]

logger = logging.getLogger(__name__)

TOP_OPS = 25
_STATUS = {"done": ("#1a7f37", "done"), "pending": ("#6e7781", "pending"),
           "skipped": ("#9a6700", "skipped"), "failed": ("#cf222e", "failed")}
_TABLE = "border-collapse:collapse;font-size:12px;margin:4px 0"
_CELL = "padding:2px 8px;border-bottom:1px solid #eee;text-align:left;vertical-align:top"


def _e(value: Any) -> str:
    return html.escape(str(value))


def _badge(status: str) -> str:
    color, text = _STATUS.get(status, ("#6e7781", status))
    return (f"<span style='background:{color};color:#fff;border-radius:8px;padding:0 7px;"
            f"font-size:11px'>{_e(text)}</span>")


def _table(header: list[str], rows: list[list[str]], limit: int | None = None) -> str:
    """An HTML table; cells are already escaped. Rows past ``limit`` fold into <details>."""
    def body(part: list[list[str]]) -> str:
        return "".join("<tr>" + "".join(f"<td style='{_CELL}'>{c}</td>" for c in r) + "</tr>" for r in part)

    head = "<tr>" + "".join(f"<th style='{_CELL}'>{_e(h)}</th>" for h in header) + "</tr>"
    if limit is None or len(rows) <= limit:
        return f"<table style='{_TABLE}'>{head}{body(rows)}</table>"
    return (f"<table style='{_TABLE}'>{head}{body(rows[:limit])}</table>"
            f"<details><summary style='font-size:12px'>{len(rows) - limit} more</summary>"
            f"<table style='{_TABLE}'>{head}{body(rows[limit:])}</table></details>")


def _seconds(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


# ------------------------------------------------------------------------------------ links
class _Linker:
    """URLs of netron views for table rows; ``None`` everywhere when no server is running."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.server: Any = None
        self.frame = ""
        try:
            from ortlab.ui import netron_view

            self.server = netron_view.running_default_server()
            self.frame = netron_view.frame_name(stage.root)
        except Exception as e:  # netron missing: tables without links
            logger.debug("no graph links: %s", e)

    @property
    def active(self) -> bool:
        return self.server is not None

    def _exported(self, label_prefix: str) -> list[str]:
        lab = self.stage.lab
        if lab is not None and lab["exported"].status == "done":
            arts = lab["exported"].artifacts
            return [os.path.join(lab.folder, rel) for label, rel in arts.items()
                    if label == label_prefix or label.startswith(label_prefix + ".")]
        found = []
        for path in sorted(glob.glob(os.path.join(self.stage.root, "*_exported_*.onnx"))):
            info = parse_stage_file(path)
            if info is not None and (info["label"] == label_prefix or info["label"].startswith(label_prefix + ".")):
                found.append(path)
        return found

    def url(self, path: str, node: str | None = None) -> str | None:
        if not self.active:
            return None
        from ortlab.ui.netron_view import url_for

        try:
            return url_for(path, node, self.server)
        except Exception as e:  # a broken file must not break the table
            logger.debug("no link to %s: %s", path, e)
            return None

    def activation(self, row: ActivationRow) -> str | None:
        if not self.active:
            return None
        paths = self._exported(f"{row.graph}.forward")
        fallback = None
        for path in paths:
            target = onnx_node_index(path).get(row.name)
            if target is not None and target != row.name:
                return self.url(path, target)  # the partition that makes it
            if target is not None and fallback is None:
                fallback = path  # a partition that reads it (it is made in PyTorch)
        return self.url(fallback, row.name) if fallback is not None else None

    def fallback(self, row: FallbackRow) -> str | None:
        if not self.active or not row.values:
            return None
        from ortlab.ui.netron_view import _load

        for path in self._exported(row.where):
            model = _load(path)
            inputs = {v.name for v in model.graph.input}
            value = next((v for v in row.values if v in inputs), None)
            if value is not None:
                return self.url(path, value)
        return None

    def link(self, text: str, url: str | None) -> str:
        if url is None:
            return text
        return (f"<a href='{html.escape(url, quote=True)}' target='{self.frame}' "
                f"title='open in netron'>{text}</a>")


# ---------------------------------------------------------------------------- stage tables
def _ops_table(stage: Stage) -> str:
    diff = stage.diff
    rows = []
    for op, n in stage.op_counts.items():
        delta = ""
        if diff is not None:
            if op in diff.added:
                delta = f"<span style='color:#1a7f37'>+{diff.added[op]}</span>"
            elif op in diff.removed:
                delta = f"<span style='color:#cf222e'>-{diff.removed[op]}</span>"
        rows.append([f"<code>{_e(op)}</code>", str(n), delta])
    if diff is not None:
        gone = [op for op in diff.removed if op not in stage.op_counts]
        rows += [[f"<code style='color:#999'>{_e(op)}</code>", "0",
                  f"<span style='color:#cf222e'>-{diff.removed[op]}</span>"] for op in gone]
    return _table(["op", "count", f"vs {stage.previous}" if stage.previous else ""], rows, TOP_OPS)


def _diff_html(stage: Stage) -> str:
    d = stage.diff
    if d is None:
        return ""
    if not d.changed:
        return f"<p style='font-size:12px'>No change in op counts from <b>{_e(stage.previous)}</b> ({d.after} ops).</p>"
    def chips(ops: dict[str, int], sign: str, color: str) -> str:
        return " ".join(f"<code style='color:{color}'>{_e(op)} {sign}{n}</code>" for op, n in list(ops.items())[:12])
    parts = [f"<b>{d.before}</b> &rarr; <b>{d.after}</b> ops from <b>{_e(stage.previous)}</b>"]
    if d.added:
        parts.append("added " + chips(d.added, "+", "#1a7f37"))
    if d.removed:
        parts.append("removed " + chips(d.removed, "-", "#cf222e"))
    return "<p style='font-size:12px'>" + "<br>".join(parts) + "</p>"


def _graphs_table(stage: Stage, linker: _Linker) -> str:
    if not stage.graph_op_counts and not stage.artifacts:
        return ""
    rows = []
    labels = list(dict.fromkeys([*stage.graph_op_counts, *stage.artifacts]))
    for label in labels:
        counts = stage.graph_op_counts.get(label, {})
        rel = stage.artifacts.get(label, "")
        name = _e(os.path.basename(rel))
        if rel and stage.kind == "onnx":
            name = linker.link(name, linker.url(os.path.join(stage.root, rel)))
        rows.append([f"<code>{_e(label)}</code>", str(sum(counts.values())), name,
                     f"<code>lab[{stage.name!r}].view({label!r})</code>" if rel else ""])
    return "<h4 style='margin:8px 0 2px'>Graphs</h4>" + _table(["graph", "ops", "file", "open"], rows, 20)


def _breaks_table(stage: Stage) -> str:
    if not stage.graph_breaks:
        return "<p style='font-size:12px'>No graph breaks: one graph per call.</p>" if stage.name == "captured" else ""
    rows = [[_e(b.reason), str(b.count), f"<code>{_e(b.location)}</code>" if b.location else "",
             f"<details><summary>details</summary><pre style='white-space:pre-wrap;font-size:11px'>"
             f"{_e(b.detail)}</pre></details>" if b.detail and b.detail != b.reason else ""]
            for b in stage.graph_breaks]
    return ("<h4 style='margin:8px 0 2px'>Graph breaks (the code around each runs in PyTorch)</h4>"
            + _table(["reason", "count", "where", ""], rows))


def _activations_table(stage: Stage, linker: _Linker) -> str:
    if not stage.activations:
        return ""
    rows = []
    for a in sorted(stage.activations, key=lambda r: -r.bytes):
        name = linker.link(f"<code>{_e(a.name)}</code>", linker.activation(a))
        rows.append([_e(a.graph), name, f"<code>{_e(a.op)}</code>", _e("x".join(map(str, a.shape)) or "scalar"),
                     _e(a.dtype), _bytes(a.bytes), _e(a.module or "<root>"), f"<small>{_e(a.source)}</small>",
                     ("recomputed" + (f": {_e(a.reason)}" if a.reason else "")) if a.recomputed else "saved"])
    s = stage.summary
    head = (f"<h4 style='margin:8px 0 2px'>Saved activations: {s.get('saved', 0)} saved, "
            f"{s.get('recomputed', 0)} recomputed, {_bytes(int(s.get('saved_bytes', 0)))} "
            f"(without recompute {_bytes(int(s.get('baseline_bytes', 0)))})</h4>")
    return head + _table(["graph", "name", "op", "shape", "dtype", "bytes", "module", "source", ""], rows, 30)


def _fallbacks_table(stage: Stage, linker: _Linker) -> str:
    if not stage.fallbacks:
        return "<p style='font-size:12px'>Nothing runs in PyTorch.</p>" if stage.name == "exported" else ""
    rows = []
    for f in stage.fallbacks:
        what = f"<code>{_e(f.op or f.scope)}</code>" + (f" ({_e(f.node)})" if f.node else "")
        rows.append([_e(f.where), linker.link(what, linker.fallback(f)), _e(f.module or ""),
                     f"<small>{_e(f.source)}</small>", _e(f.reason)])
    return ("<h4 style='margin:8px 0 2px'>Runs in PyTorch instead of onnxruntime</h4>"
            + _table(["graph", "op", "module", "source", "why"], rows, 30))


def _summary(stage: Stage) -> str:
    skip = {"saved", "recomputed", "saved_bytes", "baseline_bytes"}
    items = []
    for k, v in stage.summary.items():
        if k in skip:
            continue
        if isinstance(v, float):
            v = _seconds(v) if k.endswith("_s") else f"{v:.6g}"
        items.append(f"<b>{_e(k.replace('_', ' '))}</b>: {_e(v)}")
    return f"<p style='font-size:12px'>{' &middot; '.join(items)}</p>" if items else ""


def stage_html(stage: Stage) -> str:
    """One stage: status, op counts and their change, timings, tables and files.

    Example:
        >>> from IPython.display import HTML; HTML(stage_html(lab["split"]))   # doctest: +SKIP
    """
    linker = _Linker(stage)
    index = stage.lab.stages.index(stage) + 1 if stage.lab is not None else ""
    head = (f"<div style='font-family:sans-serif;font-size:13px'><h3 style='margin:4px 0'>"
            f"{index}{'. ' if index else ''}{_e(stage.title or stage.name)} {_badge(stage.status)} "
            f"<small style='color:#666'><code>{_e(stage.name)}</code>"
            f"{' &middot; ' + _seconds(stage.seconds) if stage.seconds is not None else ''}"
            f"{' &middot; ' + str(stage.total_ops) + ' ops' if stage.op_counts else ''}</small></h3>"
            f"<p style='color:#444;margin:2px 0'>{_e(stage.description)}</p>")
    parts = [head]
    if stage.error:
        parts.append(f"<pre style='color:#cf222e;white-space:pre-wrap'>{_e(stage.error)}</pre>")
    if stage.notes:
        items = "".join(f"<li>{_e(n)}</li>" for n in stage.notes)
        parts.append(f"<ul style='font-size:12px;margin:2px 0'>{items}</ul>")
    if stage.status == "pending":
        parts.append(f"<p style='font-size:12px'>Not run yet: <code>lab.run({stage.name!r})</code>.</p></div>")
        return "".join(parts)
    parts += [_summary(stage), _diff_html(stage), _breaks_table(stage)]
    if stage.op_counts:
        parts.append("<h4 style='margin:8px 0 2px'>Op counts</h4>" + _ops_table(stage))
    parts += [_activations_table(stage, linker), _fallbacks_table(stage, linker), _graphs_table(stage, linker)]
    if stage.timings:
        rows = [[_e(k), _seconds(v)] for k, v in stage.timings.items()]
        parts.append("<details><summary style='font-size:12px'>Timings</summary>"
                     + _table(["what", "time"], rows) + "</details>")
    if not linker.active and stage.kind == "onnx" and stage.artifacts:
        parts.append(f"<p style='font-size:12px;color:#666'>Open a graph with <code>lab[{stage.name!r}].view()</code>; "
                     "table rows then link to their nodes.</p>")
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
            change = f"{s.diff.before} &rarr; {s.diff.after}" if s.diff.changed else "no change"
        rows.append([str(i), f"<code>{_e(s.name)}</code>", _e(s.title), _badge(s.status),
                     str(s.total_ops) if s.op_counts else "", change, _seconds(s.seconds),
                     _e(s.error or (s.notes[0] if s.status == "skipped" and s.notes else ""))])
    meta = lab.meta
    inputs = ", ".join(meta.get("inputs", []))
    pending = next((s.name for s in lab.stages if s.status == "pending"), None)
    hint = (f"Next: <code>lab.next()</code> runs <code>{_e(pending)}</code>; <code>lab.run()</code> runs all."
            if pending else "All stages ran: display one with <code>lab['name']</code>, open its graph with "
            "<code>.view()</code>.")
    return (f"<div style='font-family:sans-serif;font-size:13px'><h3 style='margin:4px 0'>ortlab lab: "
            f"{_e(meta.get('model', ''))}({_e(inputs)})</h3>"
            f"<p style='font-size:12px;color:#666;margin:2px 0'>{_e(lab.folder)}</p>"
            + _table(["#", "stage", "", "status", "ops", "change", "time", "note"], rows)
            + f"<p style='font-size:12px'>{hint}</p></div>")


# ----------------------------------------------------------------------------------- widget
class StepperWidget:
    """Buttons to run the next stage or all, a stage picker, and the graph of the stage.

    Example:
        >>> StepperWidget(ortlab.explore(model, x)).widget      # doctest: +SKIP
    """

    def __init__(self, lab: Lab) -> None:
        import ipywidgets as w

        self.lab = lab
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
            self.body,
            self.viewer,
        ])
        current = lab.current
        self._show(current.name if current is not None else lab.stages[0].name)

    def _options(self) -> list[tuple[str, str]]:
        return [(f"{i}. {s.name} ({s.status})", s.name) for i, s in enumerate(self.lab.stages, 1)]

    def _run(self, step: Callable[[], Stage]) -> None:
        self.next_button.disabled = self.all_button.disabled = True
        try:
            stage = step()
        except Exception as e:  # every stage ran, or an earlier one failed: say so in the page
            self.body.value = f"<pre style='color:#cf222e'>{_e(e)}</pre>"
            stage = None
        finally:
            self.next_button.disabled = self.all_button.disabled = self.lab.done
        self.overview.value = lab_html(self.lab)
        self.stage.options = self._options()
        if stage is not None:
            self.stage.value = stage.name
            self._show(stage.name)

    def _show(self, name: str) -> None:
        stage = self.lab[name]
        self.body.value = stage_html(stage)
        self.graph.options = list(stage.artifacts)
        self.view_button.disabled = not stage.artifacts

    def _view(self) -> None:
        stage = self.lab[self.stage.value]
        try:
            view = stage.view(graph=self.graph.value)
            self.viewer.value = view._repr_html_()
            self.body.value = stage_html(stage)  # rows now link into the view
        except Exception as e:  # missing netron, unreadable file: show why
            self.viewer.value = f"<pre style='color:#cf222e'>{_e(e)}</pre>"


def stepper(lab: Lab) -> Any:
    """The stepper widget of ``lab`` (``lab.widget()``).

    Example:
        >>> stepper(ortlab.explore(model, x))        # doctest: +SKIP
    """
    return StepperWidget(lab).widget
