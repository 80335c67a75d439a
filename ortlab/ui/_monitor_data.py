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

# What a monitor file may hold at most: a file from elsewhere must not make Monitor.load
# allocate, or loop, without bound (rows are built per step and per recorded name).
MAX_FILE_BYTES = 1 << 30
MAX_STEPS = 10_000_000
MAX_NAMES = 1_000  # distinct names of logged values and memory readings
MAX_PROFILES = 10_000
MAX_NODES = 100_000  # kernel records per profile
_NODE_TEXT = ("graph", "fx_node", "module", "op", "source", "provider")
_FIX = "The file was not written by Monitor.save, or was changed since; write it again with mon.save(path)."


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
    def from_document(cls, doc: dict[str, Any], where: str = "monitor file") -> StepLog:
        """The log a document of :meth:`to_document` holds (times count from 0).

        Raises:
            ConfigError: the document is not one :meth:`to_document` writes (see :func:`check_document`).
        """
        check_document(doc, where)
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
        log.profiles = [{**p, "nodes": [NodeTime.from_dict(node) for node in p["nodes"]]}
                        for p in doc.get("profiles", [])]
        return log


# ------------------------------------------------------------------------- checking a file
def _bad(where: str, expected: str, value: Any) -> ConfigError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ConfigError(f"{where}: expected {expected}, found {shown}. {_FIX}")


def _number(value: Any, where: str, minimum: float | None = None) -> None:
    """A finite number (not a bool) at least ``minimum``, or null."""
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (minimum is not None and value < minimum)):
        raise _bad(where, "a finite number" + (f" >= {minimum:g}" if minimum is not None else "") + " or null", value)


def _whole(value: Any, where: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(where, f"a whole number >= {minimum}", value)


def _list(value: Any, where: str, limit: int) -> list:
    if not isinstance(value, list):
        raise _bad(where, "a list", value)
    if len(value) > limit:
        raise ConfigError(f"{where}: {len(value)} entries, more than a monitor file holds ({limit}). {_FIX}")
    return value


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(where, "an object (a JSON {...})", value)
    return value


def _check_row(row: Any, where: str, names: set[str]) -> None:
    _object(row, where)
    for key, value in row.items():
        at = f"{where}.{key}"
        if key == "profiled":
            if not isinstance(value, bool):
                raise _bad(at, "true or false", value)
        elif key == "step":
            _whole(value, at, 1)
        elif key == "batch":
            if value is not None:
                _whole(value, at, 0)
        else:
            _number(value, at)
            if key not in _ROW_KEYS:
                names.add(key)
                if len(names) > MAX_NAMES:
                    raise ConfigError(f"{where}: more than {MAX_NAMES} names of logged values and memory "
                                      f"readings. {_FIX}")


def _check_node(node: Any, where: str) -> None:
    _object(node, where)
    for key in ("node", "op_type"):
        if not isinstance(node.get(key), str):
            raise _bad(f"{where}.{key}", "a string", node.get(key))
    if node.get("dur_us") is None:
        raise _bad(f"{where}.dur_us", "a finite number >= 0", None)
    _number(node["dur_us"], f"{where}.dur_us", 0)
    _whole(node.get("count"), f"{where}.count", 0)
    for key in _NODE_TEXT:
        if key in node and not isinstance(node[key], str):
            raise _bad(f"{where}.{key}", "a string", node[key])


def check_document(doc: Any, where: str = "monitor file") -> None:
    """Raise a ConfigError naming the entry unless ``doc`` is a monitor document as
    :meth:`StepLog.to_document` writes it: every value of its type, numbers finite or
    null, and within the ``MAX_*`` limits above.

    Example:
        >>> check_document({"format": "ortlab.monitor", "version": 1, "steps": [{"loss": 0.5}]})
    """
    _object(doc, where)
    if doc.get("format") != FORMAT:
        raise ConfigError(f"{where} is not an ortlab monitor file; write one with Monitor.save(path).")
    version = doc.get("version", VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version > VERSION:
        raise ConfigError(f"{where} is a monitor file of version {version!r}; this ortlab reads version "
                          f"<= {VERSION}: upgrade ortlab to read it.")
    if "every" in doc:
        _whole(doc["every"], f"{where}: every", 1)
    for key, value in _object(doc.get("overhead", {}), f"{where}: overhead").items():
        _number(value, f"{where}: overhead.{key}", 0)
    names: set[str] = set()
    for i, row in enumerate(_list(doc.get("steps"), f"{where}: steps", MAX_STEPS)):
        _check_row(row, f"{where}: steps[{i}]", names)
    for i, profile in enumerate(_list(doc.get("profiles", []), f"{where}: profiles", MAX_PROFILES)):
        at = f"{where}: profiles[{i}]"
        _object(profile, at)
        _whole(profile.get("step"), f"{at}.step", 0)
        _whole(profile.get("steps"), f"{at}.steps", 1)
        for j, node in enumerate(_list(profile.get("nodes"), f"{at}.nodes", MAX_NODES)):
            _check_node(node, f"{at}.nodes[{j}]")
