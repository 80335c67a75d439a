"""What the training monitor records: a :class:`StepLog` of columns, and its JSON file.

The columns are plain lists, and dicts keyed by step index, appended to on the training
loop's hot path (see Note [Watching the forward] in ``ortlab.ui._monitor_watch``);
durations, rows and plots are computed from them when drawing or saving. Nothing here
draws: ``_monitor_figure`` turns a log into plots.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from ortlab.errors import ConfigError
from ortlab.inspect.profile import NodeTime

__all__ = ["FORMAT", "VERSION", "StepLog", "column", "samples_in", "scalar"]

FORMAT = "ortlab.monitor"
VERSION = 1
_ROW_KEYS = {"step", "time_s", "step_s", "batch", "samples_per_s", "loss", "profiled"}


def scalar(value: Any) -> Any:
    """A float now, or a detached CUDA tensor read at the next redraw (no sync per step)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"monitor values must be scalars, got a tensor of shape {tuple(value.shape)}.")
        return value.detach() if value.is_cuda else value.item()
    return None if value is None else float(value)


def samples_in(args: tuple, kwargs: dict) -> int | None:
    """Samples in a call: dim 0 of the first tensor argument."""
    if args and type(args[0]) is torch.Tensor and args[0].dim():
        return args[0].shape[0]
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return int(a.shape[0]) if a.dim() else None
    return None


def column(values: dict[int, Any], n: int) -> np.ndarray:
    """A sparse column as an array of ``n`` floats (NaN where nothing was recorded)."""
    out = np.full(n, np.nan)
    if values:
        index = np.fromiter(values.keys(), dtype=np.int64, count=len(values))
        data = np.fromiter((np.nan if v is None else v for v in values.values()), dtype=float, count=len(values))
        keep = index < n
        out[index[keep]] = data[keep]
    return out


class StepLog:
    """The recorded columns of one monitored run.

    Attributes:
        start: when each step started (``time.perf_counter``).
        batch: samples of each step (``None`` when unknown).
        end: step index -> when it ended, where that is not when the next step
            started (the monitor worked at the boundary, or watching stopped).
        loss: step index -> loss: a float, or a CUDA tensor until :meth:`materialize`.
        extra: metric name -> step index -> value (what ``Monitor.log`` got).
        memory: memory readings, each with its ``step`` (from 1).
        windows: profiled steps, ``[first, end)``.
        profiles: one entry per profile window: ``{"step", "steps", "nodes"}``,
            ``nodes`` a list of :class:`~ortlab.inspect.profile.NodeTime`.
        t0: when the log was made; a row's ``time_s`` counts from it.
    """

    def __init__(self) -> None:
        self.start: list[float] = []
        self.batch: list[int | None] = []
        self.end: dict[int, float] = {}
        self.loss: dict[int, Any] = {}
        self.extra: dict[str, dict[int, Any]] = {}
        self.memory: list[dict[str, Any]] = []
        self.windows: list[tuple[int, int]] = []
        self.profiles: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()

    def drop_last(self) -> None:
        """Forget the last step (it never finished); the step before ends where it started."""
        last = len(self.start) - 1
        if last > 0:
            self.end.setdefault(last - 1, self.start[last])
        del self.start[last:], self.batch[last:]
        for values in (self.loss, *self.extra.values()):
            values.pop(last, None)

    def durations(self, n: int) -> np.ndarray:
        """Seconds of each of the first ``n`` steps (NaN where the end is not known)."""
        starts = np.asarray(self.start, dtype=float)
        ends = np.full(n, np.nan)
        ends[: min(n, len(starts) - 1)] = starts[1 : n + 1]
        explicit = column(self.end, n)
        ends = np.where(np.isnan(explicit), ends, explicit)
        return ends - starts[:n]

    def materialize(self) -> None:
        """Read CUDA scalars recorded since the last call (one synchronization)."""
        for values in (self.loss, *self.extra.values()):
            pending = [i for i, v in values.items() if isinstance(v, torch.Tensor)]
            if pending:
                for i, v in zip(pending, torch.stack([values[i].float() for i in pending]).tolist()):
                    values[i] = v

    def profiled_mask(self, n: int) -> np.ndarray:
        """Which of the first ``n`` steps ran with the profiler on."""
        mask = np.zeros(n, dtype=bool)
        for first, end in self.windows:
            mask[first:end] = True
        return mask

    def rows(self, n: int) -> list[dict[str, Any]]:
        """One dict per step of the first ``n`` (see ``Monitor.data`` for the keys)."""
        self.materialize()
        dt = self.durations(n)
        profiled = self.profiled_mask(n)
        memory = {m["step"] - 1: m for m in self.memory}
        rows = []
        for i in range(n):
            batch, step_s = self.batch[i], float(dt[i])
            row = {
                "step": i + 1,
                "time_s": self.start[i] - self.t0,
                "step_s": step_s,
                "batch": batch,
                "samples_per_s": batch / step_s if batch and step_s > 0 else None,
                "loss": self.loss.get(i),
                "profiled": bool(profiled[i]),
            }
            row.update({k: c[i] for k, c in self.extra.items() if i in c})
            if i in memory:
                row.update({k: v for k, v in memory[i].items() if k != "step"})
            rows.append(row)
        return rows

    # ------------------------------------------------------------------------- the file
    def to_document(self, n: int, every: int, overhead: dict[str, float]) -> dict[str, Any]:
        """The JSON document of the first ``n`` steps (what ``Monitor.save`` writes)."""

        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return {
            "format": FORMAT,
            "version": VERSION,
            "every": every,
            "overhead": overhead,
            "steps": [{k: clean(v) for k, v in row.items()} for row in self.rows(n)],
            "profiles": [{**p, "nodes": [node.to_dict() for node in p["nodes"]]} for p in self.profiles],
        }

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> StepLog:
        """The log a document of :meth:`to_document` holds (times count from 0)."""
        log = cls()
        log.t0 = 0.0
        first = None
        for i, row in enumerate(doc["steps"]):
            log.start.append(float(row.get("time_s") or 0.0))
            if row.get("step_s") is not None:
                log.end[i] = log.start[i] + float(row["step_s"])
            log.batch.append(row.get("batch"))
            if row.get("loss") is not None:
                log.loss[i] = row["loss"]
            if row.get("profiled") and first is None:
                first = i
            if not row.get("profiled") and first is not None:
                log.windows.append((first, i))
                first = None
            if "rss_bytes" in row:
                log.memory.append({"step": i + 1, **{k: v for k, v in row.items() if k.endswith("_bytes")}})
            for key, value in row.items():
                if key not in _ROW_KEYS and not key.endswith("_bytes"):
                    log.extra.setdefault(key, {})[i] = value
        if first is not None:
            log.windows.append((first, len(log.start)))
        log.profiles = [{**p, "nodes": [NodeTime.from_dict(node) for node in p["nodes"]]} for p in doc.get("profiles", [])]
        return log
