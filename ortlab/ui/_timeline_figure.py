"""The plotly figure of a :class:`~ortlab.inspect.timeline.Timeline`: one step, one time axis.

Lanes, top to bottom: PyTorch's events by nesting depth (``PyTorch`` holds what the
step itself called: the compiled region, autograd's backward nodes, the optimizer;
``PyTorch ›1``, ``›2`` what those called: aten ops, ops that fell back, the autograd
glue), then one lane per onnxruntime part, where each session run is a pale bar and its
kernels are drawn on it. Hovering a kernel shows its ONNX node, op type, nn.Module and
source line; hovering a PyTorch event its name, caller and thread. The title is the
summary (where the step's time went). Importing this module registers the
``timeline_figure`` and ``timeline_display`` views (``ortlab.inspect.views``).

Note [Drawing a timeline in plotly]
Each bar is a horizontal ``go.Bar`` with ``base`` (its start) and ``x`` (its length) in
milliseconds, one trace per kind of event so the legend reads as a key and a click
hides a kind; ``barmode="overlay"`` keeps the kernels on their run's bar in the
same lane (a narrower ``width``). ``plotly.express.timeline`` would need dates for
its axis. PyTorch's events nest (an aten op inside the optimizer step inside the
step): depth ``d`` gets its own row, down to ``MAX_DEPTH``; deeper events (aten's own
calls inside an aten op) add nothing a reader of the step needs and are left to the
Chrome trace (``export_trace``), which Perfetto nests without limit.
"""

from __future__ import annotations

import html
from typing import Any

from ortlab.inspect.timeline import Timeline, TimelineEvent
from ortlab.inspect.views import register_view

__all__ = ["timeline_figure", "display_timeline"]

MAX_DEPTH = 2  # PyTorch rows: depth 0 .. MAX_DEPTH

# kind of bar -> (legend name, colour)
STYLES: dict[str, tuple[str, str]] = {  # in drawing order: a run's kernels are drawn on it
    "run": ("onnxruntime session run", "#ffc9a3"),
    "kernel": ("onnxruntime kernel", "#e8590c"),
    "aten": ("PyTorch op (aten)", "#1c7ed6"),
    "fallback": ("op placed in PyTorch (fell back)", "#c2255c"),
    "autograd": ("autograd", "#7048e8"),
    "optimizer": ("optimizer", "#2b8a3e"),
    "compile": ("torch.compile wrappers", "#868e96"),
}


def _style(e: TimelineEvent) -> str:
    if e.kind in ("kernel", "run"):
        return e.kind
    name = e.name
    if "fell_back" in e.args:
        return "fallback"
    if name.startswith("aten::"):
        return "aten"
    if "Optimizer" in name or "optimizer" in e.args.get("parent", "").lower():
        return "optimizer"
    if "autograd" in name or "Backward" in name or "AccumulateGrad" in name:
        return "autograd"
    return "compile"


def _lane(e: TimelineEvent) -> str:
    if e.kind != "torch":
        return e.lane
    thread = "" if e.args.get("thread", 1) in (0, 1) else f" (thread {e.args['thread']})"
    return f"PyTorch{thread}" + (f" ›{e.depth}" if e.depth else "")


def _hover(e: TimelineEvent) -> str:
    when = f"{e.start_us / 1000:.3f} ms, {e.dur_us:.1f} us"
    if e.kind == "kernel":
        a = e.args
        lines = [f"<b>{html.escape(e.name)}</b> ({html.escape(a.get('op_type', ''))})",
                 f"module: {html.escape(a.get('module') or '<root>')}",
                 f"source: {html.escape(a.get('source') or '?')}",
                 f"graph: {html.escape(a.get('graph', ''))} on {html.escape(a.get('provider', ''))}", when]
        if a.get("op"):
            lines.insert(1, f"aten op: {html.escape(a['op'])}")
        return "<br>".join(lines)
    if e.kind == "run":
        return f"<b>onnxruntime run</b> {html.escape(e.name)}<br>{when}"
    lines = [f"<b>{html.escape(e.name)}</b>"]
    if "fell_back" in e.args:
        lines += [f"runs in PyTorch: {html.escape(e.args['fell_back'])}",
                  f"module: {html.escape(e.args.get('module') or '<root>')}",
                  f"source: {html.escape(e.args.get('source') or '?')}"]
    if e.args.get("parent"):
        lines.append(f"in {html.escape(e.args['parent'])}")
    return "<br>".join([*lines, when])


def timeline_figure(timeline: Timeline) -> Any:
    """A plotly Figure of one recorded step (see the module docstring).

    Example:
        >>> timeline_figure(mon.timeline()).write_html("step.html")   # doctest: +SKIP
    """
    import plotly.graph_objects as go

    shown = [e for e in timeline.events if e.kind != "torch" or e.depth <= MAX_DEPTH]
    torch_lanes = sorted({_lane(e) for e in shown if e.kind == "torch"}, key=lambda lane: (len(lane), lane))
    lanes = torch_lanes + list(dict.fromkeys(_lane(e) for e in shown if e.kind != "torch"))
    groups: dict[str, list[TimelineEvent]] = {key: [] for key in STYLES}
    for e in shown:
        groups[_style(e)].append(e)
    fig = go.Figure()
    for key, events in groups.items():
        if not events:
            continue
        name, colour = STYLES[key]
        fig.add_trace(go.Bar(
            name=name, orientation="h", y=[_lane(e) for e in events],
            base=[e.start_us / 1000 for e in events], x=[max(e.dur_us, 0.5) / 1000 for e in events],
            width=0.9 if key == "run" else 0.6, marker={"color": colour, "line": {"width": 0}},
            # A run's hover would hide its kernels' (drawn on it): the title sums the runs up.
            hovertext=[_hover(e) for e in events], hoverinfo="skip" if key == "run" else "text"))
    # The summary, one part a line under the step's time, then what the reader must know.
    summary = timeline.summary
    notes = [n for n in timeline.notes if "placed within" not in n]
    title = (f"<b>Step {timeline.step}</b>: {summary.step_us / 1000:.2f} ms"
             f"<br><sup>{html.escape(' · '.join(summary.parts()))}"
             + (f"<br>{html.escape('; '.join(notes))}" if notes else "") + "</sup>")
    fig.update_layout(
        barmode="overlay", height=210 + 42 * len(lanes), margin={"l": 10, "r": 10, "t": 120, "b": 50},
        title={"text": title, "font": {"size": 15}, "x": 0.01, "y": 1.0, "yanchor": "top", "yref": "container",
               "pad": {"t": 14}},
        legend={"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom"},
        xaxis={"title": {"text": "ms from the step's start"}, "range": [0, timeline.end_us / 1000],
               "showgrid": True},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(lanes)), "automargin": True},
        bargap=0.2, plot_bgcolor="white",
    )
    fig.update_xaxes(gridcolor="#e9ecef", zeroline=False)
    return fig


def display_timeline(timeline: Timeline) -> None:
    """Display the step's figure (the summary is its title) in the notebook."""
    from IPython.display import display

    from ortlab.ui._monitor_figure import bundle

    display(bundle(timeline_figure(timeline), repr(timeline)), raw=True)


register_view("timeline_figure", timeline_figure)
register_view("timeline_display", display_timeline)
