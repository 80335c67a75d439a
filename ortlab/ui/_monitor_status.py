"""The monitor's words: the status line, what the kernel panels wait for, and compile progress.

A status line is drawn above the live figure (and as the plain figure's title); while
a step compiles for onnxruntime (the first step: capture, export, sessions), a
:class:`StageProgress` sink, handed every stage the engine makes, says which stage is
done and what runs next, as it happens.

Note [Showing the first step as it compiles]
The first step of an ORTModule takes seconds to minutes: Dynamo captures, AOTAutograd
traces the joint graph, each graph is exported, optimized and built into a session,
and a part with several candidate providers measures them on its first call. Nothing
of that is a step boundary, so the schedule cannot draw it; but the engine hands
every stage to its sinks (``ORTModule.add_stage_sink``), in the cell that runs the
training loop, and an ipywidgets update sent from there reaches the browser at once.
The sink wants only the stages the engine makes anyway (not ``execution``, which
writes the optimized model to a file, nor the ``ort_*`` levels, which build a
session each), so following the compile costs a status update per stage, about ten
per captured graph.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ortlab.stages import StageArtifact
from ortlab.ui._monitor_data import StepLog

__all__ = ["StageProgress", "describe", "first_step_s", "kernel_note", "providers_note", "status_line",
           "waiting_line"]

# Stages the engine makes whether or not a sink wants them (see the Note).
_FREE_STAGES = frozenset({"captured", "joint", "forward", "backward", "inference", "exported", "onnxscript"})


def first_step_s(log: StepLog, n: int) -> float | None:
    """Seconds of the first step (capture and export), once it ended."""
    if n < 1:
        return None
    dt = log.durations(1)
    return float(dt[0]) if math.isfinite(dt[0]) else None


def waiting_line(started: int) -> str:
    """The status before any step ended."""
    if started == 0:
        return "ortlab monitor: waiting for the first step (a training-mode forward call of the module)"
    return ("ortlab monitor: step 1 running: capture and export for onnxruntime "
            "(the first step takes seconds to minutes)")


def status_line(log: StepLog, n: int, fraction: float, kernels: str, rationed: str | None = None) -> str:
    """One line: steps done, step time, samples/s, loss, the first step, the overhead, the kernels.

    Args:
        log: what was recorded.
        n: steps done (the count shown).
        fraction: the monitor's share of training time.
        kernels: what the kernel panels show or wait for (:func:`kernel_note`).
        rationed: why the view redraws less often than asked, or None.
    """
    if n == 0:
        return waiting_line(len(log.start))
    log.materialize()
    dt = log.durations(n)
    later = dt[1:][~log.profiled_mask(n)[1:]][-50:]  # the first step compiles: not a step time
    step_s = float(np.nanmedian(later)) if np.isfinite(later).any() else float("nan")
    parts = [f"step {n}"]
    if math.isfinite(step_s):
        parts.append(f"{step_s * 1e3:.2f} ms/step")
        batches = [b for b in log.batch[max(1, n - 50) : n] if b]
        if batches and step_s > 0:
            parts.append(f"{np.mean(batches) / step_s:,.0f} samples/s")
    loss = next((log.loss[i] for i in sorted(log.loss, reverse=True) if i < n and log.loss[i] is not None), None)
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    first = first_step_s(log, n)
    if first is not None:
        parts.append(f"first step (capture + export) {first:.1f} s")
    parts.append(f"monitor {fraction:.1%} of training time")
    if rationed:
        parts.append(rationed)
    parts.append(kernels)
    return " | ".join(parts)


def kernel_note(log: StepLog, why_not: str | None, window: tuple[int, int] | None, next_window: int | None) -> str:
    """What the kernel panels show, or when they will fill, or why they will not.

    Args:
        log: what was recorded (its profiles and windows).
        why_not: why no profile windows open (profiling off, a plain module...), or None.
        window: the profile window in progress, ``[first, end)`` step indices, or None.
        next_window: the step the next window is expected to open at, or None.
    """
    if window is not None:
        return f"kernels: profiling steps {window[0] + 2}-{window[1]} now"
    if log.profiles:
        last = log.profiles[-1]
        first, steps = last["step"], last["steps"]
        shown = f"step {first}" if steps == 1 else f"steps {first}-{first + steps - 1}"
        return f"kernels of {shown}" + (f" (next window at about step {next_window})" if next_window else "")
    if why_not is not None:
        return f"kernels: {why_not}"
    if next_window is not None:
        return f"kernels: profiling window at about step {next_window} (mon.profile_now() for the next step)"
    return "kernels: a profiling window opens when the overhead budget allows (mon.profile_now() to force)"


class StageProgress:
    """A stage sink that turns the engine's stages into a live status line (see the Note).

    Attributes:
        active: whether it follows stages (off once the monitor detaches; the module
            keeps its sinks).
        events: ``(when, label, stage, seconds)`` of each stage seen.

    Example:
        >>> progress = StageProgress(lambda text: print(text), lambda: 1, lambda: 0.0)  # doctest: +SKIP
        >>> om.add_stage_sink(progress)                                                 # doctest: +SKIP
    """

    def __init__(self, show: Callable[[str], None], step: Callable[[], int], started: Callable[[], float | None],
                 session_note: Callable[[], str] = lambda: "") -> None:
        self._show, self._step, self._started, self._session_note = show, step, started, session_note
        self.session_note: str | None = None  # what follows a session's build, asked once
        self.active = True
        self.text = ""
        self.events: list[tuple[float, str, str, float]] = []

    def wants(self, stage: str) -> bool:
        """Only stages the engine makes anyway (see the Note)."""
        return self.active and stage in _FREE_STAGES

    def accept(self, artifact: StageArtifact) -> None:
        """Show what the engine did and what runs next."""
        now = time.perf_counter()
        self.events.append((now, artifact.label, artifact.stage, artifact.seconds))
        if self.session_note is None:
            self.session_note = self._session_note()
        self.text = self.line(artifact, now)
        self._show(self.text)

    def line(self, artifact: StageArtifact, now: float) -> str:
        """The status while a step compiles, after ``artifact``."""
        started = self._started()
        elapsed = f", {now - started:.1f} s so far" if started is not None else ""
        head = f"ortlab monitor: step {self._step()} compiling for onnxruntime{elapsed}"
        return f"{head} | {describe(artifact, self.session_note or '')}"


def describe(artifact: StageArtifact, session_note: str = "") -> str:
    """What ``artifact`` means for the compile: which stage is done, what runs next."""
    where, took = artifact.label, f" in {artifact.seconds:.1f} s" if artifact.seconds else ""
    stage = artifact.stage
    if stage == "captured":
        nodes = getattr(getattr(artifact.content, "graph", None), "nodes", ())
        size = f" ({len(nodes)} nodes)" if nodes else ""
        follow = "tracing forward + backward (AOTAutograd)" if artifact.mode == "train" else "compiling it"
        return f"{where}: Dynamo captured the graph{size}; {follow}"
    if stage == "joint":
        return f"{where}: joint forward + backward graph traced{took}; splitting it"
    if stage in ("forward", "backward", "inference"):
        return f"{where}: {stage} graph split off; exporting it to ONNX"
    if stage == "exported":
        return f"{where}: exported to ONNX{took}; optimizing it with onnxscript"
    if stage == "onnxscript":
        return f"{where}: optimized by onnxscript{took}; building its onnxruntime session{session_note}"
    return f"{where}: {stage}{took}"


def providers_note(module: Any) -> str:
    """What follows a session's build: its first run, measuring candidate providers where there are some."""
    try:
        from ortlab.runtime.session import choose_providers

        device = next((p.device.type for p in module.parameters()), "cpu")
        choice = choose_providers(device, module.options)
    except Exception:  # noqa: BLE001 (a note only: the engine itself reports device errors)
        return ", then its first run"
    if choice.candidates:
        others = ", ".join(c[0] for c in choice.candidates)
        return f", then its first run measures {choice.providers[0]} against {others}"
    return f", then its first run ({choice.providers[0]})"
