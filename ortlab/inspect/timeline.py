"""One training step on one time axis: PyTorch's ops and onnxruntime's kernels together.

A :class:`Timeline` holds the events of one recorded step, in microseconds from the
step's start: PyTorch's (from ``torch.profiler``: aten ops, the optimizer, autograd's
glue, ops that fell back), each onnxruntime session run (a span ``ortlab::<part>``
in PyTorch's trace) and the kernels of that run, placed inside their span by
:func:`place_kernels`. :func:`summarize` splits the step's time between onnxruntime's
kernels, onnxruntime outside its kernels, PyTorch and the gaps where neither ran;
:func:`chrome_trace` writes the events in Chrome's trace format, which Perfetto and
``chrome://tracing`` open. Recording a step is ``ortlab.inspect.timeline_record``'s job.

Example:
    >>> tl = Timeline(step=3, end_us=100.0, events=[
    ...     TimelineEvent("aten::mm", "torch", "PyTorch", 10.0, 20.0),
    ...     TimelineEvent("ortlab::g0.forward", "run", "onnxruntime g0.forward", 40.0, 30.0),
    ...     TimelineEvent("node_mm", "kernel", "onnxruntime g0.forward", 45.0, 20.0)])
    >>> s = tl.summary
    >>> (s.ort_kernels_us, s.ort_other_us, s.torch_us, s.gaps_us)
    (20.0, 10.0, 20.0, 50.0)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from ortlab.inspect.profile import provenance_of
from ortlab.inspect.views import find_view
from ortlab.provenance import onnx_node_of

__all__ = ["TimelineEvent", "TimelineSummary", "Timeline", "place_kernels", "summarize", "chrome_trace"]

logger = logging.getLogger(__name__)

SPAN_PREFIX = "ortlab::"  # the record_function spans of session runs (and of the step)
KINDS = ("torch", "run", "kernel")


@dataclasses.dataclass
class TimelineEvent:
    """One bar of the timeline.

    Attributes:
        name: the op (``aten::addmm``, ``Optimizer.step#AdamW.step``), the span
            (``ortlab::g0.forward``) or the ONNX node (``node_addmm``).
        kind: ``torch`` (PyTorch's), ``run`` (one onnxruntime session run) or ``kernel``.
        lane: where it is drawn (``PyTorch``, ``onnxruntime g0.forward``).
        start_us: microseconds from the step's start.
        dur_us: duration in microseconds.
        depth: how deep it sits in PyTorch's nesting (0: called by the step itself).
        args: what else is known: ``op_type``, ``module``, ``source``, ``fx_node``,
            ``op``, ``provider``, ``graph`` for kernels; ``thread``, ``parent`` for PyTorch's.
    """

    name: str
    kind: str
    lane: str
    start_us: float
    dur_us: float
    depth: int = 0
    args: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclasses.dataclass
class TimelineSummary:
    """Where a step's time went; the four parts add up to ``step_us``.

    Attributes:
        step_us: the step, from its forward call to the next step's.
        ort_kernels_us: inside onnxruntime's kernels.
        ort_other_us: inside onnxruntime's session runs, between kernels (the
            executor, allocations, the binding's copies of inputs and outputs).
        torch_us: inside a PyTorch op or span outside onnxruntime (aten ops, the
            optimizer, autograd, torch.compile's guards and wrappers).
        gaps_us: nothing recorded ran: Python (the training loop, data), the monitor.
    """

    step_us: float
    ort_kernels_us: float
    ort_other_us: float
    torch_us: float
    gaps_us: float

    def parts(self) -> list[str]:
        """``["onnxruntime kernels 1.10 ms (26%)", ...]``: the four parts, each with its share."""
        def part(name: str, us: float) -> str:
            share = us / self.step_us if self.step_us else 0.0
            return f"{name} {us / 1000:.2f} ms ({share:.0%})"

        return [part("onnxruntime kernels", self.ort_kernels_us),
                part("onnxruntime outside kernels", self.ort_other_us),
                part("PyTorch", self.torch_us), part("gaps", self.gaps_us)]

    def line(self) -> str:
        """``step 4.21 ms: onnxruntime kernels 1.10 ms (26%), ...``."""
        return f"step {self.step_us / 1000:.2f} ms: " + ", ".join(self.parts())


@dataclasses.dataclass
class Timeline:
    """One recorded training step: PyTorch's events and onnxruntime's on one axis.

    Attributes:
        step: the step's number (from 1, as in ``Monitor.data``).
        end_us: the step's length in microseconds (it starts at 0).
        events: every event, sorted by start.
        graphs: the onnxruntime parts that ran (``g0.forward``), in order of first run.
        notes: what a reader should know (no onnxruntime graph ran, how exactly the
            kernels are placed, a step ended by its last event).
    """

    step: int
    end_us: float
    events: list[TimelineEvent] = dataclasses.field(default_factory=list)
    graphs: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def of_kind(self, kind: str) -> list[TimelineEvent]:
        """The events of one kind (``torch``, ``run``, ``kernel``)."""
        return [e for e in self.events if e.kind == kind]

    @property
    def summary(self) -> TimelineSummary:
        """Where the step's time went (see :func:`summarize`)."""
        return summarize(self.events, self.end_us)

    def chrome_trace(self) -> dict[str, Any]:
        """The step in Chrome's trace format (see :func:`chrome_trace`)."""
        return chrome_trace(self)

    def export_trace(self, path: str | os.PathLike) -> str:
        """Write :meth:`chrome_trace` as JSON to ``path``; open it in https://ui.perfetto.dev.

        Example:
            >>> mon.timeline().export_trace("step.json")    # doctest: +SKIP
        """
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(), f)
        return os.fspath(path)

    def figure(self) -> Any:
        """The plotly figure of the step (``ortlab.ui`` draws it)."""
        view = find_view("timeline_figure")
        if view is None:
            from ortlab.inspect.views import view as required  # raises, saying what to import

            view = required("timeline_figure")
        return view(self)

    def _ipython_display_(self) -> None:
        view = find_view("timeline_display")
        if view is None:
            from IPython.display import display

            display(repr(self))
            return
        view(self)

    def __repr__(self) -> str:
        return (f"Timeline(step={self.step}, events={len(self.events)}, graphs={self.graphs}, "
                f"{self.summary.line()})")


def place_kernels(
    spans: Sequence[tuple[float, float]],
    ort_events: Sequence[dict],
    graph: str,
    provenance: dict[str, dict[str, str]] | None = None,
) -> tuple[list[TimelineEvent], list[str]]:
    """onnxruntime's kernels of the runs recorded as ``spans``, on the spans' axis.

    See Note [One time axis for PyTorch and onnxruntime] in ``ortlab.inspect.timeline_record``:
    the ``k``-th of the last ``len(spans)`` ``model_run`` events of the profile is the run
    of the ``k``-th span; each run is centred in its span (the span is longer by the
    binding's own work, a few microseconds on either side) and its kernels keep their
    offsets from the run's start.

    Args:
        spans: ``(start_us, dur_us)`` of each run of the session on the timeline's
            axis, in order.
        ort_events: the events of the session's onnxruntime profile (its JSON).
        graph: the part's label (``g0.forward``), the kernels' lane and ``graph``.
        provenance: ``ortlab.provenance.node_provenance`` of the session's model.

    Returns:
        The kernel events, and notes (runs missing from the profile, the placement's
        uncertainty).

    Example:
        >>> kernels, notes = place_kernels([(100.0, 12.0)], [
        ...     {"cat": "Session", "name": "model_run", "ts": 5000, "dur": 10},
        ...     {"cat": "Node", "name": "node_mm_kernel_time", "ts": 5002, "dur": 4, "args": {"op_name": "MatMul"}}],
        ...     "g0.forward")
        >>> (kernels[0].name, kernels[0].start_us, kernels[0].args["op_type"])
        ('node_mm', 103.0, 'MatMul')
    """
    provenance = provenance or {}
    runs = sorted((e for e in ort_events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: float(e.get("ts", 0)))
    notes: list[str] = []
    if len(runs) < len(spans):
        notes.append(f"{graph}: onnxruntime's profile has {len(runs)} runs for {len(spans)} recorded calls; "
                     "its kernels are not shown")
        return [], notes
    runs = runs[len(runs) - len(spans):]
    kernels = sorted((e for e in ort_events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")),
                     key=lambda e: float(e.get("ts", 0)))
    out: list[TimelineEvent] = []
    slack = 0.0
    lane = f"onnxruntime {graph}"
    for (span_start, span_dur), run in zip(spans, runs):
        run_ts, run_dur = float(run.get("ts", 0)), float(run.get("dur", 0))
        shift = span_start + max(span_dur - run_dur, 0.0) / 2 - run_ts
        slack = max(slack, abs(span_dur - run_dur) / 2)
        for e in kernels:
            ts = float(e.get("ts", 0))
            if not run_ts <= ts <= run_ts + run_dur:
                continue
            node = onnx_node_of(e["name"])
            args = e.get("args") or {}
            out.append(TimelineEvent(
                node, "kernel", lane, ts + shift, float(e.get("dur", 0)), depth=1,
                args={"node": node, "op_type": args.get("op_name", ""), "graph": graph,
                      "provider": args.get("provider", ""),
                      **provenance_of(node, provenance)}))
    if out:
        notes.append(f"{graph}: kernels placed within ±{slack:.0f} us (each run centred in its span)")
    return out, notes


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint (start, end) covering the given ones."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: Sequence[TimelineEvent], end_us: float) -> TimelineSummary:
    """Split ``[0, end_us]`` between onnxruntime's kernels, its runs' other time, PyTorch and gaps.

    Each instant counts once, for the first of these that covers it: a kernel, a session
    run, a PyTorch event; else it is a gap. Events are clipped to the step.

    Example:
        >>> summarize([TimelineEvent("aten::add", "torch", "PyTorch", 0.0, 4.0)], 10.0).gaps_us
        6.0
    """
    def cover(kind: str) -> list[tuple[float, float]]:
        return _union((max(e.start_us, 0.0), min(e.end_us, end_us)) for e in events
                      if e.kind == kind and e.end_us > 0 and e.start_us < end_us)

    kernels, runs, torch_ = cover("kernel"), cover("run"), cover("torch")
    ort = _union([*kernels, *runs])
    kernel_us = _length(kernels)
    ort_us = _length(ort)
    torch_us = _length(torch_) - _overlap(torch_, ort)
    return TimelineSummary(step_us=end_us, ort_kernels_us=kernel_us, ort_other_us=ort_us - kernel_us,
                           torch_us=torch_us, gaps_us=max(end_us - ort_us - torch_us, 0.0))


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The step in Chrome's trace format: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``.

    Each lane is a process (``pid``; PyTorch first, then each onnxruntime part) named
    by a ``process_name`` metadata event; PyTorch's events keep their thread as ``tid``,
    an onnxruntime part's runs and kernels share one ``tid`` (a kernel nests in its run).
    Every event is complete (``ph: "X"``) with ``ts``/``dur`` in microseconds from the
    step's start and ``args`` (a kernel's node, op type, module and source line).

    Example:
        >>> tl = Timeline(step=1, end_us=5.0, events=[TimelineEvent("aten::add", "torch", "PyTorch", 1.0, 2.0)])
        >>> [e["ph"] for e in chrome_trace(tl)["traceEvents"]]
        ['M', 'M', 'X', 'X']
    """
    lanes: dict[str, int] = {}
    events: list[dict[str, Any]] = []

    def pid_of(lane: str) -> int:
        if lane not in lanes:
            lanes[lane] = len(lanes) + 1
            events.append({"ph": "M", "name": "process_name", "pid": lanes[lane], "tid": 0, "args": {"name": lane}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": lanes[lane], "tid": 0,
                           "args": {"sort_index": lanes[lane]}})
        return lanes[lane]

    events.append({"ph": "X", "name": f"step {timeline.step}", "cat": "step", "pid": pid_of("PyTorch"), "tid": 0,
                   "ts": 0.0, "dur": timeline.end_us, "args": {"summary": timeline.summary.line()}})
    for e in timeline.events:
        lane = "PyTorch" if e.kind == "torch" else e.lane
        pid = pid_of(lane)
        tid = int(e.args.get("thread", 0)) if e.kind == "torch" else 0
        events.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": pid, "tid": tid,
                       "ts": round(e.start_us, 3), "dur": round(e.dur_us, 3),
                       "args": {k: v for k, v in e.args.items() if v not in ("", None)}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"ortlab": f"step {timeline.step}", "notes": timeline.notes}}
