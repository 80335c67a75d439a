"""The monitor's work at step boundaries, kept within its overhead budget.

A check comes at a step boundary when ``every`` steps have started since the last
one, or when ``redraw_s`` seconds have passed since the last redraw (see
:attr:`Schedule.next_check` and :attr:`Schedule.due`): the :class:`Schedule` ends the
step's timing, reads memory, opens or closes a profile window and redraws the views,
each when it is due and fits the budget; it times all of it, so the monitor's
overhead is measured, not guessed.

Note [Redrawing by the clock]
Redraws come about once a second of wall time (``redraw_s``), not every ``every``
steps: a step takes 0.4 ms (a tiny MLP) or seconds (a real model), so no step count
suits both; a redraw every 10 steps of a 2 s step would show nothing for 20 s, every
10 steps of a 0.4 ms step would double its time. The watcher already reads the clock
at each step, so the test costs one comparison. The first boundary after a slow first
step (it compiled, for longer than ``redraw_s``) redraws at once, whatever the budget:
it ends seconds of waiting, and costs milliseconds against them (counted in
``monitor_s`` all the same). Memory readings and profile windows stay counted in steps (``every``).

Note [The view never stops for long]
A redraw costs the kernel 3-12 ms, but a browser on the same machine then re-renders the
plotly figure (150-270 ms of its main thread, measured with headless chromium on 2 cores),
and the training steps that run meanwhile are slower: on a 2-core box the step after each
redraw took ~120 ms more than the median 100 ms step. That is the monitor's cost too, so it is
counted (the steps started within ``_FRONT_END_S`` of a redraw, over the mean of as many steps
just before it) and the budget sees it. The differences are summed with their signs and the sum's
positive part is charged: steps slower after a redraw by chance are as common as steps faster, and
charging only the slower ones (as at first) billed a loaded box's noise to the monitor (4.8-11% of a
tiny MLP's training in a test beside another pytest worker, without any front end). Counted honestly, a budget of 1.5% would then allow
a redraw every ~17 s in that setting: a view that stands still for 12 s while the loop runs
looks frozen. So a redraw comes at least every ``MAX_GAP`` x ``redraw_s`` whatever the budget
(like memory readings, which never stop either): at most ~3% of training in that worst case,
measured and reported in ``mon.overhead``; set a larger ``redraw_s`` for less.

Note [Staying within the overhead budget]
A redraw costs 1-3 ms without a front end and 5-10 ms in JupyterLab (numpy arrays,
at most ``max_points`` per trace, only the traces that changed; plain lists of 10k
points cost 150 ms) and a profile window 7 ms (tiny MLP) to 300 ms (2-layer GPT),
most of it the profiled steps running ~40% slower (see Note [Sampling the profiler
in windows] in ``ortlab.inspect.profile_window``). A tiny MLP's step takes 0.4 ms:
redrawing every 10 steps would double it. So the monitor times all it does (redraws, memory readings, profile
windows, and the profiled steps' extra time over the median step) and starts
optional work only while it stays under ``budget`` (default 1.5%) of the
monitored training time, not counting the first step (the capture): half for
drawing and readings (a redraw a second at up to 7 ms), half for profiling. The
redraw at the end of a slow first step (Note [Redrawing by the clock]) is counted in
``monitor_s`` but not against the drawing share: it is paid against the first step,
which the share does not count either. Before measuring, it times a
redraw when the view is built and estimates a window from the step time, so
short runs do not overshoot. The first window of a model with 25 ms steps thus
comes after about 13 s of training; ``mon.profile_now()`` takes one at the next
step whatever the budget. A step's recorded time excludes the monitor's work at
its boundary, so redraws do not show up as slow steps.

Example:
    >>> schedule = Schedule(om, log, lambda: len(log.start), every=10, budget=0.015,  # doctest: +SKIP
    ...                     profile_steps=3, profiling=True, redraw=view.redraw, can_redraw=view.has_view)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ortlab.inspect.memory import sample_memory
from ortlab.inspect.profile_window import ProfileWindow, measuring_parts
from ortlab.inspect.timeline_record import ARMED, RECORDING, TimelineRecorder
from ortlab.ui._monitor_data import StepLog

__all__ = ["Schedule"]

_SHARES = {"redraw": 1 / 2, "profile": 1 / 2}  # of the budget; see Schedule.allowed
MAX_GAP = 5  # redraws at least every MAX_GAP * redraw_s, whatever the budget (Note [The view never stops for long])
_FRONT_END_S = 0.5  # steps started this long after a redraw pay for the front end's rendering


class Schedule:
    """When the monitor redraws, reads memory and profiles, within its budget; it runs that work too.

    Attributes:
        log: the recorded steps (windows, memory readings and profiles go there too).
        every: steps between memory readings and profile windows, at least.
        redraw_s: seconds between redraws, about (see Note [Redrawing by the clock]).
        budget: the fraction of training time the monitor may spend, or None.
        profile_steps: steps per profile window (one more warms it up).
        profiling: whether profile windows open (off once nothing runs in onnxruntime).
        monitor_s: seconds the monitor spent while training.
        train_s, train_steps: the monitored training time and steps (from the second boundary).
        cost: seconds a redraw, a profile window and a memory reading take: measured, or first guesses.
        next_check: :meth:`check` is due when this many steps have started...
        due: ... or when the clock (``time.perf_counter``) passes this.
        why_not: why no profile windows open (None while they may).
        redraws: the redraws at step boundaries so far.
        rationed: whether the budget held the last redraw back until the floor (``MAX_GAP * redraw_s``).
    """

    def __init__(
        self,
        module: Any,
        log: StepLog,
        steps: Callable[[], int],
        *,
        every: int,
        budget: float | None,
        profile_steps: int,
        profiling: bool,
        redraw: Callable[[], None],
        can_redraw: Callable[[], bool],
        redraw_s: float = 1.0,
        why_not: str | None = None,
    ) -> None:
        self.module, self.log, self._steps = module, log, steps
        self.redraw_s, self.why_not, self.redraws = redraw_s, why_not, 0
        self.held: str | None = None  # why the next profile window waits (the provider race), while it does
        self.due = math.inf
        self._redrawn_at = -math.inf
        self._drawn_from: int | None = None  # the first step after the last redraw, until its cost is counted
        # The steps after redraws over those before them, summed with their signs; its positive part is charged:
        # noise cancels out instead of being charged (Note [The view never stops for long]).
        self._front_end_sum = 0.0
        self.rationed = False  # the last redraw came only by the floor (Note [The view never stops for long])
        self._first_drawn = False
        self.every, self.budget, self.profile_steps, self.profiling = every, budget, profile_steps, profiling
        self._redraw, self._can_redraw = redraw, can_redraw
        # Budget (see the Note): measured costs, or first guesses.
        self.monitor_s, self.train_s, self.train_steps = 0.0, 0.0, 0
        self._mark: float | None = None
        self._mark_n = 0
        self.cost = {"redraw": 0.005, "profile": 0.01, "memory": 0.0}
        self._spent = {"redraw": 0.0, "profile": 0.0}
        self.next_check = 0
        self._last = {"memory": 0, "window": 0}
        # Profiling.
        self._window: ProfileWindow | None = None
        self._window_start_s = 0.0
        self._force_profile = False
        # A step recorded on one time axis (Monitor.record_timeline), made when first asked for.
        self.recorder: TimelineRecorder | None = None
        self._timeline_first = 0

    def restart(self) -> None:
        """Watching starts (again): the next boundary only starts the clock."""
        self._mark = None
        self.next_check = len(self.log.start) + 1

    def pause(self, now: float) -> None:
        """Training stops for a while (a notebook cell ended): the time until the next step is not training.

        The steps since the last check count until ``now``; the next step's start
        starts the clock again.
        """
        if self._mark is not None:
            self.train_s += max(now - self._mark, 0.0)
            self.train_steps += len(self.log.start) - self._mark_n
            self._mark = None
        self.next_check = len(self.log.start) + 1

    def next_window(self) -> int | None:
        """The step the next profile window should open at (an estimate from the budget), or None.

        Example:
            >>> schedule.next_window()      # doctest: +SKIP
            412
        """
        if not self.profiling or (self._window is not None and self._window.active):
            return None
        n = len(self.log.start)
        if self._force_profile:
            return n + 1
        wait = max(self._last["window"] + self.every - n, 0) if self.log.profiles else 0
        if self.budget is None:
            return n + max(wait, 1)
        if not self.train_steps:
            return None
        step_s = self.train_s / self.train_steps
        needed = (self._spent["profile"] + self.cost["profile"]) / (_SHARES["profile"] * self.budget) - self.train_s
        return n + max(wait, math.ceil(max(needed, 0.0) / step_s) if step_s > 0 else 0, 1)

    def window(self) -> tuple[int, int] | None:
        """The profile window in progress, ``[first, end)`` step indices, or None."""
        return self.log.windows[-1] if self._window is not None and self._window.active else None

    def profile_now(self) -> None:
        """Open a profile window at the next boundary, whatever the budget."""
        self._force_profile = True
        self.next_check = min(self.next_check, len(self.log.start))

    def stop_profiling(self) -> None:
        """Close the window in progress, if any (watching stops)."""
        if self._window is not None and self._window.active:
            self._stop_window()

    def record_timeline(self) -> int:
        """Record a coming step on one time axis; returns its number (from 1).

        A profile window in progress closes now: both swap profiling sessions in.
        """
        if self.recorder is None:
            self.recorder = TimelineRecorder(self.module)
        self.stop_profiling()
        self.next_check = min(self.next_check, len(self.log.start))
        return self.recorder.arm(len(self.log.start))

    def finish_timeline(self) -> None:
        """End the timeline being recorded now (at its last event); cancel one armed."""
        if self.recorder is not None and self.recorder.busy and self.recorder.finish() is not None:
            self.log.windows.append((self._timeline_first, len(self.log.start)))

    def _timeline_boundary(self, n: int, ending: bool) -> None:
        """The timeline recorder's work at a boundary (n steps started).

        A recorded step ends first thing at its boundary (``ending``), and the next one
        starts last thing, so the monitor's own work at the boundary is in neither.
        """
        recorder = self.recorder
        if recorder is None or not recorder.busy or ending != (recorder.state == RECORDING):
            return
        if recorder.state == ARMED:
            self._timeline_first = n
        if recorder.boundary(n) is not None:
            self.log.windows.append((self._timeline_first, n))  # its steps ran profiled

    @property
    def overhead(self) -> dict[str, float]:
        """The monitor's seconds, the monitored training seconds, and their ratio."""
        train = self.train_s
        return {"monitor_s": self.monitor_s, "train_s": train, "fraction": self.monitor_s / train if train else 0.0}

    def allowed(self, kind: str, share: str | None = None) -> bool:
        """Whether ``kind`` of work fits in its share of the budget.

        Drawing and profiling get half each, so neither starves the other; memory readings and the checks
        themselves come out of the drawing share.

        Example:
            >>> schedule.allowed("memory", "redraw")     # doctest: +SKIP
            True
        """
        if self.budget is None:
            return True
        share = share or kind
        return self._spent[share] + self.cost[kind] <= _SHARES[share] * self.budget * self.train_s

    def check(self, now: float) -> float:
        """Optional work at a step boundary; returns when the next step starts.

        Example:
            >>> if len(log.start) >= schedule.next_check:      # doctest: +SKIP
            ...     now = schedule.check(now)
        """
        log = self.log
        n = len(log.start)  # steps started; step n - 1 ends now
        if self._mark is None:  # first boundary since attach: start the clock
            self._mark, self._mark_n, self.next_check = now, n, n + self.every
            self._last = {k: n for k in self._last}
            self._timeline_boundary(n, ending=True)
            slow = n > 0 and now - log.start[n - 1] >= self.redraw_s
            if not self._first_drawn and slow and self._can_redraw():  # the compiling step ended: show it now
                self._first_drawn = True
                log.end[n - 1] = now
                self._redraw_now()
                after = time.perf_counter()
                self.monitor_s += after - now  # not against the drawing share (see the Notes)
                self._mark = now = after
            self._timeline_boundary(n, ending=False)
            if (self.recorder is not None and self.recorder.busy) or self._force_profile:  # profile_now() before
                self.next_check = n + 1  # the first step: its window opens at the next boundary, not ``every`` later
            self._set_due(now)
            return now
        self.train_s += now - self._mark
        self.train_steps += n - self._mark_n
        log.end[n - 1] = now
        self._timeline_boundary(n, ending=True)
        profiling = 0.0  # seconds of this check spent on profile windows
        window = self._window
        if window is not None and window.active and n >= log.windows[-1][1]:
            profiling += self._stop_window()
        # Memory readings cost ~7 us (RSS, the plan's saved bytes). When that is under 1% of
        # the steps between readings they are always taken; otherwise when the budget allows,
        # and at least every 10 * ``every`` steps: the memory curve never stops.
        since = n - self._last["memory"]
        step_s = self.train_s / self.train_steps if self.train_steps else 0.0
        # Two timed readings before one may count as dear: a single preempted one (a busy machine)
        # would otherwise stop the cheap readings until the 10 * ``every`` floor.
        cheap = self.cost["memory"] <= 0.01 * self.every * step_s or len(log.memory) < 3
        if since >= self.every and (cheap or since >= 10 * self.every or self.allowed("memory", "redraw")):
            start = time.perf_counter()
            reading = sample_memory(self.module).to_dict()
            reading["step"] = n
            log.memory.append(reading)
            self._last["memory"] = n
            took = time.perf_counter() - start
            if len(log.memory) > 1:  # the first reading warms up (~120 us); then keep the lowest
                self.cost["memory"] = min(self.cost["memory"], took) if self.cost["memory"] else took
        if not log.profiles and self.train_steps:
            # Before the first window, from the step time: its steps run ~40% slower, and
            # building the sessions and reading the profile take about a step each
            # (measured: tiny MLP 7 ms, 2-layer GPT at 21 ms a step 75-85 ms).
            step_s = self.train_s / self.train_steps
            self.cost["profile"] = 0.4 * (self.profile_steps + 1) * step_s + 2 * step_s + 0.005
        due = (
            self.profiling
            and not (self.recorder is not None and self.recorder.busy)
            and (window is None or not window.active)
            and (self._force_profile or (n - self._last["window"] >= self.every and self.allowed("profile")))
        )
        held_by_race = due and self._racing()
        if due and not held_by_race:
            self._force_profile = False
            profiling += self._start_window(n)
        elif not due:
            self.held = None
        since_redraw = now - self._redrawn_at
        redraw = since_redraw >= self.redraw_s and self._can_redraw()
        self._front_end_cost(n, now, last_chance=redraw)
        if redraw and (self.allowed("redraw") or since_redraw >= MAX_GAP * self.redraw_s):
            self.rationed = not self.allowed("redraw")  # before the redraw: the status line says so
            self._redraw_now()
            self._drawn_from = n
        self._timeline_boundary(n, ending=False)
        after = time.perf_counter()
        self.monitor_s += after - now
        self._spent["redraw"] += after - now - profiling  # checks and readings count as drawing work
        self._mark, self._mark_n = after, n
        # a window held while the providers race opens at the first step after it, not ``every`` steps later
        soon = held_by_race or (self.recorder is not None and self.recorder.busy)
        self.next_check = n + (1 if soon else self.every)
        if self._window is not None and self._window.active:
            self.next_check = min(self.next_check, log.windows[-1][1])
        self._set_due(after)
        return after

    def _redraw_now(self) -> None:
        start = time.perf_counter()
        self._redraw()
        self._redrawn_at = time.perf_counter()
        self.cost["redraw"] = self._redrawn_at - start
        self.redraws += 1

    def _front_end_cost(self, n: int, now: float, last_chance: bool) -> None:
        """Count the steps run while a front end rendered the last redraw, beyond the steps before it, as
        drawing time (Note [The view never stops for long]), once they ran or before the next redraw."""
        first = self._drawn_from
        if first is None or n <= first or (now - self._redrawn_at < _FRONT_END_S and not last_chance):
            return
        self._drawn_from = None
        log = self.log
        dt = log.durations(n)
        starts = np.asarray(log.start[first:n], dtype=float)
        count = max(int(np.sum(starts < self._redrawn_at + _FRONT_END_S)), 1)
        # against as many steps just before the redraw (at least 5): means, as step times are skewed (a
        # median under the mean would count the skew of hundreds of sub-millisecond steps as rendering)
        after, normal = dt[first:first + count], dt[max(first - max(count, 5), 0):first]
        if not len(after) or not np.isfinite(normal).any():
            return
        charged = max(self._front_end_sum, 0.0)
        self._front_end_sum += float(np.nansum(after) - len(after) * np.nanmean(normal))
        extra = max(self._front_end_sum, 0.0) - charged  # below 0: noise charged before, given back
        self.monitor_s += extra
        self._spent["redraw"] += extra

    def _set_due(self, now: float) -> None:
        """When the clock makes the next check due: the next redraw, or a retry soon when the budget held it back."""
        self.due = max(self._redrawn_at + self.redraw_s, now + 0.1 * self.redraw_s) if self._can_redraw() else math.inf

    def _racing(self) -> bool:
        """Whether parts are still measuring their execution providers (their next calls run the race's
        sessions, which would swap a profiling twin out unprofiled); ``held`` says so while they are."""
        racing = measuring_parts(self.module) if self.module is not None else 0
        self.held = (f"waiting for {racing} part(s) to finish measuring their execution providers (the "
                     "race times them on their first calls)") if racing else None
        return bool(racing)

    def _start_window(self, n: int) -> float:
        """Swap profiling sessions in for the next steps; returns the seconds it took."""
        start = time.perf_counter()
        if self._window is None:
            self._window = ProfileWindow(self.module, skip_runs=1)
        if self._window.start() == 0:
            self.profiling = False  # nothing runs in onnxruntime
            self.why_not = "nothing runs in onnxruntime, no kernels to profile"
        else:
            self.log.windows.append((n, n + self.profile_steps + 1))  # the first step warms the sessions up
        self._window_start_s = time.perf_counter() - start
        self._spent["profile"] += self._window_start_s
        return self._window_start_s

    def _stop_window(self) -> float:
        """Swap the original sessions back and keep the profile; returns the seconds it took.

        The profiled steps' extra time over the median step counts as monitor time too.
        """
        start = time.perf_counter()
        log = self.log
        nodes = self._window.stop() if self._window is not None else []
        first, end = log.windows[-1]
        end = min(end, len(log.start))
        log.windows[-1] = (first, end)
        self._last["window"] = end
        if nodes and end - first > 1:
            log.profiles.append({"step": first + 2, "steps": end - first - 1, "nodes": nodes})
            note = getattr(self.module, "note_kernel_times", None)
            if note is not None:  # a memory budget's plans are then ranked by measured times
                note(nodes)
        dt = log.durations(self._steps())
        profiled, normal = dt[first:end], np.concatenate([dt[:first], dt[end:]])[-200:]
        extra = 0.0
        if len(profiled) and np.isfinite(normal).any():
            extra = max(float(np.nansum(profiled) - len(profiled) * np.nanmedian(normal)), 0.0)
        stop_s = time.perf_counter() - start
        self.monitor_s += extra
        self._spent["profile"] += stop_s + extra
        self.cost["profile"] = self._window_start_s + stop_s + extra
        return stop_s
