"""The training monitor's plots: series from a StepLog, the plotly figure, in-place updates.

plotly is imported only when a figure is built. A redraw sets every trace of the
figure in one ``batch_update`` from :func:`series` (numpy arrays, at most ``max_points``
a line: see Note [Staying within the overhead budget] in ``ortlab.ui._monitor_schedule``).

Note [A figure that reads at any width]
The figure takes the width of its output (``autosize``; no width is ever set: see
Note [plotly's JSON output is not responsive]) and a fixed height. Line panels sit
in two columns, each with its own axes: process memory (hundreds of MiB) and saved activations (a few
MiB) get a y axis each, and the first step, which captures and exports for seconds,
is a number written in the step-time panel, not a point that would flatten the
others. Bar labels (kernels, op types, modules) are cut in the middle to a fixed
number of characters, their full text in the hover, and each bar panel keeps a fixed
share of its row for its labels: long names can neither push the line panels aside
nor run into the panel beside them (plotly's automatic margins grow the figure's
margin, which every row shares).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import numpy as np

from ortlab.inspect.profile import by_module, by_op_type, top_nodes
from ortlab.ui._monitor_data import StepLog, column
from ortlab.ui._monitor_status import first_step_s

__all__ = ["LINES", "BARS", "MEMORY", "CONFIG", "WIDGET_CONFIG", "bundle", "downsample", "figure", "in_kernel", "series", "shorten",
           "update_traces", "widgets_render_here", "wrap"]

_MIB = float(2**20)
LINES = ("loss", "step_ms", "profiled_step_ms", "kernel_ms", "samples_per_s", "rss", "cuda_used",
         "cuda_allocated", "saved")
BARS = ("top_ops", "op_types", "modules")
MEMORY = {"rss": "rss_bytes", "saved": "saved_bytes", "cuda_used": "cuda_used_bytes",
          "cuda_allocated": "cuda_allocated_bytes"}
# plotly.js config for JupyterLab's renderer of plotly's JSON output, which follows the output's
# width itself; WIDGET_CONFIG for FigureWidgets and HTML output, where plotly.js follows the window.
# See Note [plotly's JSON output is not responsive].
CONFIG = {"responsive": False, "displaylogo": False}
WIDGET_CONFIG = {**CONFIG, "responsive": True}
HEIGHT = 1100
# Characters a bar label keeps, and the share of its row kept for the labels (see the Note).
LABEL_CHARS = {"top_ops": 56, "op_types": 26, "modules": 26}
_LABEL_SHARE = {"top_ops": 0.30, "op_types": 0.15, "modules": 0.15}
_CELLS = {"loss": (1, 1), "step_ms": (1, 2), "profiled_step_ms": (1, 2), "kernel_ms": (1, 2),
          "samples_per_s": (2, 1), "rss": (2, 2), "cuda_used": (2, 2), "cuda_allocated": (2, 2), "saved": (2, 2),
          "top_ops": (3, 1), "op_types": (4, 1), "modules": (4, 2)}
# Short: a legend fits on one line above its panel (at 1280 px a panel is ~300 px wide).
_NAMES = {"loss": "loss", "step_ms": "step", "profiled_step_ms": "profiled",
          "kernel_ms": "kernel time", "samples_per_s": "samples/s", "rss": "RSS",
          "saved": "saved", "cuda_used": "CUDA used",
          "cuda_allocated": "CUDA alloc."}
_COLORS = {"loss": "#636efa", "step_ms": "#636efa", "profiled_step_ms": "#ab63fa", "kernel_ms": "#ff7f0e",
           "samples_per_s": "#19a974", "rss": "#ef553b", "cuda_used": "#b6655d", "cuda_allocated": "#e0a458",
           "saved": "#00a2c7", "top_ops": "#636efa", "op_types": "#ab63fa", "modules": "#19a974"}
_TITLES = ("loss", "step time (ms)", "samples / s", "memory (MiB)", "slowest onnxruntime kernels (us / step)",
           "by op type (us / step)", "by module (us / step)")
_EMPTY_BARS = {"op_types": "kernel time by op type, from the same profile",
               "modules": "kernel time by module, from the same profile"}


def downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Bucket means of ``(x, y)`` so at most ``max_points`` remain; NaNs are skipped."""
    n = len(x)
    if n <= max_points:
        return x, y
    starts = np.arange(0, n, math.ceil(n / max_points))
    ok = ~np.isnan(y)
    sums = np.add.reduceat(np.where(ok, y, 0.0), starts)
    counts = np.add.reduceat(ok.astype(np.int64), starts)
    xs = np.add.reduceat(x, starts) / np.diff(np.append(starts, n))
    return xs, np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def shorten(text: str, width: int) -> str:
    """``text`` cut in the middle to ``width`` characters (``…`` marks the cut).

    Example:
        >>> shorten("g0.backward node_mm (FusedMatMul) at blocks.0.attn", 24)
        'g0.backward…locks.0.attn'
    """
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return f"{text[:head]}…{text[len(text) - (width - 1 - head):]}"


def series(log: StepLog, n: int, max_points: int, top: int, module_depth: int | None) -> dict[str, tuple]:
    """x/y of every line and labels/values/hover of every bar chart for the first ``n`` steps, downsampled.

    The first step (capture and export) is left out of the step-time and samples/s lines;
    ``s["first_s"]`` holds its seconds (None until it ended).
    """
    log.materialize()
    mp = max_points
    steps = np.arange(1, n + 1, dtype=float)
    dt = log.durations(n)
    profiled = log.profiled_mask(n)
    later = np.arange(n) > 0  # the first step compiles: its time is a number of its own
    loss = column(log.loss, n)
    batch = np.asarray(log.batch[:n], dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        sps = np.where(profiled | ~later, np.nan, batch / dt)
    out: dict[str, tuple] = {
        "loss": downsample(steps, loss, mp),
        "step_ms": downsample(steps, np.where(profiled | ~later, np.nan, dt * 1e3), mp),
        "profiled_step_ms": (steps[profiled & later][-mp:], (dt[profiled & later] * 1e3)[-mp:]),
        "samples_per_s": downsample(steps, sps, mp),
        "kernel_ms": (
            np.asarray([p["step"] for p in log.profiles], dtype=float),
            np.asarray([sum(r.dur_us for r in p["nodes"]) / p["steps"] / 1e3 for p in log.profiles], dtype=float),
        ),
        "first_s": (first_step_s(log, n),),
        "step_range": _step_range(dt[later & ~profiled] * 1e3),
    }
    mem_steps = np.asarray([m["step"] for m in log.memory if m["step"] <= n], dtype=float)
    readings = [m for m in log.memory if m["step"] <= n]
    for name, key in MEMORY.items():
        out[name] = downsample(mem_steps, np.asarray([m.get(key) for m in readings], dtype=float) / _MIB, mp)
    nodes, per = (log.profiles[-1]["nodes"], log.profiles[-1]["steps"]) if log.profiles else ([], 1)
    slowest = top_nodes(nodes, top)
    out["top_ops"] = ([r.label for r in slowest], np.asarray([r.dur_us / per for r in slowest], dtype=float),
                      [f"{r.op or '?'} {r.fx_node}<br>{r.source}" for r in slowest])
    for name, groups in (("op_types", by_op_type(nodes)), ("modules", by_module(nodes, module_depth))):
        groups = groups[:top]
        out[name] = ([g.key for g in groups], np.asarray([g.dur_us / per for g in groups], dtype=float),
                     [f"{g.share:.1%} of kernel time, {g.count / per:.0f} kernel runs/step" for g in groups])
    return out


# Note [Outliers do not set the step-time axis]
# A re-capture (a guard failed: new shapes, Apply in the toggles) takes seconds where a step takes
# milliseconds; on an autoranged axis one such step flattened every other into the floor. A step more
# than OUTLIER times the median step is an outlier: the axis ends a little above the other steps,
# and a note over the panel counts the outliers and gives the largest (they stay in the data: hover).
OUTLIER = 4.0


def _step_range(ms: np.ndarray) -> tuple:
    """(the step-time axis' top or None for autorange, outliers above it, the largest), from the step times."""
    ms = ms[np.isfinite(ms)]
    if len(ms) < 3:
        return (None, 0, 0.0)
    median = float(np.median(ms))
    above = ms > OUTLIER * median
    if not above.any() or above.all():
        return (None, 0, 0.0)
    return (round(1.15 * float(ms[~above].max()), 3), int(above.sum()), round(float(ms[above].max()), 1))


def _outliers_text(count: int, largest: float) -> str:
    return (f"{count} step{'s' if count > 1 else ''} above the axis, up to {largest:,.0f} ms "
            "(re-captures or tool steps)") if count else ""


def wrap(text: str, width: int = 110) -> str:
    """A status line broken into lines of about ``width`` characters at its `` | `` separators (plotly's title)."""
    lines, line = [], ""
    for part in text.split(" | "):
        if line and len(line) + len(part) + 3 > width:
            lines.append(line)
            line = part
        else:
            line = f"{line} | {part}" if line else part
    return "<br>".join([*lines, line])


def _first_text(first_s: float | None) -> str:
    if first_s is None:
        return "first step (capture + export): running"
    return f"first step (capture + export): {first_s:.1f} s, not on this axis"


def figure(s: dict[str, tuple], title: str, kernels: str) -> Any:
    """A plain plotly Figure of :func:`series` ``s``.

    Args:
        s: what to draw (:func:`series`).
        title: the figure's title (the status line, wrapped; "" for none: the live view
            shows the status line above the figure).
        kernels: what the kernel panels show or wait for (``_monitor_status.kernel_note``).
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=4, cols=2, specs=[[{}, {}], [{}, {"secondary_y": True}], [{"colspan": 2}, None], [{}, {}]],
        subplot_titles=_TITLES, vertical_spacing=0.075, horizontal_spacing=0.1,
    )
    for name in LINES:
        x, y = s[name]
        style: dict[str, Any] = {"mode": "lines", "line": {"color": _COLORS[name], "width": 1.5}}
        if name == "profiled_step_ms":
            style = {"mode": "markers", "marker": {"size": 5, "color": _COLORS[name]}}
        elif name == "kernel_ms":
            style = {"mode": "markers", "marker": {"symbol": "diamond", "size": 8, "color": _COLORS[name]}}
        if name in MEMORY:  # readings come every ``every`` steps at least: a point shows the first
            style.update(mode="lines+markers", marker={"size": 4, "color": _COLORS[name]},
                         visible=bool(np.isfinite(y).any()))
        legend = {"step_ms": "legend", "profiled_step_ms": "legend", "kernel_ms": "legend"}.get(
            name, "legend2" if name in MEMORY else None)
        row, col = _CELLS[name]
        fig.add_trace(go.Scatter(x=x, y=y, name=_NAMES[name], showlegend=legend is not None,
                                 legend=legend or "legend", **style),
                      row=row, col=col, secondary_y=True if name == "saved" else None)
    for name in BARS:
        row, col = _CELLS[name]
        fig.add_trace(go.Bar(x=[], y=[], orientation="h", marker_color=_COLORS[name], showlegend=False,
                             name=name, hovertemplate="%{hovertext}<br>%{x:,.1f} us/step<extra></extra>"),
                      row=row, col=col)
    layout = fig.layout
    for row, col in ((1, 1), (1, 2), (2, 1), (2, 2)):
        fig.update_xaxes(title_text="step", title_standoff=4, row=row, col=col)
    # "memory": the legend names each line (process RSS; CUDA used and allocated only where readings exist: the
    # axis said "CUDA" on CPU-only machines).
    fig.update_yaxes(title_text="memory (MiB)", title_font_color=_COLORS["rss"], row=2, col=2, secondary_y=False)
    fig.update_yaxes(title_text="saved activations (MiB)", title_font_color=_COLORS["saved"], row=2, col=2,
                     secondary_y=True, showgrid=False)
    # Each bar panel keeps a share of its row for its labels (see the Note).
    titles = list(layout.annotations)
    for name, heading in zip(BARS, titles[4:]):
        trace = next(t for t in fig.data if t.name == name)
        xaxis, yaxis = layout[_axis("x", trace.xaxis)], layout[_axis("y", trace.yaxis)]
        start, end = xaxis.domain
        xaxis.domain = (start + _LABEL_SHARE[name], end)
        yaxis.update(autorange="reversed", automargin=False, tickfont={"size": 10}, tickmode="array",
                     showgrid=False)
        heading.update(x=start, xanchor="left")
    for heading, name in zip(titles[:4], ("loss", "step_ms", "samples_per_s", "rss")):
        trace = next(t for t in fig.data if t.name == _NAMES[name])
        heading.update(x=layout[_axis("x", trace.xaxis)].domain[0], xanchor="left",
                       yshift=22)  # room for a legend under it; all alike, so titles of a row align
    step_axis = next(t for t in fig.data if t.name == _NAMES["step_ms"])
    memory_axis = next(t for t in fig.data if t.name == _NAMES["rss"])
    top_axis = next(t for t in fig.data if t.name == "top_ops")
    for key, trace in (("legend", step_axis), ("legend2", memory_axis)):  # above its panel, under its title
        layout[key] = {"orientation": "h", "xanchor": "right", "yanchor": "bottom", "font": {"size": 10},
                       "x": layout[_axis("x", trace.xaxis)].domain[1],
                       "y": layout[_axis("y", trace.yaxis)].domain[1] + 0.002, "bgcolor": "rgba(255,255,255,0)",
                       "itemwidth": 30, "tracegroupgap": 0}
    fig.add_annotation(name="first_step", text=_first_text(s["first_s"][0]), showarrow=False,
                       xref=f"{step_axis.xaxis} domain", yref=f"{step_axis.yaxis} domain", x=0.01, y=0.98,
                       xanchor="left", yanchor="top", font={"size": 11, "color": "#444"},
                       bgcolor="rgba(255,255,255,0.8)")
    fig.add_annotation(name="step_outliers", text="", showarrow=False, visible=False,  # Note [Outliers do not ...]
                       xref=f"{step_axis.xaxis} domain", yref=f"{step_axis.yaxis} domain", x=0.99, y=0.98,
                       xanchor="right", yanchor="top", font={"size": 10, "color": "#b35900"},
                       bgcolor="rgba(255,255,255,0.8)")
    fig.add_annotation(name="kernels", text=kernels, showarrow=False, xref="paper",
                       yref=f"{top_axis.yaxis} domain", x=0.5, y=0.5, font={"size": 13, "color": "#666"})
    for name in ("op_types", "modules"):
        trace = next(t for t in fig.data if t.name == name)
        fig.add_annotation(name=f"{name}_empty", text=_EMPTY_BARS[name], showarrow=False,
                           xref=f"{trace.xaxis} domain", yref=f"{trace.yaxis} domain", x=0.5, y=0.5,
                           font={"size": 11, "color": "#888"})
    fig.update_layout(height=HEIGHT, autosize=True, margin={"l": 60, "r": 60, "t": 40, "b": 40},
                      bargap=0.25, hoverlabel={"align": "left"})
    update_traces(fig, s, title, kernels)
    return fig


def _axis(letter: str, ref: str) -> str:
    """The layout key of a trace's axis reference: ``x3`` -> ``xaxis3``."""
    return f"{letter}axis{ref[1:]}"


def _fingerprint(x: Any, y: Any) -> tuple:
    """What tells a line's data changed: its length and its last point (lines only grow at the end)."""
    n = len(x)
    return (n, repr(float(x[-1])), repr(float(y[-1]))) if n else (0,)  # repr: NaN equals NaN


def update_traces(fig: Any, s: dict[str, tuple], title: str, kernels: str) -> None:
    """Set the traces, labels and notes of a :func:`figure` that changed to :func:`series` ``s``, in one batch.

    What was last set is kept on the figure (``fig._ortlab_drawn``): plotly validates every
    property set, and a redraw sets only what changed (the growing lines, mostly), so it
    costs a few milliseconds (Note [Staying within the overhead budget] in
    ``ortlab.ui._monitor_schedule``).
    """
    drawn = getattr(fig, "_ortlab_drawn", None)
    if drawn is None:
        drawn = {}
        fig._ortlab_drawn = drawn

    def changed(key: str, value: Any) -> bool:
        if drawn.get(key, changed) == value:  # (a sentinel nothing equals)
            return False
        drawn[key] = value
        return True

    with fig.batch_update():
        layout = fig.layout
        if "notes" not in drawn:  # annotation indices by name, found once
            drawn["notes"] = {note.name: i for i, note in enumerate(layout.annotations) if note.name}
        notes = drawn["notes"]
        for trace, name in zip(fig.data, LINES + BARS):
            if name in BARS:
                labels, values, hover = s[name]
                if not changed(name, (tuple(labels), tuple(np.round(values, 3)))):
                    continue
                width = LABEL_CHARS[name]
                trace.y, trace.x = np.arange(len(labels)), values
                trace.hovertext = [f"<b>{label}</b><br>{more}" for label, more in zip(labels, hover)]
                layout[_axis("y", trace.yaxis)].update(tickvals=list(range(len(labels))),
                                                       ticktext=[shorten(label, width) for label in labels],
                                                       visible=bool(len(labels)))
                if f"{name}_empty" in notes:
                    layout.annotations[notes[f"{name}_empty"]].visible = not len(labels)
            elif changed(name, _fingerprint(*s[name])):
                trace.x, trace.y = s[name]
                if name in MEMORY:
                    trace.visible = bool(np.isfinite(s[name][1]).any())
        if changed("first_step", s["first_s"][0]):
            layout.annotations[notes["first_step"]].text = _first_text(s["first_s"][0])
        if changed("step_range", s["step_range"]):
            top, count, largest = s["step_range"]
            step_trace = fig.data[LINES.index("step_ms")]
            axis = layout[_axis("y", step_trace.yaxis)]
            axis.update(autorange=True) if top is None else axis.update(range=[0, top], autorange=False)
            layout.annotations[notes["step_outliers"]].update(text=_outliers_text(count, largest), visible=bool(count))
        empty = not len(s["top_ops"][0])
        if changed("kernels", (kernels, empty)):
            layout.annotations[notes["kernels"]].update(
                text=kernels, x=0.5 if empty else 1.0, y=0.5 if empty else 1.0,
                xanchor="center" if empty else "right", yanchor="middle" if empty else "bottom",
                font={"size": 13 if empty else 11})
        if changed("title", title):
            wrapped = wrap(title) if title else ""
            layout.title.text = wrapped or None
            layout.margin.t = 40 + 20 * (wrapped.count("<br>") + 1) if wrapped else 40


# Note [plotly's JSON output is not responsive]
# JupyterLab draws plotly's JSON output with its own renderer (jupyterlab-plotly), which
# follows the output's size itself: on every resize of the output it redraws the figure and
# calls plotly's ``Plots.resize``, which drops the layout's height and width and sizes the
# figure to its div. With plotly's ``responsive`` config on as well, plotly then gives the
# figure's container a height of 100% of that div, whose height is its content's: the figure
# collapses to 0 px and disappears from the notebook. plotly avoids this only when the div was
# 0 px high at the first draw, which it usually is but not always (seen in CI: the timeline
# vanished after a drag-to-zoom on a busy machine; reproduced in the browser by redrawing with
# that first-draw flag cleared). So JSON output goes without ``responsive``: the renderer's own
# resizing keeps the figure as wide as its output, at its own height. HTML output (Colab, plain
# Python) and the monitor's FigureWidget keep ``responsive``: there nothing else
# follows the window (without it the widget stays at its first width; its element has the
# figure's height, so it does not collapse). JSON output and the widget are tested in a browser
# (tests/test_browser.py), the choice of config in tests/ui/test_monitor.py.


# plotly renderer name (``plotly.io.renderers.default``) -> whether it makes HTML, not plotly's JSON.
_HTML_RENDERERS: dict[str, bool] = {}


def bundle(fig: Any, text: str) -> dict[str, Any]:
    """The mime bundle of a plotly figure for this front end.

    plotly picks the renderer (Colab needs HTML with plotly.js, JupyterLab and VS
    Code read plotly's JSON). Displaying the Figure itself would go through its
    ``_ipython_display_``, which ignores ``display_id``: every update would add a
    new output instead of replacing the old one.
    """
    import plotly.io as pio

    # Which config plotly's renderer wants is known after its first bundle: HTML renderers (Colab)
    # then get WIDGET_CONFIG straight away, not a JSON-config bundle made only to be thrown away on
    # each of the monitor's redraws.
    html = _HTML_RENDERERS.get(pio.renderers.default)
    out = dict(fig._repr_mimebundle_(config=WIDGET_CONFIG if html else CONFIG))
    if html is None:
        _HTML_RENDERERS[pio.renderers.default] = html = "application/vnd.plotly.v1+json" not in out
        if html and out:
            out = dict(fig._repr_mimebundle_(config=WIDGET_CONFIG))
    if not out:  # no notebook renderer (plain Python)
        out = {"text/html": fig.to_html(full_html=False, include_plotlyjs="cdn", config=WIDGET_CONFIG)}
    out["text/plain"] = text
    return out


def in_kernel() -> Any:
    """The IPython shell when running in a Jupyter kernel, else None."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


def widgets_render_here() -> bool:
    """False in front ends where plotly's FigureWidget does not render (Colab, VS Code)."""
    if "google.colab" in sys.modules or "COLAB_NOTEBOOK_ID" in os.environ:
        return False
    return "VSCODE_PID" not in os.environ
