"""Recording one training step as a :class:`~ortlab.inspect.timeline.Timeline`.

A :class:`TimelineRecorder` is driven by step boundaries (the monitor calls
:meth:`TimelineRecorder.boundary` when a step ends and the next begins): once armed it
swaps profiling twins into the module's onnxruntime parts (as a
``ProfileWindow`` does, see Note [Sampling the profiler in windows] in
``ortlab.inspect.profile_window``), lets one step warm them up, then records the next
step with ``torch.profiler`` and onnxruntime's profiler at once, and puts both on one
time axis.

Note [One time axis for PyTorch and onnxruntime]
torch.profiler and onnxruntime's profiler keep separate clocks: PyTorch's events are
microseconds from its trace's start, onnxruntime's from the session's profiling start
(``get_profiling_start_time_ns()``: in onnxruntime 1.32 nanoseconds since the Unix
epoch, a wall clock; kineto's own start is only reachable through private attributes). Converting one epoch into the other would rest on two clocks
agreeing to the microsecond and on a private API, and a clock step (NTP) in between
would shift every kernel. So nothing is converted: while a timeline is recorded,
each ``OrtRunner`` wraps its session call in ``torch.profiler.record_function
("ortlab::<part>")`` (``OrtRunner.span``; None otherwise, one test a call), which puts
every onnxruntime run into PyTorch's trace as a span on PyTorch's clock. The ``k``-th
span of a part is the ``k``-th recorded ``model_run`` of its twin session (the warm-up
step's runs come first and are left out), and each kernel keeps its offset from its
run's start, measured on onnxruntime's clock, where it is exact. The one unknown is
where in its span the run starts: the span is longer than ``model_run`` by the
binding's work before and after (converting names and values: 40-170 us in all for
a tiny GPT on the shared 2-core box); the run is centred in its span and the timeline
notes the largest uncertainty, half the difference. The result cannot put a kernel outside its call or
a forward kernel after a backward one, whatever the clocks do.

Example:
    >>> recorder = TimelineRecorder(om)                        # doctest: +SKIP
    >>> recorder.arm()                                         # doctest: +SKIP
    >>> # at each step boundary n (n steps started):
    >>> timeline = recorder.boundary(n)                        # doctest: +SKIP
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from ortlab.errors import OrtlabError, first_line
from ortlab.inspect.profile import load_events
from ortlab.inspect.profile_window import _provenance_of, measuring_parts
from ortlab.inspect.timeline import SPAN_PREFIX, Timeline, TimelineEvent, place_kernels

__all__ = ["TimelineRecorder", "build_timeline"]

logger = logging.getLogger(__name__)

IDLE, ARMED, WARMING, RECORDING = "idle", "armed", "warming", "recording"


class TimelineRecorder:
    """Records one training step of a module on one time axis (see the Note above).

    States: ``idle`` → :meth:`arm` → ``armed`` → (boundary: twins in) ``warming`` →
    (boundary: profilers on) ``recording`` → (boundary: profilers off) ``idle``, with
    the :class:`Timeline` in :attr:`last`. A module with no onnxruntime part skips the
    warm-up step.

    Args:
        module: the ``ORTModule`` (or a plain ``nn.Module``: PyTorch's events only).
        warmup: steps the twin sessions run before the recorded one (their first run
            allocates memory and is slower than the steady state).
        folder: where onnxruntime writes its profiles (deleted after reading).

    Attributes:
        state: ``idle``, ``armed``, ``warming`` or ``recording``.
        last: the last recorded :class:`Timeline`, or None.
        step: the number (from 1) of the step being (or to be) recorded.
        waiting: why an armed recording waits ("" when it does not): parts still measuring their
            execution providers (``ortlab.runtime.race``) run the race's sessions, not the twins.
    """

    def __init__(self, module: Any, warmup: int = 1, folder: str | None = None) -> None:
        self.module, self.warmup = module, warmup
        self.folder = folder or tempfile.gettempdir()
        self.state = IDLE
        self.last: Timeline | None = None
        self.step = 0
        self._warm_left = 0
        self.waiting = ""  # why an armed recording has not begun: parts still measuring their providers
        self._parts: list[tuple[str, Any, Any, Any, Any]] = []  # span label, runner, exported, original, twin
        self._profiler: Any = None
        self._step_span: Any = None

    @property
    def busy(self) -> bool:
        """Whether a boundary has work to do (armed, warming up or recording)."""
        return self.state != IDLE

    def arm(self, steps_started: int) -> int:
        """Record a coming step; returns its number (from 1). ``steps_started``: steps begun so far."""
        if self.state == IDLE:
            self.state = ARMED
        has_ort = bool(_parts_of(self.module)) if hasattr(self.module, "report") else False
        if self.state == ARMED:
            self.step = steps_started + 1 + (self.warmup if has_ort else 0)
        return self.step

    def boundary(self, n: int) -> Timeline | None:
        """A step ends and step ``n + 1`` begins (``n`` steps started); returns a finished Timeline.

        Call between steps only (never while a forward or backward runs).
        """
        if self.state == ARMED:
            if hasattr(self.module, "report") and not self.module.report.captures:
                # The next step captures and compiles (seconds, mostly in PyTorch's tracing): not a training
                # step to show. Recording waits for the first step after the capture.
                self.waiting = "the module has not captured yet: its first step compiles"
                self.step = n + 2 + (self.warmup if _parts_of(self.module) else 0)
                return None
            racing = measuring_parts(self.module) if hasattr(self.module, "report") else 0
            if racing:
                # The race runs its own sessions on these calls and would swap the twins out unrecorded.
                self.waiting = f"{racing} part(s) are still measuring their execution providers"
                self.step = n + 1 + (self.warmup if _parts_of(self.module) else 0)
                return None
            self.waiting = ""
            self._swap_twins_in()
            self._warm_left = self.warmup if self._parts else 0
            self.state = WARMING
        if self.state == WARMING:
            if self._warm_left > 0:
                self._warm_left -= 1
                self.step = n + 1 + self._warm_left + 1
                return None
            self.step = n + 1
            self._start_profiler()
            self.state = RECORDING
            return None
        if self.state == RECORDING:
            return self._finish(ended=True)
        return None

    def finish(self) -> Timeline | None:
        """End now: a step being recorded ends at its last event; an armed recording is cancelled."""
        if self.state == RECORDING:
            return self._finish(ended=False)
        if self.state in (ARMED, WARMING):
            self._swap_twins_out()
            self.state = IDLE
        return None

    # ------------------------------------------------------------------------- parts
    def _swap_twins_in(self) -> None:
        from ortlab.runtime.profiling import profiling_twin  # onnxruntime, only once a timeline is armed

        self._parts = []
        if not hasattr(self.module, "report"):
            return
        labels: set[str] = set()
        for label, runner, exported in _parts_of(self.module):
            try:
                twin = profiling_twin(runner, label, self.folder)
                original = runner.swap_session(twin)
            except OrtlabError as e:  # its runs still show as spans, without kernels
                logger.warning("ortlab timeline: could not profile %s: %s", label, first_line(e))
                twin = original = None
            unique, k = label, 1
            while unique in labels:
                k += 1
                unique = f"{label}#{k}"
            labels.add(unique)
            self._parts.append((unique, runner, exported, original, twin))

    def _swap_twins_out(self) -> list[tuple[str, Any, Any, Any]]:
        """Originals back, spans off; returns (label, runner, exported, ended twin's profile path)."""
        ended = []
        for label, runner, exported, original, twin in self._parts:
            runner.span = None
            if twin is None:
                ended.append((label, runner, exported, None))
                continue
            if runner.session is twin:
                runner.swap_session(original)
            ended.append((label, runner, exported, twin.end_profiling()))
        self._parts = []
        return ended

    # ---------------------------------------------------------------------- profiler
    # Note [Kineto's USDT lines]
    # PyTorch's profiler (kineto) writes "USDT: ... profiler_start" and "... profiler_stop" to the process's
    # stderr from C++ at every start and stop, whatever KINETO_LOG_LEVEL says; a notebook shows them as red
    # stderr under every cell that records a timeline. Only the start and the stop run with file descriptor 2
    # pointed at /dev/null (our own code's output, and other threads', in those microseconds is lost with it).
    @staticmethod
    @contextlib.contextmanager
    def _quiet_stderr() -> Iterator[None]:
        try:
            sys.stderr.flush()
            saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        except (OSError, AttributeError, ValueError):  # no file descriptor 2 to point elsewhere
            yield
            return
        try:
            os.dup2(devnull, 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(devnull)

    def _start_profiler(self) -> None:
        import torch

        for label, runner, *_ in self._parts:
            runner.span = SPAN_PREFIX + label
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with self._quiet_stderr():  # Note [Kineto's USDT lines]
            self._profiler.start()
        self._step_span = torch.profiler.record_function(f"{SPAN_PREFIX}step {self.step}")
        self._step_span.__enter__()

    def _finish(self, ended: bool) -> Timeline:
        self._step_span.__exit__(None, None, None)
        with self._quiet_stderr():
            self._profiler.stop()
        profiles = self._swap_twins_out()
        self.state = IDLE
        try:
            function_events = list(self._profiler.events())
        finally:
            self._profiler, self._step_span = None, None
        report = getattr(self.module, "report", None)
        timeline = build_timeline(self.step, function_events, profiles, ended=ended,
                                  fallbacks=report.fallbacks if report is not None else (),
                                  ort_module=report is not None)
        self.last = timeline
        return timeline


def _parts_of(module: Any) -> list[tuple[str, Any, Any]]:
    """(part label, OrtRunner, ExportedGraph | None) of every onnxruntime part of an ORTModule."""
    report = getattr(module, "report", None)
    if report is None:
        return []
    return [(part.label or graph.label, part.runner, part.exported)
            for capture in report.captures for graph in capture.graphs for part in graph.parts]


def build_timeline(
    step: int,
    function_events: list[Any],
    profiles: list[tuple[str, Any, Any, str | None]],
    ended: bool = True,
    fallbacks: Sequence[Any] = (),
    ort_module: bool = True,
) -> Timeline:
    """Put a step's torch.profiler events and its sessions' profiles on one axis.

    Args:
        step: the step's number.
        function_events: ``torch.profiler.profile.events()`` of the step: each with
            ``name``, ``time_range.start``/``.end`` (us), ``thread`` and ``cpu_parent``;
            one of them is the step's own span ``ortlab::step <n>``.
        profiles: per onnxruntime part, (label, runner, exported, profile path or None);
            the files are read and deleted.
        ended: the next step began (False: the step ends at its last event).
        fallbacks: the module's ``report.fallbacks``: an aten op that one of them placed
            in PyTorch, called inside a compiled graph, is marked ``fell_back`` (its reason).
        ort_module: the module is an ORTModule (the note on a step without onnxruntime says why).

    Returns:
        The :class:`Timeline`, its events in microseconds from the step's start.
    """
    step_name = f"{SPAN_PREFIX}step {step}"
    span_names = {SPAN_PREFIX + label: label for label, *_ in profiles}
    root = next((e for e in function_events if e.name == step_name), None)
    if root is None:
        raise OrtlabError(f"torch.profiler recorded no {step_name!r} span: was the profiler stopped by another tool?")
    t0 = root.time_range.start
    inside = [e for e in function_events if e is not root and e.time_range.start >= t0 and
              (not ended or e.time_range.start <= root.time_range.end)]
    end = root.time_range.end - t0
    notes: list[str] = []
    if not ended:
        end = max((e.time_range.end - t0 for e in inside), default=0.0)
        notes.append(f"step {step} had not ended (no later training step): it ends at its last recorded event")
    events: list[TimelineEvent] = []
    spans: dict[str, list[tuple[float, float]]] = {}
    # Each op placed in PyTorch at several nodes: the k-th call in the step is the k-th node, when the counts agree
    # (the graphs run their PyTorch parts in graph order, once a step); otherwise what all its nodes agree on.
    by_node = _placed_by_node(fallbacks)
    in_pytorch = _placed_in_pytorch(by_node)
    calls = collections.Counter(e.name for e in inside if e.name in by_node and _in_compiled_graph(e, root))
    seen: collections.Counter[str] = collections.Counter()
    inside.sort(key=lambda e: e.time_range.start)
    for e in inside:
        start, dur = e.time_range.start - t0, e.time_range.end - e.time_range.start
        depth, parent = 0, e.cpu_parent
        while parent is not None and parent is not root:
            depth, parent = depth + 1, parent.cpu_parent
        label = span_names.get(e.name)
        if label is not None:
            spans.setdefault(label, []).append((start, dur))
            events.append(TimelineEvent(e.name[len(SPAN_PREFIX):], "run", f"onnxruntime {label}", start, dur,
                                        depth=depth, args={"graph": label}))
            continue
        args: dict[str, Any] = {"thread": int(e.thread)}
        if e.cpu_parent is not None and e.cpu_parent is not root:
            args["parent"] = e.cpu_parent.name
        fell_back = in_pytorch.get(e.name)
        if fell_back is not None and _in_compiled_graph(e, root):
            nodes = by_node[e.name]
            if calls[e.name] == len(nodes):
                fell_back = nodes[seen[e.name]]
                seen[e.name] += 1
            args.update(fell_back)
        events.append(TimelineEvent(e.name, "torch", "PyTorch", start, dur, depth=depth, args=args))
    graphs = sorted(spans, key=lambda label: spans[label][0][0])
    for label, runner, exported, path in profiles:
        if label not in spans:
            _remove(path)
            continue
        if path is None or not os.path.exists(path):
            notes.append(f"{label}: no onnxruntime profile (its runs show without kernels)")
            continue
        try:
            kernels, placed = place_kernels(sorted(spans[label]), load_events(path), label,
                                            _provenance_of(runner, exported))
        except (OSError, ValueError) as e:
            notes.append(f"{label}: could not read onnxruntime's profile ({e})")
            continue
        finally:
            _remove(path)
        events.extend(kernels)
        notes.extend(placed)
    if not graphs:
        why = ("model.report says why" if ort_module else
               "the module is a plain nn.Module; wrap it in ortlab.ORTModule to run it in onnxruntime")
        notes.insert(0, f"no onnxruntime graph ran in step {step}: all of it ran in PyTorch ({why})")
    events.sort(key=lambda e: (e.start_us, -e.dur_us))
    return Timeline(step=step, end_us=end, events=events, graphs=graphs, notes=notes)


_COMPILED = ("CompiledFunction", "CompiledFunctionBackward")


def _placed_in_pytorch(by_node: dict[str, list[dict[str, str]]]) -> dict[str, dict[str, str]]:
    """``aten::gelu`` -> ``{fell_back: reason, module, source}`` of the ops ortlab placed in PyTorch
    (:func:`_placed_by_node` merged).

    An op placed in PyTorch at several nodes keeps the module and source line only
    where they all agree (used where a step's calls cannot be matched to the nodes one by one).
    """
    out: dict[str, dict[str, str]] = {}
    for name, nodes in by_node.items():
        merged = out[name] = dict(nodes[0])
        for new in nodes[1:]:
            for key in ("fell_back", "module", "source"):
                if merged[key] != new[key]:
                    merged[key] = "several reasons (model.report lists them)" if key == "fell_back" else ""
    return out


def _placed_by_node(fallbacks: Sequence[Any]) -> dict[str, list[dict[str, str]]]:
    """``aten::gelu`` -> ``[{fell_back, module, source}, ...]``: each node ortlab placed in PyTorch, in graph order."""
    out: dict[str, list[dict[str, str]]] = collections.defaultdict(list)
    for fb in fallbacks:
        if getattr(fb, "scope", "") == "op" and fb.op:
            name = fb.op.replace(".", "::", 1).split(".")[0]  # aten.gelu.default -> aten::gelu
            out[name].append({"fell_back": fb.reason, "module": fb.module, "source": fb.source})
    return out


def _in_compiled_graph(event: Any, root: Any) -> bool:
    """Whether ``event`` ran inside a compiled graph (forward or backward), not the user's code."""
    parent = event.cpu_parent
    while parent is not None and parent is not root:
        if parent.name in _COMPILED:
            return True
        parent = parent.cpu_parent
    return False


def _remove(path: str | None) -> None:
    if path:
        try:
            os.remove(path)
        except OSError:
            pass
