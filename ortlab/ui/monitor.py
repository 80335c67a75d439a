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

Note [Watching the forward without hooks]
Each step costs the monitor a timestamp, two list appends, a counter check and
the loss read; the rest is computed when drawing. A forward pre-hook plus a
forward hook would take ``nn.Module._call_impl`` off its fast path: on a bare
module they cost 1.6 us a call, against 0.55 us for setting ``forward`` on the
instance; in a tiny MLP's training loop (0.43 ms a step), 2-5% against 1-2%
(paired A/B runs on the 2-core box, noise about 1%). So ``attach`` sets
``forward`` on the ORTModule instance and ``detach`` removes it. The patch is
bound to the module (``types.MethodType``): ``copy.deepcopy`` re-binds it to the
copy, which the patch recognizes and runs unwatched; pickling stores
``getattr(module, "forward")``, which loads as the plain method. Once detached
(or when another patch went on top of it) it only passes calls through.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ortlab.inspect.memory import sample_memory
from ortlab.inspect.profile import NodeTime, ProfileWindow, by_module, by_op_type, collect_profile, top_nodes

__all__ = ["Monitor", "monitor", "measure_overhead"]

logger = logging.getLogger(__name__)

_FORMAT = "ortlab.monitor"
_VERSION = 1
_MIB = float(2**20)
_SHARES = {"redraw": 1 / 3, "profile": 2 / 3}  # of the budget; see Monitor._allowed
_LINES = ("loss", "step_ms", "profiled_step_ms", "kernel_ms", "samples_per_s", "rss", "saved", "cuda_used",
          "cuda_allocated")
_BARS = ("top_ops", "op_types", "modules")
_MEMORY = {"rss": "rss_bytes", "saved": "saved_bytes", "cuda_used": "cuda_used_bytes",
           "cuda_allocated": "cuda_allocated_bytes"}


def _scalar(value: Any) -> Any:
    """A float now, or a detached CUDA tensor read at the next redraw (no sync per step)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"monitor values must be scalars, got a tensor of shape {tuple(value.shape)}.")
        return value.detach() if value.is_cuda else value.item()
    return None if value is None else float(value)


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    """Samples in a call: dim 0 of the first tensor argument."""
    if args and type(args[0]) is torch.Tensor and args[0].dim():
        return args[0].shape[0]
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return int(a.shape[0]) if a.dim() else None
    return None


def _downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
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


def _update_traces(fig: Any, series: dict[str, tuple], status: str) -> None:
    """Set every trace of a :meth:`Monitor.figure` layout to ``series``, in one batch."""
    with fig.batch_update():
        for trace, name in zip(fig.data, _LINES + _BARS):
            if name in _BARS:
                trace.y, trace.x, trace.hovertext = series[name]
            else:
                trace.x, trace.y = series[name]
                if name in _MEMORY:
                    trace.visible = bool(np.isfinite(series[name][1]).any())
        fig.layout.title.text = status


def _bundle(fig: Any, text: str) -> dict[str, Any]:
    """The mime bundle of a plotly figure for this front end.

    plotly picks the renderer (Colab needs HTML with plotly.js, JupyterLab and VS
    Code read plotly's JSON). Displaying the Figure itself would go through its
    ``_ipython_display_``, which ignores ``display_id``: every update would add a
    new output instead of replacing the old one.
    """
    bundle = dict(fig._repr_mimebundle_())
    if not bundle:  # no notebook renderer (plain Python, a terminal)
        bundle = {"text/html": fig.to_html(full_html=False, include_plotlyjs="cdn")}
    bundle["text/plain"] = text
    return bundle


def _in_kernel() -> Any:
    """The IPython shell when running in a Jupyter kernel, else None."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


def _widgets_render_here() -> bool:
    """False in front ends where plotly's FigureWidget does not render (Colab, VS Code)."""
    if "google.colab" in sys.modules or "COLAB_NOTEBOOK_ID" in os.environ:
        return False
    return "VSCODE_PID" not in os.environ


class Monitor:
    """Records a training run and draws it live; build it with :func:`monitor`.

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
            raise ValueError(f"every={every} must be a positive number of steps.")
        if mode not in ("auto", "widget", "static"):
            raise ValueError(f"mode={mode!r} is not valid; choose 'auto', 'widget' or 'static'.")
        if budget is not None and not 0 < budget < 1:
            raise ValueError(f"budget={budget} must be a fraction between 0 and 1 (e.g. 0.015), or None for no limit.")
        self.ortmodule, self.every, self.auto, self.budget, self.mode = ortmodule, every, auto, budget, mode
        self.profile_steps, self.max_points, self.top, self.module_depth = profile_steps, max_points, top, module_depth
        # Steps: start times (perf_counter), batch sizes; sparse columns keyed by step index.
        # A step ends where the next starts, unless ``_end`` says otherwise (monitor work, detach).
        self._start: list[float] = []
        self._batch: list[int | None] = []
        self._end: dict[int, float] = {}
        self._loss: dict[int, Any] = {}
        self._extra: dict[str, dict[int, Any]] = {}
        self._memory: list[dict[str, Any]] = []
        self._windows: list[tuple[int, int]] = []  # profiled steps [first, end)
        self.profiles: list[dict[str, Any]] = []
        self._pending: dict[str, Any] = {}
        self._attach_len = 0  # steps started before the last attach
        self._t0 = time.perf_counter()
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
        self._previous_forward: Any = None
        self._forward: Any = None

    # --------------------------------------------------------------------- attaching
    def attach(self) -> Monitor:
        """Start watching: each training-mode forward call of the module starts a step.

        See Note [Watching the forward without hooks].
        """
        if self.ortmodule is None:
            raise RuntimeError("this Monitor was loaded from a file; it has no module to watch.")
        if self._attached:
            return self
        self._attached, self._mark = True, None
        self._attach_len = len(self._start)
        self._next_check = len(self._start) + 1  # the first check only starts the clock
        if not self.auto:
            self._open_step(time.perf_counter(), None)
            return self
        module, mon = self.ortmodule, self
        previous = module.__dict__.get("forward")
        inner = previous if previous is not None else types.MethodType(type(module).forward, module)
        starts, batches, perf = self._start, self._batch, time.perf_counter

        def forward(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if self_ is not module:  # a deep copy of the module: not watched
                return type(self_).forward(self_, *args, **kwargs)
            if (
                not mon._attached
                or not self_.training
                or not torch.is_grad_enabled()
                or torch.compiler.is_compiling()
            ):
                return inner(*args, **kwargs)
            now = perf()
            if len(starts) >= mon._next_check:
                now = mon._check(now)
            starts.append(now)
            batches.append(_batch_size(args, kwargs))
            out = inner(*args, **kwargs)
            if type(out) is torch.Tensor and out.dim() == 0 and out.is_floating_point():
                mon._loss.setdefault(len(starts) - 1, _scalar(out))
            return out

        forward.__name__ = "forward"  # pickling stores getattr(module, "forward")
        self._previous_forward = previous
        self._forward = types.MethodType(forward, module)
        object.__setattr__(module, "forward", self._forward)
        return self

    def detach(self) -> None:
        """Stop watching; the recorded steps stay, the step in progress is dropped."""
        if not self._attached:
            return
        module = self.ortmodule
        if self.auto:
            current = module.__dict__.get("forward")
            if current is not self._forward:
                # Another patch went on top of ours: leave it; ours passes calls through now.
                logger.info("ortlab monitor: the module's forward was patched after attach(); leaving it in place")
            elif self._previous_forward is not None:
                object.__setattr__(module, "forward", self._previous_forward)
            else:
                object.__delattr__(module, "forward")
            self._forward = None
        if self._is_open():
            last = len(self._start) - 1
            if last > 0:
                self._end.setdefault(last - 1, self._start[last])
            for column in (self._start, self._batch):
                del column[last:]
            self._loss.pop(last, None)
            for column in self._extra.values():
                column.pop(last, None)
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
            self._end[len(self._start) - 1] = time.perf_counter()
        self.detach()
        if self._collect_at_close and self.ortmodule is not None:
            nodes = collect_profile(self.ortmodule, remove_files=True)
            if nodes:
                self.profiles.append({"step": 1, "steps": max(self.steps, 1), "nodes": nodes})
        self.refresh()
        shell = _in_kernel()
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
            self._batch[-1] = int(batch_size)
        if not self.auto and self._attached:
            now = time.perf_counter()
            if len(self._start) >= self._next_check:
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
        index = len(self._start) - 1
        for key, value in values.items():
            column = self._loss if key == "loss" else self._extra.setdefault(key, {})
            column[index] = _scalar(value)

    def _open_step(self, now: float, batch: int | None) -> None:
        self._start.append(now)
        self._batch.append(batch)

    def _is_open(self) -> bool:
        """Whether the last recorded step is still running."""
        n = len(self._start)
        return self._attached and n > self._attach_len and (n - 1) not in self._end

    def profile_now(self) -> None:
        """Profile the kernels for ``profile_steps`` steps from the next step, whatever the budget.

        Example:
            >>> mon.profile_now()      # the kernel panels fill a few steps later  # doctest: +SKIP
        """
        if not self._profile:
            raise RuntimeError(
                "this monitor does not profile: it was made with profile=False, loaded from a file, "
                "or the module profiles every step already (profile=True; read at close())."
            )
        self._force_profile = True
        self._next_check = min(self._next_check, len(self._start))

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
        n = len(self._start)  # steps started; step n - 1 ends now
        if self._mark is None:  # first boundary since attach: start the clock
            self._mark, self._mark_n, self._next_check = now, n, n + self.every
            self._last = {k: n for k in self._last}
            return now
        self._train_s += now - self._mark
        self._train_steps += n - self._mark_n
        self._end[n - 1] = now
        profiling = 0.0  # seconds of this check spent on profile windows
        window = self._window
        if window is not None and window.active and n >= self._windows[-1][1]:
            profiling += self._stop_window()
        if n - self._last["memory"] >= self.every and self._allowed("memory", "redraw"):
            start = time.perf_counter()
            reading = sample_memory(self.ortmodule).to_dict()
            reading["step"] = n
            self._memory.append(reading)
            self._last["memory"] = n
            self._cost["memory"] = time.perf_counter() - start
        if not self.profiles and self._train_steps:
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
            self._next_check = min(self._next_check, self._windows[-1][1])
        return after

    def _start_window(self, n: int) -> float:
        """Swap profiling sessions in for the next steps; returns the seconds it took."""
        start = time.perf_counter()
        if self._window is None:
            self._window = ProfileWindow(self.ortmodule, skip_runs=1)
        if self._window.start() == 0:
            self._profile = False  # nothing runs in onnxruntime
        else:
            self._windows.append((n, n + self.profile_steps + 1))  # the first step warms the sessions up
        self._window_start_s = time.perf_counter() - start
        self._spent["profile"] += self._window_start_s
        return self._window_start_s

    def _stop_window(self) -> float:
        """Swap the original sessions back and keep the profile; returns the seconds it took.

        The profiled steps' extra time over the median step counts as monitor time too.
        """
        start = time.perf_counter()
        nodes = self._window.stop() if self._window is not None else []
        first, end = self._windows[-1]
        end = min(end, len(self._start))
        self._windows[-1] = (first, end)
        self._last["window"] = end
        if nodes and end - first > 1:
            self.profiles.append({"step": first + 2, "steps": end - first - 1, "nodes": nodes})
        dt = self._durations()
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
        return len(self._start) - (1 if self._is_open() else 0)

    def _durations(self) -> np.ndarray:
        """Seconds of each finished step."""
        n = self.steps
        starts = np.asarray(self._start, dtype=float)
        ends = np.full(n, np.nan)
        ends[: min(n, len(starts) - 1)] = starts[1 : n + 1]
        explicit = self._column(self._end, n)
        ends = np.where(np.isnan(explicit), ends, explicit)
        return ends - starts[:n]

    def _materialize(self) -> None:
        """Read CUDA scalars recorded since the last redraw (one synchronization)."""
        for column in (self._loss, *self._extra.values()):
            pending = [i for i, v in column.items() if isinstance(v, torch.Tensor)]
            if pending:
                for i, v in zip(pending, torch.stack([column[i].float() for i in pending]).tolist()):
                    column[i] = v

    @staticmethod
    def _column(values: dict[int, Any], n: int) -> np.ndarray:
        """A sparse column as an array of ``n`` floats (NaN where nothing was recorded)."""
        out = np.full(n, np.nan)
        if values:
            index = np.fromiter(values.keys(), dtype=np.int64, count=len(values))
            data = np.fromiter((np.nan if v is None else v for v in values.values()), dtype=float, count=len(values))
            keep = index < n
            out[index[keep]] = data[keep]
        return out

    def _profiled_mask(self, n: int) -> np.ndarray:
        mask = np.zeros(n, dtype=bool)
        for first, end in self._windows:
            mask[first:end] = True
        return mask

    @property
    def data(self) -> list[dict[str, Any]]:
        """One dict per finished step.

        Keys: ``step`` (from 1), ``time_s`` (since the monitor was made), ``step_s``,
        ``batch``, ``samples_per_s``, ``loss``, ``profiled`` (the profiler was on),
        values given to :meth:`log`, and every ``every`` steps ``rss_bytes``,
        ``saved_bytes`` (and ``cuda_*_bytes`` on a GPU).
        """
        self._materialize()
        dt, n = self._durations(), self.steps
        profiled = self._profiled_mask(n)
        memory = {m["step"] - 1: m for m in self._memory}
        rows = []
        for i in range(n):
            batch, step_s = self._batch[i], float(dt[i])
            row = {
                "step": i + 1,
                "time_s": self._start[i] - self._t0,
                "step_s": step_s,
                "batch": batch,
                "samples_per_s": batch / step_s if batch and step_s > 0 else None,
                "loss": self._loss.get(i),
                "profiled": bool(profiled[i]),
            }
            row.update({k: c[i] for k, c in self._extra.items() if i in c})
            if i in memory:
                row.update({k: v for k, v in memory[i].items() if k != "step"})
            rows.append(row)
        return rows

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

        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        doc = {
            "format": _FORMAT,
            "version": _VERSION,
            "every": self.every,
            "overhead": self.overhead,
            "steps": [{k: clean(v) for k, v in row.items()} for row in self.data],
            "profiles": [{**p, "nodes": [n.to_dict() for n in p["nodes"]]} for p in self.profiles],
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        return os.fspath(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Monitor:
        """A Monitor holding a file written by :meth:`save` (nothing attached).

        Example:
            >>> Monitor.load("run.json").figure()     # doctest: +SKIP
        """
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError(f"{os.fspath(path)!r} is not an ortlab monitor file; write one with Monitor.save(path).")
        mon = cls(None, every=int(doc.get("every", 10)), profile=False)
        mon._t0 = 0.0
        known = {"step", "time_s", "step_s", "batch", "samples_per_s", "loss", "profiled"}
        first = None
        for i, row in enumerate(doc["steps"]):
            mon._start.append(float(row.get("time_s") or 0.0))
            if row.get("step_s") is not None:
                mon._end[i] = mon._start[i] + float(row["step_s"])
            mon._batch.append(row.get("batch"))
            if row.get("loss") is not None:
                mon._loss[i] = row["loss"]
            if row.get("profiled") and first is None:
                first = i
            if not row.get("profiled") and first is not None:
                mon._windows.append((first, i))
                first = None
            if "rss_bytes" in row:
                mon._memory.append({"step": i + 1, **{k: v for k, v in row.items() if k.endswith("_bytes")}})
            for key, value in row.items():
                if key not in known and not key.endswith("_bytes"):
                    mon._extra.setdefault(key, {})[i] = value
        if first is not None:
            mon._windows.append((first, len(mon._start)))
        mon.profiles = [{**p, "nodes": [NodeTime.from_dict(n) for n in p["nodes"]]} for p in doc.get("profiles", [])]
        mon.monitor_s = float(doc.get("overhead", {}).get("monitor_s", 0.0))
        mon._train_s = float(doc.get("overhead", {}).get("train_s", 0.0))
        return mon

    # ----------------------------------------------------------------------- drawing
    def _series(self) -> dict[str, tuple]:
        """x/y of every line and labels/values/hover of every bar chart, downsampled."""
        self._materialize()
        n, mp = self.steps, self.max_points
        steps = np.arange(1, n + 1, dtype=float)
        dt = self._durations()
        profiled = self._profiled_mask(n)
        loss = self._column(self._loss, n)
        batch = np.asarray(self._batch[:n], dtype=float)
        with np.errstate(invalid="ignore", divide="ignore"):
            sps = np.where(profiled, np.nan, batch / dt)
        out: dict[str, tuple] = {
            "loss": _downsample(steps, loss, mp),
            "step_ms": _downsample(steps, np.where(profiled, np.nan, dt * 1e3), mp),
            "profiled_step_ms": (steps[profiled][-mp:], (dt[profiled] * 1e3)[-mp:]),
            "samples_per_s": _downsample(steps, sps, mp),
            "kernel_ms": (
                np.asarray([p["step"] for p in self.profiles], dtype=float),
                np.asarray([sum(r.dur_us for r in p["nodes"]) / p["steps"] / 1e3 for p in self.profiles], dtype=float),
            ),
        }
        mem_steps = np.asarray([m["step"] for m in self._memory], dtype=float)
        for name, key in _MEMORY.items():
            out[name] = _downsample(mem_steps, np.asarray([m.get(key) for m in self._memory], dtype=float) / _MIB, mp)
        nodes, per = (self.profiles[-1]["nodes"], self.profiles[-1]["steps"]) if self.profiles else ([], 1)
        top = top_nodes(nodes, self.top)
        out["top_ops"] = ([r.label for r in top], np.asarray([r.dur_us / per for r in top], dtype=float),
                          [f"{r.op or '?'} {r.fx_node}<br>{r.source}" for r in top])
        for name, groups in (("op_types", by_op_type(nodes)), ("modules", by_module(nodes, self.module_depth))):
            groups = groups[: self.top]
            out[name] = ([g.key for g in groups], np.asarray([g.dur_us / per for g in groups], dtype=float),
                         [f"{g.share:.1%} of kernel time, {g.count / per:.0f} kernel runs/step" for g in groups])
        return out

    def status(self) -> str:
        """One line: step, step time, samples/s, loss, the monitor's overhead."""
        n = self.steps
        if n == 0:
            return "ortlab monitor: waiting for the first step"
        self._materialize()
        dt = self._durations()[-50:]
        plain = dt[~self._profiled_mask(n)[-50:]]
        step_s = float(np.nanmedian(plain if len(plain) else dt)) if np.isfinite(dt).any() else float("nan")
        parts = [f"step {n}", f"{step_s * 1e3:.2f} ms/step"]
        batches = [b for b in self._batch[max(0, n - 50) : n] if b]
        if batches and step_s > 0 and math.isfinite(step_s):
            parts.append(f"{np.mean(batches) / step_s:,.0f} samples/s")
        loss = next((self._loss[i] for i in reversed(self._loss) if i < n and self._loss[i] is not None), None)
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        parts.append(f"monitor {self.overhead['fraction']:.1%} of training time")
        if self.profiles:
            parts.append(f"kernels profiled at step {self.profiles[-1]['step']}")
        elif self._profile:
            parts.append("kernels: first profile when the budget allows (mon.profile_now() to force)")
        return " | ".join(parts)

    def figure(self) -> Any:
        """A plain plotly Figure of everything recorded (after training, or from a file).

        Example:
            >>> Monitor.load("run.json").figure().write_html("run.html")   # doctest: +SKIP
        """
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        fig = make_subplots(
            rows=4, cols=2, specs=[[{}, {}], [{}, {}], [{"colspan": 2}, None], [{}, {}]],
            subplot_titles=("loss", "step time (ms)", "samples / s", "memory (MiB)",
                            "slowest onnxruntime kernels (us / step)", "kernel time by op type (us / step)",
                            "kernel time by module (us / step)"),
            vertical_spacing=0.08, horizontal_spacing=0.22,
        )
        s = self._series()
        cells = {"loss": (1, 1), "step_ms": (1, 2), "profiled_step_ms": (1, 2), "kernel_ms": (1, 2),
                 "samples_per_s": (2, 1), "top_ops": (3, 1), "op_types": (4, 1), "modules": (4, 2)}
        names = {"loss": "loss", "step_ms": "step", "profiled_step_ms": "profiled step",
                 "kernel_ms": "onnxruntime kernels / step", "samples_per_s": "samples/s", "rss": "process RSS",
                 "saved": "saved activations", "cuda_used": "CUDA used (device)",
                 "cuda_allocated": "CUDA allocated (torch)"}
        for name in _LINES:
            x, y = s[name]
            style: dict[str, Any] = {"mode": "lines"}
            if name == "profiled_step_ms":
                style = {"mode": "markers", "marker": {"size": 4}}
            elif name == "kernel_ms":
                style = {"mode": "markers", "marker": {"symbol": "diamond", "size": 8}}
            elif name in _MEMORY:
                style["visible"] = bool(np.isfinite(y).any())
            row, col = cells.get(name, (2, 2))
            fig.add_trace(go.Scatter(x=x, y=y, name=names[name], **style), row=row, col=col)
        for name in _BARS:
            labels, values, hover = s[name]
            row, col = cells[name]
            fig.add_trace(go.Bar(y=labels, x=values, orientation="h", hovertext=hover, showlegend=False),
                          row=row, col=col)
            fig.update_yaxes(autorange="reversed", row=row, col=col)
        for row, col in ((1, 1), (1, 2), (2, 1), (2, 2)):
            fig.update_xaxes(title_text="step", row=row, col=col)
        fig.update_layout(height=1100, title_text=self.status(), legend={"orientation": "h", "y": -0.04})
        return fig

    def _redraw(self) -> None:
        """Push the current data to every view, each figure in one ``batch_update``."""
        self._drawn = self.steps
        s, status = self._series(), self.status()
        if self._figure_widget is not None:
            _update_traces(self._figure_widget, s, status)
            if self._status is not None:
                self._status.value = f"<code>{status}</code>"
        if self._handles:
            _update_traces(self._static_figure, s, status)
            bundle = _bundle(self._static_figure, status)
            for handle in self._handles:
                handle.update(bundle, raw=True)

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
        if self.mode == "static" or (self.mode == "auto" and not _widgets_render_here()):
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
            self._handles.append(display(_bundle(self._static_figure, self.status()), raw=True, display_id=True))
            self._time_redraw()
        shell = _in_kernel()
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
        shell = _in_kernel()
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
    if show or (show is None and _in_kernel() is not None):
        mon.show()
    return mon


def measure_overhead(
    make_model: Callable[[], torch.nn.Module] | None = None,
    batch: int = 64,
    steps: int = 200,
    rounds: int = 15,
    threads: int | None = 1,
    **monitor_options: Any,
) -> dict[str, Any]:
    """Time a training loop with and without a monitor (widget view, profiling on).

    One ORTModule trains in pairs of blocks of ``steps`` steps, one watched and one
    not, in random order, so capture, caches and machine noise hit both sides
    alike. The overhead is the median over pairs of (watched / plain time) - 1.

    Args:
        make_model: builds an MLP-like module taking ``(batch, in_features)``
            (default ``ortlab.models.TinyMLP``, the worst case: the shorter the
            step, the larger the monitor's share).
        batch: rows per step.
        steps: steps per block.
        rounds: pairs of blocks.
        threads: PyTorch threads while measuring (restored after); one keeps a
            tiny model's timings steady on a busy machine, ``None`` leaves it.
        **monitor_options: passed to :func:`monitor`.

    Returns:
        ``plain_ms``/``monitored_ms`` (median step times), ``overhead`` (median
        paired slowdown), ``monitor_fraction`` (the monitor's own accounting of
        its work), ``profiles``, ``redraws``-worth ``redraw_ms`` and ``steps``.

    Example:
        >>> measure_overhead(steps=200)["overhead"] < 0.05     # doctest: +SKIP
        True
    """
    import ortlab
    from ortlab.models import TinyMLP

    model = (make_model or TinyMLP)()
    om = ortlab.ORTModule(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, linears[0].in_features, generator=gen)
    y = torch.randint(0, linears[-1].out_features, (batch,), generator=gen)
    opt = torch.optim.SGD(om.parameters(), lr=0.01)

    def block(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            loss = torch.nn.functional.cross_entropy(om(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / n

    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _measure(om, block, steps, rounds, monitor_options)
    finally:
        torch.set_num_threads(saved_threads)


def _measure(om: Any, block: Callable[[int], float], steps: int, rounds: int, options: dict) -> dict[str, Any]:
    import random

    block(50)  # capture and warm up
    mon = monitor(om, **{"show": False, **options})
    mon.widget()  # redraw a real FigureWidget (no front end attached)
    mon.detach()
    order = random.Random(0)
    plain, watched, ratios = [], [], []
    for _ in range(rounds):
        first_watched = order.random() < 0.5
        times = {}
        for watch in (first_watched, not first_watched):
            if watch:
                mon.attach()
            times[watch] = block(steps)
            if watch:
                mon.detach()
        plain.append(times[False])
        watched.append(times[True])
        ratios.append(times[True] / times[False])
    mon.close()
    return {
        "plain_ms": float(np.median(plain)) * 1e3,
        "monitored_ms": float(np.median(watched)) * 1e3,
        "overhead": float(np.median(ratios)) - 1.0,
        "monitor_fraction": mon.overhead["fraction"],
        "profiles": len(mon.profiles),
        "redraw_ms": mon._cost["redraw"] * 1e3,
        "steps": mon.steps,
    }
