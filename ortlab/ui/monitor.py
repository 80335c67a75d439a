"""Live training monitor: loss, step time, throughput, memory and kernel time in a notebook.

``monitor(om)`` watches an ORTModule, so the training loop stays an ordinary loop;
every ``every`` steps it redraws a plotly FigureWidget in one ``batch_update`` (or,
where widgets do not render, a plain figure updated in place). The same data can be
saved to JSON and plotted afterwards with ``Monitor.load(path).figure()``.

Note [Staying within the overhead budget]
A redraw costs 1-3 ms (numpy arrays, at most ``max_points`` per trace; plain lists
of 10k points cost 150 ms) and a profile window 7 ms (tiny MLP) to 80 ms (2-layer
GPT), most of it the profiled steps running ~40% slower (see Note [Sampling the
profiler in windows] in ``ortlab.inspect.profile``). A tiny MLP's step takes
0.4 ms: redrawing every 10 steps would double it. So ``every`` is the *shortest*
interval: the monitor times all it does (redraws, memory readings, profile
windows, and the profiled steps' extra time over the median step) and starts
optional work only while it stays under ``budget`` (default 1.5%) of the
monitored training time, not counting the first step (the capture): a third for
drawing and readings, two thirds for profiling. Before measuring, it times one
redraw when the view is built and estimates a window from the step time, so
short runs do not overshoot. The first window of a model with 25 ms steps thus
comes after about 10 s of training; ``mon.profile_now()`` takes one at the next
step whatever the budget. A step's recorded time excludes the monitor's work at
its boundary, so redraws do not show up as slow steps.

Note [Watching the forward]
Each step costs the monitor a timestamp, two list appends, a counter check and
the loss read; the rest is computed when drawing. A forward pre-hook plus a
forward hook would take ``nn.Module._call_impl`` off its fast path: on a bare
module they cost 1.6 us a call, against ~0.5 us for a wrapper around the call; in a
tiny MLP's training loop (0.43 ms a step), 2-5% against 1-2% (paired A/B runs on
the 2-core box, noise about 1%). So an ORTModule is watched through the engine's own
hook, ``ORTModule.set_call_watcher`` (each call runs through the watcher; copies
and pickles of the module are not watched), and nothing is patched on the
instance. A plain ``nn.Module`` (an eager baseline) is watched with torch's public
forward hooks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ortlab.inspect.memory import sample_memory
from ortlab.inspect.profile import ProfileWindow, collect_profile
from ortlab.ui import _monitor_figure as plots
from ortlab.ui._monitor_data import FORMAT, StepLog, samples_in, scalar
from ortlab.errors import ConfigError, OrtlabError

__all__ = ["Monitor", "monitor"]

logger = logging.getLogger(__name__)

_SHARES = {"redraw": 1 / 3, "profile": 2 / 3}  # of the budget; see Monitor._allowed


class Monitor:
    """Records a training run and draws it live; build it with :func:`monitor`.

    What it records is a ``StepLog`` (``ortlab.ui._monitor_data``), drawn by
    ``ortlab.ui._monitor_figure``; the Monitor watches the module, keeps to the budget and
    runs the profile windows.

    Attributes:
        every: steps between redraws and memory readings, at least (see
            Note [Staying within the overhead budget]).
        budget: the fraction of training time the monitor may spend.
        profiles: one entry per profile window: ``{"step", "steps", "nodes"}``,
            ``nodes`` a list of :class:`~ortlab.inspect.profile.NodeTime`.
        monitor_s: seconds the monitor spent while training.
    """

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
    ) -> None:
        if every < 1:
            raise ConfigError(f"every={every} must be a positive number of steps.")
        if mode not in ("auto", "widget", "static"):
            raise ConfigError(f"mode={mode!r} is not valid; choose 'auto', 'widget' or 'static'.")
        if budget is not None and not 0 < budget < 1:
            raise ConfigError(f"budget={budget} must be a fraction between 0 and 1 (e.g. 0.015), or None for no limit.")
        self.ortmodule, self.every, self.auto, self.budget, self.mode = ortmodule, every, auto, budget, mode
        self.profile_steps, self.max_points, self.top, self.module_depth = profile_steps, max_points, top, module_depth
        self._log = StepLog()  # what was recorded; the rest of the state is the watching
        self._pending: dict[str, Any] = {}
        self._attach_len = 0  # steps started before the last attach
        # Budget (see the Note): measured costs, or first guesses.
        self.monitor_s, self._train_s, self._train_steps = 0.0, 0.0, 0
        self._mark: float | None = None
        self._mark_n = 0
        self._cost = {"redraw": 0.005, "profile": 0.01, "memory": 0.0}
        self._spent = {"redraw": 0.0, "profile": 0.0}
        self._next_check = 0
        self._last = {"redraw": 0, "memory": 0, "window": 0}
        self._drawn = -1
        # Profiling.
        self._window: ProfileWindow | None = None
        self._window_start_s = 0.0
        self._force_profile = False
        opts = getattr(ortmodule, "options", None)
        self._collect_at_close = bool(profile and getattr(opts, "profile", False))
        # A plain nn.Module can be watched too (an eager baseline): no kernel profile then.
        self._profile = profile and hasattr(ortmodule, "report") and not self._collect_at_close
        if self._collect_at_close:
            logger.info("ortlab monitor: the module profiles every step (profile=True); kernel panels fill at close()")
        # Views.
        self._figure_widget: Any = None
        self._static_figure: Any = None
        self._status: Any = None
        self._box: Any = None
        self._handles: list[Any] = []
        self._shown_in: int | None = None
        self._cell_callback: Callable | None = None
        self._attached = False
        self._unwatch: Callable[[], None] | None = None

    # --------------------------------------------------------------------- attaching
    def attach(self) -> Monitor:
        """Start watching: each training-mode forward call of the module starts a step.

        See Note [Watching the forward].
        """
        if self.ortmodule is None:
            raise OrtlabError("this Monitor was loaded from a file; it has no module to watch.")
        if self._attached:
            return self
        self._attached, self._mark = True, None
        self._attach_len = len(self._log.start)
        self._next_check = len(self._log.start) + 1  # the first check only starts the clock
        if not self.auto:
            self._open_step(time.perf_counter(), None)
            return self
        module, mon = self.ortmodule, self
        starts, batches, losses, perf = self._log.start, self._log.batch, self._log.loss, time.perf_counter

        def watched() -> bool:
            return mon._attached and module.training and torch.is_grad_enabled() and not torch.compiler.is_compiling()

        def started(args: tuple, kwargs: dict) -> None:
            now = perf()
            if len(starts) >= mon._next_check:
                now = mon._check(now)
            starts.append(now)
            batches.append(samples_in(args, kwargs))

        def ended(out: Any) -> None:
            if type(out) is torch.Tensor and out.dim() == 0 and out.is_floating_point():
                losses.setdefault(len(starts) - 1, scalar(out))

        if hasattr(module, "set_call_watcher"):  # an ORTModule: the engine's hook
            def watch(call: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
                if not watched():
                    return call(args, kwargs)
                started(args, kwargs)
                out = call(args, kwargs)
                ended(out)
                return out

            previous = module.set_call_watcher(watch)

            def unwatch() -> None:
                current = module.set_call_watcher(previous)
                if current is not watch:  # another tool's watcher went on after ours: leave it
                    module.set_call_watcher(current)

            self._unwatch = unwatch
        else:  # a plain nn.Module (an eager baseline): torch's forward hooks
            def pre_hook(_: Any, args: tuple, kwargs: dict) -> None:
                if watched():
                    started(args, kwargs)

            def hook(_: Any, args: tuple, kwargs: dict, out: Any) -> None:
                if watched():
                    ended(out)

            handles = [module.register_forward_pre_hook(pre_hook, with_kwargs=True),
                       module.register_forward_hook(hook, with_kwargs=True)]
            self._unwatch = lambda: [h.remove() for h in handles] and None
        return self

    def detach(self) -> None:
        """Stop watching; the recorded steps stay, the step in progress is dropped."""
        if not self._attached:
            return
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self._is_open():
            self._log.drop_last()
        self._attached = False
        if self._window is not None and self._window.active:
            self._stop_window()

    def close(self) -> None:
        """Stop watching, read a ``profile=True`` module's profile, and draw the final state.

        With ``auto=True`` the step in progress ends now (call ``close`` right after
        the training loop, or use ``with monitor(om) as mon:``); with ``auto=False``
        the step opened by the last ``mon.step()`` has not run and is dropped.
        """
        if self.auto and self._is_open():
            self._log.end[len(self._log.start) - 1] = time.perf_counter()
        self.detach()
        if self._collect_at_close and self.ortmodule is not None:
            nodes = collect_profile(self.ortmodule, remove_files=True)
            if nodes:
                self._log.profiles.append({"step": 1, "steps": max(self.steps, 1), "nodes": nodes})
        self.refresh()
        shell = plots.in_kernel()
        if self._cell_callback is not None and shell is not None:
            with contextlib.suppress(ValueError):
                shell.events.unregister("post_run_cell", self._cell_callback)
        self._cell_callback = None

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
        if self._is_open() and batch_size is not None:
            self._log.batch[-1] = int(batch_size)
        if not self.auto and self._attached:
            now = time.perf_counter()
            if len(self._log.start) >= self._next_check:
                now = self._check(now)
            self._open_step(now, None)

    def log(self, **values: Any) -> None:
        """Attach values (``loss=...`` or any scalar metric) to the current step.

        Example:
            >>> loss = loss_fn(om(x), y)                         # doctest: +SKIP
            >>> mon.log(loss=loss, lr=sched.get_last_lr()[0])    # doctest: +SKIP
        """
        if not self._is_open():
            self._pending.update(values)  # attached to the next step that logs
            return
        if self._pending:
            values, self._pending = {**self._pending, **values}, {}
        index = len(self._log.start) - 1
        for key, value in values.items():
            column = self._log.loss if key == "loss" else self._log.extra.setdefault(key, {})
            column[index] = scalar(value)

    def _open_step(self, now: float, batch: int | None) -> None:
        self._log.start.append(now)
        self._log.batch.append(batch)

    def _is_open(self) -> bool:
        """Whether the last recorded step is still running."""
        n = len(self._log.start)
        return self._attached and n > self._attach_len and (n - 1) not in self._log.end

    def profile_now(self) -> None:
        """Profile the kernels for ``profile_steps`` steps from the next step, whatever the budget.

        Example:
            >>> mon.profile_now()      # the kernel panels fill a few steps later  # doctest: +SKIP
        """
        if not self._profile:
            raise OrtlabError(
                "this monitor does not profile: it was made with profile=False, loaded from a file, "
                "or the module profiles every step already (profile=True; read at close())."
            )
        self._force_profile = True
        self._next_check = min(self._next_check, len(self._log.start))

    # ------------------------------------------------------------------------ budget
    def _allowed(self, kind: str, share: str | None = None) -> bool:
        """Whether ``kind`` of work fits in its share of the budget.

        Drawing gets a third and profiling two thirds (a window costs ten times a
        redraw), so neither starves the other; memory readings and the checks
        themselves come out of the drawing share.
        """
        if self.budget is None:
            return True
        share = share or kind
        return self._spent[share] + self._cost[kind] <= _SHARES[share] * self.budget * self._train_s

    def _check(self, now: float) -> float:
        """Optional work at a step boundary; returns when the next step starts."""
        log = self._log
        n = len(log.start)  # steps started; step n - 1 ends now
        if self._mark is None:  # first boundary since attach: start the clock
            self._mark, self._mark_n, self._next_check = now, n, n + self.every
            self._last = {k: n for k in self._last}
            return now
        self._train_s += now - self._mark
        self._train_steps += n - self._mark_n
        log.end[n - 1] = now
        profiling = 0.0  # seconds of this check spent on profile windows
        window = self._window
        if window is not None and window.active and n >= log.windows[-1][1]:
            profiling += self._stop_window()
        # Memory readings cost ~7 us (RSS, the plan's saved bytes). When that is under 1% of
        # the steps between readings they are always taken; otherwise when the budget allows,
        # and at least every 10 * ``every`` steps: the memory curve never stops.
        since = n - self._last["memory"]
        step_s = self._train_s / self._train_steps if self._train_steps else 0.0
        cheap = self._cost["memory"] <= 0.01 * self.every * step_s
        if since >= self.every and (cheap or since >= 10 * self.every or self._allowed("memory", "redraw")):
            start = time.perf_counter()
            reading = sample_memory(self.ortmodule).to_dict()
            reading["step"] = n
            log.memory.append(reading)
            self._last["memory"] = n
            took = time.perf_counter() - start
            if len(log.memory) > 1:  # the first reading warms up (~120 us); then keep the lowest
                self._cost["memory"] = min(self._cost["memory"], took) if self._cost["memory"] else took
        if not log.profiles and self._train_steps:
            # Before the first window, from the step time: its steps run ~40% slower, and
            # building the sessions and reading the profile take about a step each
            # (measured: tiny MLP 7 ms, 2-layer GPT at 21 ms a step 75-85 ms).
            step_s = self._train_s / self._train_steps
            self._cost["profile"] = 0.4 * (self.profile_steps + 1) * step_s + 2 * step_s + 0.005
        if (
            self._profile
            and (window is None or not window.active)
            and (self._force_profile or (n - self._last["window"] >= self.every and self._allowed("profile")))
        ):
            self._force_profile = False
            profiling += self._start_window(n)
        if n - self._last["redraw"] >= self.every and self._has_view() and self._allowed("redraw"):
            start = time.perf_counter()
            self._redraw()
            self._cost["redraw"] = time.perf_counter() - start
            self._last["redraw"] = n
        after = time.perf_counter()
        self.monitor_s += after - now
        self._spent["redraw"] += after - now - profiling  # checks and readings count as drawing work
        self._mark, self._mark_n = after, n
        self._next_check = n + self.every
        if self._window is not None and self._window.active:
            self._next_check = min(self._next_check, log.windows[-1][1])
        return after

    def _start_window(self, n: int) -> float:
        """Swap profiling sessions in for the next steps; returns the seconds it took."""
        start = time.perf_counter()
        if self._window is None:
            self._window = ProfileWindow(self.ortmodule, skip_runs=1)
        if self._window.start() == 0:
            self._profile = False  # nothing runs in onnxruntime
        else:
            self._log.windows.append((n, n + self.profile_steps + 1))  # the first step warms the sessions up
        self._window_start_s = time.perf_counter() - start
        self._spent["profile"] += self._window_start_s
        return self._window_start_s

    def _stop_window(self) -> float:
        """Swap the original sessions back and keep the profile; returns the seconds it took.

        The profiled steps' extra time over the median step counts as monitor time too.
        """
        start = time.perf_counter()
        log = self._log
        nodes = self._window.stop() if self._window is not None else []
        first, end = log.windows[-1]
        end = min(end, len(log.start))
        log.windows[-1] = (first, end)
        self._last["window"] = end
        if nodes and end - first > 1:
            log.profiles.append({"step": first + 2, "steps": end - first - 1, "nodes": nodes})
        dt = log.durations(self.steps)
        profiled, normal = dt[first:end], np.concatenate([dt[:first], dt[end:]])[-200:]
        extra = 0.0
        if len(profiled) and np.isfinite(normal).any():
            extra = max(float(np.nansum(profiled) - len(profiled) * np.nanmedian(normal)), 0.0)
        stop_s = time.perf_counter() - start
        self.monitor_s += extra
        self._spent["profile"] += stop_s + extra
        self._cost["profile"] = self._window_start_s + stop_s + extra
        return stop_s

    # -------------------------------------------------------------------------- data
    @property
    def steps(self) -> int:
        """Finished steps."""
        return len(self._log.start) - (1 if self._is_open() else 0)

    @property
    def profiles(self) -> list[dict[str, Any]]:
        """The kernel profiles: one ``{"step", "steps", "nodes"}`` per profile window."""
        return self._log.profiles

    @property
    def data(self) -> list[dict[str, Any]]:
        """One dict per finished step.

        Keys: ``step`` (from 1), ``time_s`` (since the monitor was made), ``step_s``,
        ``batch``, ``samples_per_s``, ``loss``, ``profiled`` (the profiler was on),
        values given to :meth:`log`, and every ``every`` steps ``rss_bytes``,
        ``saved_bytes`` (and ``cuda_*_bytes`` on a GPU).
        """
        return self._log.rows(self.steps)

    @property
    def overhead(self) -> dict[str, float]:
        """The monitor's seconds, the monitored training seconds, and their ratio."""
        train = self._train_s
        return {"monitor_s": self.monitor_s, "train_s": train, "fraction": self.monitor_s / train if train else 0.0}

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

        Example:
            >>> Monitor.load("run.json").figure()     # doctest: +SKIP
        """
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ConfigError(f"{os.fspath(path)!r} is not an ortlab monitor file; write one with Monitor.save(path).")
        mon = cls(None, every=int(doc.get("every", 10)), profile=False)
        mon._log = StepLog.from_document(doc)
        mon.monitor_s = float(doc.get("overhead", {}).get("monitor_s", 0.0))
        mon._train_s = float(doc.get("overhead", {}).get("train_s", 0.0))
        return mon

    # ----------------------------------------------------------------------- drawing
    def status(self) -> str:
        """One line: step, step time, samples/s, loss, the monitor's overhead."""
        return plots.status_line(self._log, self.steps, self.overhead["fraction"], self._profile)

    def figure(self) -> Any:
        """A plain plotly Figure of everything recorded (after training, or from a file).

        Example:
            >>> Monitor.load("run.json").figure().write_html("run.html")   # doctest: +SKIP
        """
        return plots.figure(self._series(), self.status())

    def kernel_table(self, top: int = 15, **kwargs: Any) -> Any:
        """The slowest kernels of the last profile window, each linked to its node in the
        module's own graphs, shown in netron under the table (see ``ortlab.ui.kernel_table``).

        Example:
            >>> mon.kernel_table(top=10)      # doctest: +SKIP
        """
        from ortlab.ui.kernel_table import kernel_table

        return kernel_table(self, top=top, **kwargs)

    def _series(self) -> dict[str, tuple]:
        return plots.series(self._log, self.steps, self.max_points, self.top, self.module_depth)

    def _redraw(self) -> None:
        """Push the current data to every view, each figure in one ``batch_update``."""
        self._drawn = self.steps
        s, status = self._series(), self.status()
        if self._figure_widget is not None:
            plots.update_traces(self._figure_widget, s, status)
            if self._status is not None:
                self._status.value = f"<code>{status}</code>"
        if self._handles:
            plots.update_traces(self._static_figure, s, status)
            shown = plots.bundle(self._static_figure, status)
            for handle in self._handles:
                handle.update(shown, raw=True)

    def refresh(self) -> None:
        """Redraw now, whatever the budget (after training, or on demand)."""
        if self._has_view():
            self._redraw()

    def _has_view(self) -> bool:
        return self._figure_widget is not None or bool(self._handles)

    # ----------------------------------------------------------------------- display
    def widget(self) -> Any:
        """The live view, an ipywidgets VBox (status line, FigureWidget), or None.

        None where plotly's FigureWidget cannot be built or does not render (no
        ipywidgets/anywidget, Colab, VS Code, ``mode="static"``): :meth:`show` then
        draws a plain figure and updates it in place.
        """
        if self._box is not None:
            return self._box
        if self.mode == "static" or (self.mode == "auto" and not plots.widgets_render_here()):
            return None
        try:
            import ipywidgets
            import plotly.graph_objects as go

            self._figure_widget = go.FigureWidget(self.figure())
            self._status = ipywidgets.HTML(value=f"<code>{self.status()}</code>")
            self._box = ipywidgets.VBox([self._status, self._figure_widget])
        except Exception as e:  # ImportError, or anywidget/ipywidgets failing to start
            logger.info("ortlab monitor: no FigureWidget (%s); drawing a plain figure updated in place", e)
            self._figure_widget = self._status = self._box = None
            return None
        self._time_redraw()
        return self._box

    def _time_redraw(self) -> None:
        """Redraw once to learn what a redraw costs in this front end (the budget's estimate)."""
        start = time.perf_counter()
        self._redraw()
        self._cost["redraw"] = time.perf_counter() - start

    def show(self) -> None:
        """Display the live view in the notebook (the widget, or a figure updated in place)."""
        from IPython.display import display

        box = self.widget()
        if box is not None:
            display(box)
        else:
            if self._static_figure is None:
                self._static_figure = self.figure()
            self._handles.append(display(plots.bundle(self._static_figure, self.status()), raw=True, display_id=True))
            self._time_redraw()
        shell = plots.in_kernel()
        if shell is not None:
            self._shown_in = shell.execution_count
            if self._cell_callback is None:
                self._cell_callback = self._after_cell
                shell.events.register("post_run_cell", self._cell_callback)

    def _after_cell(self, *args: Any) -> None:
        """When a cell ends, draw what the budget held back."""
        if self.steps != self._drawn:
            self.refresh()

    def _ipython_display_(self) -> None:
        shell = plots.in_kernel()
        if shell is not None and self._shown_in == shell.execution_count:
            return  # monitor() showed it in this cell already
        self.show()

    def _repr_html_(self) -> str:
        try:
            return self.figure().to_html(full_html=False, include_plotlyjs="cdn")
        except ImportError:
            return f"<pre>{self.status()}</pre>"

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
) -> Monitor:
    """Watch an ORTModule train: live loss, step time, samples/s, memory and kernel time.

    Each training-mode forward call of the module starts a step (calls under
    ``torch.no_grad()`` or in eval mode are not steps). A scalar output is taken as
    the loss; otherwise call ``mon.log(loss=loss)``. Every ``every`` steps, within
    the overhead ``budget``, the plots are redrawn; kernel times come from
    onnxruntime's profiler, switched on ``profile_steps`` steps at a time.

    Args:
        ortmodule: the ``ortlab.ORTModule`` being trained (a plain ``nn.Module``
            works too, as an eager baseline, without kernel profiles).
        every: steps between redraws and memory readings, at least.
        auto: watch the module's forward calls; ``False`` to end each step with
            ``mon.step(loss, batch_size=...)``.
        profile: sample onnxruntime's per-kernel profile in windows.
        profile_steps: steps per profile window (one more runs to warm it up).
        budget: the fraction of training time the monitor may spend (0.015 = 1.5%);
            ``None``: no limit, redraw and profile exactly every ``every`` steps.
        mode: ``"widget"`` (plotly FigureWidget), ``"static"`` (a plain figure
            re-drawn in place, for front ends without widgets) or ``"auto"``.
        show: display now; by default when running in a Jupyter kernel.
        max_points: points per line (longer runs are bucket-averaged).
        top: bars per kernel-time panel.
        module_depth: cut module paths to this many parts (``blocks.0``).

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
                  mode=mode, max_points=max_points, top=top, module_depth=module_depth).attach()
    if show or (show is None and plots.in_kernel() is not None):
        mon.show()
    return mon
