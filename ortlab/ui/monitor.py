"""Live training monitor: loss, step time, throughput, memory and kernel time in a notebook.

``monitor(om)`` watches an ORTModule, so the training loop stays an ordinary loop;
about once a second it redraws a plotly FigureWidget in one ``batch_update`` (or,
where widgets do not render, a plain figure updated in place), and while a step
compiles for onnxruntime its status line follows the engine's stages. The same data
can be saved to JSON and plotted afterwards with ``Monitor.load(path).figure()``.

:class:`Monitor` puts together one part per job, each beside it in ``ortlab.ui``:

* ``_monitor_data``: what is recorded (a ``StepLog``) and its JSON file;
* ``_monitor_watch``: the module's calls as steps (Note [Watching the forward]);
* ``_monitor_schedule``: the work at step boundaries, memory readings and profile
  windows, within the budget (Note [Staying within the overhead budget]);
* ``_monitor_view`` and ``_monitor_figure``: the live view, the figures, the notebook hooks;
* ``_monitor_status``: the status line, the kernel panels' note, the compile's progress
  (Note [Showing the first step as it compiles]).

Note [Counting steps]
With ``auto=True`` a step starts at a training-mode forward call and ends when the
next one starts: the last step of a loop has no end until then. The count shown is
the steps whose forward call returned (the loop is past them; while the monitor
draws at a boundary, the step that just ended counts, the next has not begun), so
after a loop of 60 steps it reads "step 60". The last step's time is known once it
ends: at the next forward, at the end of the notebook cell (the time between cells is
not training), at :meth:`Monitor.detach` or :meth:`Monitor.close`.
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from typing import Any

from ortlab.errors import ConfigError, OrtlabError
from ortlab.inspect.profile_window import collect_profile
from ortlab.ui import _monitor_figure as plots
from ortlab.ui._monitor_data import FORMAT, MAX_FILE_BYTES, StepLog, scalar
from ortlab.ui._monitor_schedule import MAX_GAP, Schedule
from ortlab.ui._monitor_status import StageProgress, kernel_note, providers_note, status_line, waiting_line
from ortlab.ui._monitor_view import MonitorView
from ortlab.ui._monitor_watch import StepWatcher

__all__ = ["Monitor", "monitor"]

logger = logging.getLogger(__name__)


def _setting(part: str, name: str, doc: str) -> Any:
    """A Monitor attribute kept by one of its parts (read and set there)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


class Monitor:
    """Records a training run and draws it live; build it with :func:`monitor`.

    What it records is a ``StepLog`` (``ortlab.ui._monitor_data``); a ``StepWatcher``
    turns the module's calls into steps, a ``Schedule`` keeps to the budget and runs the
    memory readings and profile windows, a ``MonitorView`` draws (see the module
    docstring).

    Attributes:
        every: steps between memory readings and profile windows, at least (see
            Note [Staying within the overhead budget] in ``ortlab.ui._monitor_schedule``).
        redraw_s: seconds between redraws, about (Note [Redrawing by the clock]).
        budget: the fraction of training time the monitor may spend.
        profiles: one entry per profile window: ``{"step", "steps", "nodes"}``,
            ``nodes`` a list of :class:`~ortlab.inspect.profile.NodeTime`.
        monitor_s: seconds the monitor spent while training.
    """

    every = _setting("_schedule", "every", "Steps between memory readings and profile windows, at least.")
    redraw_s = _setting("_schedule", "redraw_s", "Seconds between redraws, about.")
    budget = _setting("_schedule", "budget", "The fraction of training time the monitor may spend, or None.")
    profile_steps = _setting("_schedule", "profile_steps", "Steps per profile window.")
    monitor_s = _setting("_schedule", "monitor_s", "Seconds the monitor spent while training.")
    mode = _setting("_view", "mode", "'auto', 'widget' or 'static'.")
    max_points = _setting("_view", "max_points", "Points per line.")
    top = _setting("_view", "top", "Bars per kernel-time panel.")
    module_depth = _setting("_view", "module_depth", "Module paths are cut to this many parts.")

    def __init__(
        self,
        ortmodule: Any = None,
        every: int = 10,
        *,
        auto: bool = True,
        profile: bool = True,
        profile_steps: int = 3,
        budget: float | None = 0.015,
        mode: str = "auto",
        max_points: int = 1000,
        top: int = 10,
        module_depth: int | None = None,
        redraw_s: float = 1.0,
    ) -> None:
        if every < 1:
            raise ConfigError(f"every={every} must be a positive number of steps.")
        if mode not in ("auto", "widget", "static"):
            raise ConfigError(f"mode={mode!r} is not valid; choose 'auto', 'widget' or 'static'.")
        if budget is not None and not 0 < budget < 1:
            raise ConfigError(f"budget={budget} must be a fraction between 0 and 1 (e.g. 0.015), or None for no limit.")
        if not redraw_s > 0:
            raise ConfigError(f"redraw_s={redraw_s} must be a positive number of seconds (e.g. 1.0).")
        self.ortmodule, self.auto = ortmodule, auto
        self._log = StepLog()  # what was recorded; the rest of the state is the watching
        self._pending: dict[str, Any] = {}
        self._attach_len = 0  # steps started before the last attach
        self._attached = False
        opts = getattr(ortmodule, "options", None)
        self._collect_at_close = bool(profile and getattr(opts, "profile", False))
        if self._collect_at_close:
            logger.info("ortlab monitor: the module profiles every step (profile=True); kernel panels fill at close()")
        self._view = MonitorView(self._log, lambda: self.steps, self.status, mode=mode, max_points=max_points,
                                 top=top, module_depth=module_depth, timed=self._redraw_timed,
                                 kernels=self._kernel_note, cell_ended=self._cell_ended)
        # A plain nn.Module can be watched too (an eager baseline): no kernel profile then.
        why_not = None
        if ortmodule is None:
            why_not = "none recorded"
        elif not profile:
            why_not = "not sampled (monitor(..., profile=False))"
        elif ortmodule is not None and not hasattr(ortmodule, "report"):
            why_not = "none: a plain nn.Module runs no onnxruntime kernels"
        elif self._collect_at_close:
            why_not = "the module profiles every step (ORTModule(profile=True)); the panels fill at mon.close()"
        self._schedule = Schedule(
            ortmodule, self._log, lambda: self.steps, every=every, budget=budget, profile_steps=profile_steps,
            profiling=why_not is None and ortmodule is not None, redraw=self._view.redraw,
            can_redraw=self._view.has_view, redraw_s=redraw_s, why_not=why_not,
        )
        self._watcher = StepWatcher(ortmodule, self._log, self._schedule) if ortmodule is not None else None
        self._progress: StageProgress | None = None

    def _redraw_timed(self, seconds: float) -> None:
        self._schedule.cost["redraw"] = seconds  # the budget's first estimate of a redraw

    # The live widgets, for tests and benchmarks that look inside.
    _figure_widget = property(lambda self: self._view.figure_widget)
    _status = property(lambda self: self._view.status_widget)

    # --------------------------------------------------------------------- attaching
    def attach(self) -> Monitor:
        """Start watching: each training-mode forward call of the module starts a step.

        See Note [Watching the forward] in ``ortlab.ui._monitor_watch``.

        Example:
            >>> mon = Monitor(om).attach()      # what monitor(om) does  # doctest: +SKIP
        """
        if self.ortmodule is None or self._watcher is None:
            raise OrtlabError("this Monitor was loaded from a file; it has no module to watch.")
        if self._attached:
            return self
        self._attached = True
        self._attach_len = len(self._log.start)
        self._schedule.restart()  # the first check only starts the clock
        self._follow_stages()
        if not self.auto:
            self._open_step(time.perf_counter(), None)
            return self
        self._watcher.start()
        return self

    def _follow_stages(self) -> None:
        """Show the engine's stages in the status line while a step compiles (Note [Showing the first
        step as it compiles] in ``ortlab.ui._monitor_status``)."""
        if self._progress is not None:
            self._progress.active = True
            return
        if not hasattr(self.ortmodule, "add_stage_sink"):
            return
        log, view, module = self._log, weakref.ref(self._view), weakref.ref(self.ortmodule)

        # The sink holds the view and the module weakly: the engine's backend, which torch
        # keeps for as long as the compiled code, holds the sink (detach() also removes it).
        def show(text: str) -> None:
            live = view()
            if live is not None:
                live.show_status(text)

        def note() -> str:
            live = module()
            return providers_note(live) if live is not None else ""

        self._progress = StageProgress(show, lambda: len(log.start), lambda: log.start[-1] if log.start else None,
                                       note)
        self.ortmodule.add_stage_sink(self._progress)

    def detach(self) -> None:
        """Stop watching; the recorded steps stay.

        With ``auto=True`` the step in progress ends now (its forward ran); with
        ``auto=False`` the step opened by the last ``mon.step()`` has not run and is dropped.
        """
        if not self._attached:
            return
        if self._watcher is not None:
            self._watcher.stop()
        if self._progress is not None:
            self._progress.active = False
            self.ortmodule.remove_stage_sink(self._progress)
            self._progress = None
        if self._is_open():
            if self.auto:
                self._log.end[len(self._log.start) - 1] = time.perf_counter()
            else:
                self._log.drop_last()
        self._attached = False
        self._schedule.stop_profiling()
        self._schedule.finish_timeline()

    def _cell_ended(self) -> None:
        """A notebook cell ended: so did the step in progress (Note [Counting steps]); the clock stops."""
        if not (self._attached and self.auto):
            return
        now = time.perf_counter()
        if self._is_open():
            self._log.end[len(self._log.start) - 1] = now
        self._schedule.pause(now)

    def close(self) -> None:
        """Stop watching, read a ``profile=True`` module's profile, and draw the final state.

        With ``auto=True`` the step in progress ends now (call ``close`` right after
        the training loop, or use ``with monitor(om) as mon:``); with ``auto=False``
        the step opened by the last ``mon.step()`` has not run and is dropped. The
        profile of a ``profile=True`` module leaves out each session's first run (the
        first step's: cold caches, memory being allocated).
        """
        self.detach()
        if self._collect_at_close and self.ortmodule is not None:
            nodes = collect_profile(self.ortmodule, remove_files=True, skip_runs=1)
            if nodes and self.steps > 1:
                self._log.profiles.append({"step": 2, "steps": self.steps - 1, "nodes": nodes})
        self.refresh()
        self._view.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------------- recording
    def step(self, loss: Any = None, batch_size: int | None = None, **metrics: Any) -> None:
        """End the current step (``auto=False``), recording its loss, batch size and metrics.

        With ``auto=True`` the module's forward calls mark the steps and ``step``
        only records the values, like :meth:`log`.

        Example:
            >>> mon = monitor(om, auto=False)                           # doctest: +SKIP
            >>> for x, y in data:                                       # doctest: +SKIP
            ...     loss = loss_fn(om(x), y); loss.backward(); opt.step()
            ...     mon.step(loss, batch_size=len(x))
        """
        if loss is not None:
            metrics["loss"] = loss
        self.log(**metrics)
        if self._current() is not None and batch_size is not None:
            self._log.batch[-1] = int(batch_size)
        if not self.auto and self._attached:
            now = time.perf_counter()
            if len(self._log.start) >= self._schedule.next_check or now >= self._schedule.due:
                now = self._schedule.check(now)
            self._open_step(now, None)

    def log(self, **values: Any) -> None:
        """Attach values (``loss=...`` or any scalar metric) to the current step.

        Example:
            >>> loss = loss_fn(om(x), y)                         # doctest: +SKIP
            >>> mon.log(loss=loss, lr=sched.get_last_lr()[0])    # doctest: +SKIP
        """
        index = self._current()
        if index is None:
            self._pending.update(values)  # attached to the next step that logs
            return
        if self._pending:
            values, self._pending = {**self._pending, **values}, {}
        for key, value in values.items():
            column = self._log.loss if key == "loss" else self._log.extra.setdefault(key, {})
            column[index] = scalar(value)

    def _open_step(self, now: float, batch: int | None) -> None:
        self._log.start.append(now)
        self._log.batch.append(batch)

    def _is_open(self) -> bool:
        """Whether the last recorded step has no end yet."""
        n = len(self._log.start)
        return self._attached and n > self._attach_len and (n - 1) not in self._log.end

    def _current(self) -> int | None:
        """The step values logged now belong to: the last one started (``auto=True``), or the open one."""
        n = len(self._log.start)
        if self.auto:
            return n - 1 if self._attached and n > self._attach_len else None
        return n - 1 if self._is_open() else None

    def profile_now(self) -> None:
        """Profile the kernels for ``profile_steps`` steps from the next step, whatever the budget.

        Example:
            >>> mon.profile_now()      # the kernel panels fill a few steps later  # doctest: +SKIP
        """
        if not self._schedule.profiling:
            raise OrtlabError(
                "this monitor does not profile: it was made with profile=False, loaded from a file, "
                "or the module profiles every step already (profile=True; read at close())."
            )
        self._schedule.profile_now()

    def record_timeline(self) -> int:
        """Record a coming training step on one time axis; returns its number (see :meth:`timeline`).

        Example:
            >>> mon.record_timeline()      # 12: one warm-up step, then step 12 is recorded  # doctest: +SKIP
        """
        if self.ortmodule is None or not self._attached:
            raise OrtlabError("this monitor is not watching a module (loaded from a file, or detached): "
                              "a timeline records a training step it watches.")
        step = self._schedule.record_timeline()
        logger.info("ortlab monitor: step %d will be recorded as a timeline", step)
        return step

    def timeline(self) -> Any:
        """One training step with PyTorch's ops and onnxruntime's kernels on one time axis.

        Returns the last step recorded by :meth:`record_timeline` (an
        ``ortlab.inspect.timeline.Timeline``; a notebook shows it as a plotly figure
        titled with where the step's time went); a step still being recorded ends at
        its last event. When none was recorded or armed, this arms one and raises,
        saying which step will be recorded: train until it ends, then call again.

        Example:
            >>> mon.record_timeline()                 # doctest: +SKIP
            >>> for _ in range(3): train_step()       # doctest: +SKIP
            >>> mon.timeline()                        # the figure  # doctest: +SKIP
        """
        from ortlab.ui import _timeline_figure  # noqa: F401  (registers the timeline's views)

        recorder = self._schedule.recorder
        if recorder is not None and recorder.state == "recording":
            self._schedule.finish_timeline()
        if recorder is not None and recorder.last is not None:
            return recorder.last
        if recorder is not None and recorder.busy:
            waits = f"; it waits while {recorder.waiting}" if recorder.waiting else ""
            raise OrtlabError(f"step {recorder.step} will be recorded as a timeline; it has not run yet "
                              f"({self.steps} steps so far{waits}): train until it ends, then call mon.timeline() "
                              "again.")
        step = self.record_timeline()
        raise OrtlabError(f"no timeline recorded yet: step {step} will be recorded (after one warm-up step when "
                          "onnxruntime runs); train until it ends, then call mon.timeline() again.")

    def export_trace(self, path: str | os.PathLike) -> str:
        """Write the recorded step (:meth:`timeline`) as a Chrome trace JSON, for Perfetto or chrome://tracing.

        Example:
            >>> mon.export_trace("step.json")      # open it in https://ui.perfetto.dev  # doctest: +SKIP
        """
        return self.timeline().export_trace(path)

    # -------------------------------------------------------------------------- data
    @property
    def steps(self) -> int:
        """Steps run: with ``auto=True`` those whose forward call returned (Note [Counting steps]),
        with ``auto=False`` those ended by ``mon.step()``."""
        n = len(self._log.start)
        if self._is_open() and (not self.auto or (self._watcher is not None and self._watcher.calling)):
            return n - 1
        return n

    @property
    def profiles(self) -> list[dict[str, Any]]:
        """The kernel profiles: one ``{"step", "steps", "nodes"}`` per profile window."""
        return self._log.profiles

    @property
    def data(self) -> list[dict[str, Any]]:
        """One dict per finished step.

        Keys: ``step`` (from 1), ``time_s`` (since the monitor was made), ``step_s``
        (NaN for a last step that has not ended, see Note [Counting steps]),
        ``batch``, ``samples_per_s``, ``loss``, ``profiled`` (the profiler was on),
        values given to :meth:`log`, and every ``every`` steps ``rss_bytes``,
        ``saved_bytes`` (and ``cuda_*_bytes`` on a GPU).
        """
        return self._log.rows(self.steps)

    @property
    def overhead(self) -> dict[str, float]:
        """The monitor's seconds, the monitored training seconds, and their ratio."""
        return self._schedule.overhead

    # --------------------------------------------------------------------- save/load
    def save(self, path: str | os.PathLike) -> str:
        """Write the recorded steps and kernel profiles to a JSON file.

        Example:
            >>> mon.save("run.json")                         # doctest: +SKIP
            >>> Monitor.load("run.json").figure().show()     # doctest: +SKIP
        """
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self._log.to_document(self.steps, self.every, self.overhead), f)
        return os.fspath(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Monitor:
        """A Monitor holding a file written by :meth:`save` (nothing attached).

        The file is read as JSON only (nothing in it runs) and checked before use: every
        value of its type, numbers finite or null, within the limits of
        ``ortlab.ui._monitor_data`` (``MAX_STEPS``...).

        Example:
            >>> Monitor.load("run.json").figure()     # doctest: +SKIP

        Raises:
            ConfigError: the file is not a monitor file or has a wrong entry (the message names it).
        """
        where = repr(os.fspath(path))
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise ConfigError(f"{where} has {os.path.getsize(path):,} bytes, more than a monitor file holds "
                              f"({MAX_FILE_BYTES:,}); is it a file of Monitor.save(path)?")
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (ValueError, RecursionError) as e:  # not JSON, or nested deeper than a monitor file
            raise ConfigError(f"{where} is not an ortlab monitor file ({e}); "
                              "write one with Monitor.save(path).") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ConfigError(f"{where} is not an ortlab monitor file; write one with Monitor.save(path).")
        log = StepLog.from_document(doc, where)
        mon = cls(None, every=doc.get("every", 10), profile=False)
        mon._log = mon._view.log = mon._schedule.log = log
        overhead = doc.get("overhead", {})
        mon._schedule.monitor_s = float(overhead.get("monitor_s") or 0.0)
        mon._schedule.train_s = float(overhead.get("train_s") or 0.0)
        return mon

    # ----------------------------------------------------------------------- drawing
    def status(self) -> str:
        """One line: steps run, step time, samples/s, loss, the first step, the monitor's overhead, the kernels.

        While the first step compiles: which of the engine's stages is done and what runs next.
        """
        n = self.steps
        if n == 0 and self._progress is not None and self._progress.text:
            return self._progress.text
        if n == 0:
            return waiting_line(len(self._log.start))
        schedule = self._schedule
        rationed = None
        if schedule.rationed and schedule.budget is not None:
            rationed = (f"redrawn every {MAX_GAP * schedule.redraw_s:g} s, not {schedule.redraw_s:g} s: drawing "
                        f"(with the front end's rendering) is over its share of budget={schedule.budget:g}")
        return status_line(self._log, n, self.overhead["fraction"], self._kernel_note(), rationed)

    def kernel_note(self) -> str:
        """What the kernel panels show, or when they will fill, or why they will not (``kernels: ...``)."""
        return self._kernel_note()

    def _kernel_note(self) -> str:
        schedule = self._schedule
        return kernel_note(self._log, schedule.why_not or schedule.held, schedule.window(), schedule.next_window())

    def figure(self) -> Any:
        """A plain plotly Figure of everything recorded (after training, or from a file).

        Example:
            >>> Monitor.load("run.json").figure().write_html("run.html")   # doctest: +SKIP
        """
        return self._view.figure()

    def kernel_table(self, top: int = 15, **kwargs: Any) -> Any:
        """The slowest kernels of the last profile window, each linked to its node in the
        module's own graphs, shown in netron under the table (see ``ortlab.ui.kernel_table``).

        Example:
            >>> mon.kernel_table(top=10)      # doctest: +SKIP
        """
        from ortlab.ui.kernel_table import kernel_table

        return kernel_table(self, top=top, **kwargs)

    def refresh(self) -> None:
        """Redraw now, whatever the budget (after training, or on demand)."""
        self._view.refresh()

    # ----------------------------------------------------------------------- display
    def widget(self) -> Any:
        """The live view, an ipywidgets VBox (status line, FigureWidget), or None.

        None where plotly's FigureWidget cannot be built or does not render (no
        ipywidgets/anywidget, Colab, VS Code, ``mode="static"``): :meth:`show` then
        draws a plain figure and updates it in place.
        """
        return self._view.widget()

    def show(self) -> None:
        """Display the live view in the notebook (the widget, or a figure updated in place)."""
        self._view.show()

    def _ipython_display_(self) -> None:
        self._view.ipython_display()

    def _repr_html_(self) -> str:
        return self._view.html()

    def __repr__(self) -> str:
        return (f"Monitor(steps={self.steps}, every={self.every}, profiles={len(self.profiles)}, "
                f"overhead={self.overhead['fraction']:.1%})")


def monitor(
    ortmodule: Any,
    every: int = 10,
    *,
    auto: bool = True,
    profile: bool = True,
    profile_steps: int = 3,
    budget: float | None = 0.015,
    mode: str = "auto",
    show: bool | None = None,
    max_points: int = 1000,
    top: int = 10,
    module_depth: int | None = None,
    redraw_s: float = 1.0,
) -> Monitor:
    """Watch an ORTModule train: live loss, step time, samples/s, memory and kernel time.

    Each training-mode forward call of the module starts a step (calls under
    ``torch.no_grad()`` or in eval mode are not steps). A scalar output is taken as
    the loss; otherwise call ``mon.log(loss=loss)``. About every ``redraw_s``
    seconds, within the overhead ``budget``, the plots are redrawn; while a step
    compiles (the first: capture, export, sessions) the status line follows the
    engine's stages; kernel times come from onnxruntime's profiler, switched on
    ``profile_steps`` steps at a time.

    Args:
        ortmodule: the ``ortlab.ORTModule`` being trained (a plain ``nn.Module``
            works too, as an eager baseline, without kernel profiles).
        every: steps between memory readings and profile windows, at least.
        auto: watch the module's forward calls; ``False`` to end each step with
            ``mon.step(loss, batch_size=...)``.
        profile: sample onnxruntime's per-kernel profile in windows.
        profile_steps: steps per profile window (one more runs to warm it up).
        budget: the fraction of training time the monitor may spend (0.015 = 1.5%);
            ``None``: no limit, redraw every ``redraw_s`` and profile every ``every`` steps.
        mode: ``"widget"`` (plotly FigureWidget), ``"static"`` (a plain figure
            re-drawn in place, for front ends without widgets) or ``"auto"``.
        show: display now; by default when running in a Jupyter kernel.
        max_points: points per line (longer runs are bucket-averaged).
        top: bars per kernel-time panel.
        module_depth: cut module paths to this many parts (``blocks.0``).
        redraw_s: seconds between redraws, about (Note [Redrawing by the clock] in
            ``ortlab.ui._monitor_schedule``).

    Returns:
        the attached :class:`Monitor`; ``mon.close()`` (or ``with monitor(om):``)
        stops watching and draws the final state.

    Example:
        >>> mon = monitor(om, every=20)                   # doctest: +SKIP
        >>> for x, y in loader:                           # doctest: +SKIP
        ...     loss = F.cross_entropy(om(x), y)
        ...     mon.log(loss=loss)
        ...     loss.backward(); opt.step(); opt.zero_grad()
        >>> mon.save("run.json")                          # doctest: +SKIP
    """
    mon = Monitor(ortmodule, every, auto=auto, profile=profile, profile_steps=profile_steps, budget=budget,
                  mode=mode, max_points=max_points, top=top, module_depth=module_depth, redraw_s=redraw_s).attach()
    if show or (show is None and plots.in_kernel() is not None):
        mon.show()
    return mon
