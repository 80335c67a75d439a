"""Profiling the onnxruntime sessions of an ORTModule: all at once, or in short windows.

:func:`collect_profile` ends the profiles of a module built with ``profile=True``;
:class:`ProfileWindow` profiles a running module for a few steps on twin sessions.
The records are :class:`~ortlab.inspect.profile.NodeTime`, parsed by
``ortlab.inspect.profile``.

Note [Sampling the profiler in windows]
onnxruntime's profiler cannot be paused: ``enable_profiling`` is fixed when a
session is created, events pile up in memory (about 9 KB a step for a tiny MLP)
until ``end_profiling()`` writes them all at once, and a session can never profile
again after that. Profiling every step costs 15-35% of a small model's step time
(measured: tiny MLP 0.43 -> 0.57 ms, MLP 784-256-256-10 1.22 -> 1.50 ms), far
above a live monitor's 5% budget. ``reconfigure(profile=True)`` would re-capture
(Dynamo, export and optimization again: seconds). So a :class:`ProfileWindow`
builds, for each session of the module, a *twin* session from the same model bytes
and settings with profiling switched on (1.5 ms for a tiny MLP, 19 ms
for a 2-layer GPT: the model is already optimized and weights are inputs, not
initializers), swaps it into the ``OrtRunner`` for a few steps, then swaps the
original back and ends the twin's profile. Outside the windows training runs on
the original, unprofiled sessions. The runtime provides both halves:
``ortlab.runtime.profiling.profiling_twin`` builds the twin through the session
builder from what the runner keeps (``runner.session_source.rebuild``), with a profile
file prefix of its own (see Note [Unique profile prefixes] in ``ortlab.runtime.session``),
and ``runner.swap_session`` swaps it in and out.
"""

from __future__ import annotations

import logging
import os
import tempfile
import weakref
from typing import Any

from ortlab.errors import OrtlabError, first_line
from ortlab.inspect.profile import NodeTime, count_runs, load_events, merge, parse_profile
from ortlab.provenance import node_provenance

__all__ = ["collect_profile", "ProfileWindow"]

logger = logging.getLogger(__name__)


def _graph_parts(ortmodule: Any) -> list[tuple[str, Any, Any]]:
    """(graph label, OrtRunner, ExportedGraph | None) of every onnxruntime part."""
    parts = []
    for capture in ortmodule.report.captures:
        for graph in capture.graphs:
            for part in graph.parts:
                parts.append((graph.label, part.runner, part.exported))
    return parts


def measuring_parts(ortmodule: Any) -> int:
    """How many onnxruntime parts are in the middle of their execution-provider race: their next calls
    run the race's sessions, so a profiling twin swapped in now would be swapped out unprofiled
    (``ortlab.runtime.race``); windows wait until they have decided."""
    from ortlab.runtime.race import under_way

    return sum(under_way(runner) for _, runner, _ in _graph_parts(ortmodule))


_PROVENANCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _provenance_of(runner: Any, exported: Any) -> dict[str, dict[str, str]]:
    """Provenance of a runner's model, computed once per runner.

    A part loaded from the on-disk cache has no ExportedGraph: read the model the
    session was built from (onnxruntime keeps node metadata in optimized models).
    """
    cached = _PROVENANCE.get(runner)
    if cached is not None:
        return cached
    if exported is not None:
        prov = node_provenance(exported.model)
    else:  # a part loaded from the on-disk cache carries the map stored with it
        prov = getattr(runner, "provenance", None) or {}
    try:
        _PROVENANCE[runner] = prov
    except TypeError:  # not weak-referenceable
        pass
    return prov


def collect_profile(ortmodule: Any, remove_files: bool = False, skip_runs: int = 0) -> list[NodeTime]:
    """End the profiles of every session of an ORTModule built with ``profile=True``.

    onnxruntime writes a profile only when it ends, and a session cannot profile
    again afterwards: call this once, after training (or use :class:`ProfileWindow`
    for repeated readings).

    Args:
        ortmodule: an ``ortlab.ORTModule`` created (or reconfigured) with ``profile=True``.
        remove_files: delete the JSON files after reading them.
        skip_runs: leave out each session's first ``skip_runs`` runs (the first step's
            run allocates memory and warms caches; see ``parse_profile``).

    Returns:
        Node records of all graphs, slowest first; empty when nothing was profiled.

    Example:
        >>> om = ORTModule(model, profile=True)           # doctest: +SKIP
        >>> ...train...                                   # doctest: +SKIP
        >>> by_op_type(collect_profile(om))[0]            # doctest: +SKIP
    """
    records: list[list[NodeTime]] = []
    for graph, runner, exported in _graph_parts(ortmodule):
        path = runner.session.end_profiling()
        if not path or not os.path.exists(path):
            continue
        try:
            records.append(parse_profile(path, graph=graph, provenance=_provenance_of(runner, exported),
                                         skip_runs=skip_runs))
        except (OSError, ValueError) as e:
            logger.warning("could not read the onnxruntime profile %s: %s", path, e)
            continue
        if remove_files:
            _remove(path)
    return merge(*records)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class ProfileWindow:
    """Profile an ORTModule's kernels for a few steps, then run unprofiled again.

    See Note [Sampling the profiler in windows]. ``start`` swaps a profiling twin
    into every onnxruntime part; ``stop`` swaps the originals back and returns the
    node records. Call both between steps (not while a forward or backward runs).

    Args:
        ortmodule: the ``ortlab.ORTModule`` to profile.
        folder: where onnxruntime writes the profile files (deleted after reading);
            the temp dir by default.
        skip_runs: runs of each twin left out of the records: a new session's
            first run allocates its memory and is slower than the steady state.

    Example:
        >>> window = ProfileWindow(om)                         # doctest: +SKIP
        >>> window.start()                                     # doctest: +SKIP
        >>> for _ in range(5): train_step()                    # doctest: +SKIP
        >>> records = window.stop()                            # doctest: +SKIP
        >>> [g.key for g in by_op_type(records)][:3]           # doctest: +SKIP
    """

    def __init__(self, ortmodule: Any, folder: str | None = None, skip_runs: int = 1) -> None:
        self.ortmodule = ortmodule
        self.folder = folder or tempfile.gettempdir()
        self.skip_runs = skip_runs
        self._active: list[tuple[str, Any, Any, Any, Any]] = []  # graph, runner, exported, original, twin
        self.runs: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return bool(self._active)

    def start(self) -> int:
        """Swap profiling twins in; returns how many sessions are profiled."""
        from ortlab.runtime.profiling import profiling_twin  # onnxruntime, only once a window opens

        if self._active:
            return len(self._active)
        from ortlab.runtime.race import under_way

        for graph, runner, exported in _graph_parts(self.ortmodule):
            if under_way(runner):  # the race's sessions run its next calls: a twin would be swapped out
                logger.warning("ortlab: not profiling a part of %s: it is still measuring its execution providers "
                               "(ortlab.runtime.race); open the window once it has decided", graph)
                continue
            try:
                twin = profiling_twin(runner, graph, self.folder)
                original = runner.swap_session(twin)
            except OrtlabError as e:  # no kernel panels for this session; training is unaffected
                logger.warning("ortlab: could not profile %s: %s", graph, first_line(e))
                continue
            self._active.append((graph, runner, exported, original, twin))
        return len(self._active)

    def stop(self) -> list[NodeTime]:
        """Swap the original sessions back; read, merge and delete the twins' profiles."""
        records: list[list[NodeTime]] = []
        self.runs = {}
        active, self._active = self._active, []
        for graph, runner, exported, original, twin in active:
            if runner.session is twin:
                runner.swap_session(original)
            path = twin.end_profiling()
            if not path or not os.path.exists(path):
                continue
            try:
                events = load_events(path)
                self.runs[graph] = self.runs.get(graph, 0) + max(count_runs(events) - self.skip_runs, 0)
                prov = _provenance_of(runner, exported)
                records.append(parse_profile(events, graph=graph, provenance=prov, skip_runs=self.skip_runs))
            except (OSError, ValueError) as e:
                logger.warning("could not read the onnxruntime profile %s: %s", path, e)
            finally:
                _remove(path)
        return merge(*records)
