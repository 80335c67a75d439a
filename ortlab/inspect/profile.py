"""Per-kernel time from onnxruntime's profiler, mapped back to the model's code.

onnxruntime's profiler writes a Chrome-trace JSON file: one ``cat == "Node"`` event
per kernel run, named ``<onnx node>_kernel_time`` with ``args.op_name`` (the kernel's
op type after onnxruntime's fusions) and ``dur`` in microseconds. Every ONNX node
ortlab exports carries ``ortlab.fx_node``, ``ortlab.module``, ``ortlab.op`` and
``ortlab.source`` metadata, so a kernel leads back to the nn.Module and the line that
made it. onnxruntime renames the nodes it fuses (``node_addmm/GemmTransposeFusion/``,
``fused node_addmm/...``): ``ortlab.provenance.onnx_node_of`` reads the ONNX node that
survived the fusion back out of such a name.

Note [Sampling the profiler in windows]
onnxruntime's profiler cannot be paused: ``enable_profiling`` is fixed when a
session is created, events pile up in memory (about 9 KB a step for a tiny MLP)
until ``end_profiling()`` writes them all at once, and a session can never profile
again after that. Profiling every step costs 15-35% of a small model's step time
(measured: tiny MLP 0.43 -> 0.57 ms, MLP 784-256-256-10 1.22 -> 1.50 ms), far
above a live monitor's 5% budget. ``reconfigure(profile=True)`` would re-capture
(Dynamo, export and optimization again: seconds). So a :class:`ProfileWindow`
builds, for each session of the module, a *twin* session from the same model bytes
and the same SessionOptions with profiling switched on (1.5 ms for a tiny MLP, 19 ms
for a 2-layer GPT: the model is already optimized and weights are inputs, not
initializers), swaps it into the ``OrtRunner`` for a few steps, then swaps the
original back and ends the twin's profile. Outside the windows training runs on
the original, unprofiled sessions. The runtime provides both halves:
``ortlab.runtime.profiling.profiling_twin`` builds the twin from what the runner
keeps (``runner.session_source``), with a profile file prefix of its own (see Note
[Unique profile prefixes] there), and ``runner.swap_session`` swaps it in and out.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import tempfile
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ortlab.errors import OrtlabError, first_line
from ortlab.provenance import node_provenance, onnx_node_of

__all__ = [
    "NodeTime",
    "Aggregate",
    "ProfileWindow",
    "node_provenance",
    "parse_profile",
    "aggregate",
    "by_op_type",
    "by_module",
    "top_nodes",
    "merge",
    "count_runs",
    "collect_profile",
]

logger = logging.getLogger(__name__)

_KERNEL_SUFFIX = "_kernel_time"
UNKNOWN_MODULE = "<unknown>"
ROOT_MODULE = "<root>"


@dataclasses.dataclass
class NodeTime:
    """Time onnxruntime spent in one ONNX node's kernel over a profile.

    Attributes:
        node: the ONNX node name (as exported, before onnxruntime's renames).
        op_type: the kernel onnxruntime ran (``FusedGemm``, ``MatMul``, ...).
        dur_us: total kernel time in microseconds.
        count: how many times the kernel ran.
        graph: which graph it belongs to (``g0.forward``), or "".
        fx_node: the FX node it was translated from, or "".
        module: the nn.Module path (``blocks.0.mlp``), "" for the root module,
            ``<unknown>`` when the node is not in the ONNX model (onnxruntime made it).
        op: the aten op (``aten.addmm``), or "".
        source: ``file:line in function`` of the model code, or "".
        provider: the execution provider that ran it.
    """

    node: str
    op_type: str
    dur_us: float
    count: int
    graph: str = ""
    fx_node: str = ""
    module: str = ""
    op: str = ""
    source: str = ""
    provider: str = ""

    @property
    def label(self) -> str:
        """A short readable name: ``g0.backward node_mm (FusedMatMul) at net.2``."""
        where = f" at {self.module or ROOT_MODULE}"
        return f"{self.graph + ' ' if self.graph else ''}{self.node} ({self.op_type}){where}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeTime:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass
class Aggregate:
    """Kernel time of a group of nodes (one op type, one module).

    Attributes:
        key: the group (op type or module path).
        dur_us: total microseconds.
        count: kernel runs.
        share: fraction of the total kernel time of the profile (0..1).
    """

    key: str
    dur_us: float
    count: int
    share: float


def _load_events(profile: str | os.PathLike | Sequence[dict]) -> list[dict]:
    if isinstance(profile, (str, os.PathLike)):
        with open(profile, encoding="utf-8") as f:
            return json.load(f)
    return list(profile)


def count_runs(profile: str | os.PathLike | Sequence[dict]) -> int:
    """How many times the session ran (``model_run`` events) in a profile.

    Example:
        >>> count_runs([{"cat": "Session", "name": "model_run", "dur": 5}])
        1
    """
    return sum(1 for e in _load_events(profile) if e.get("cat") == "Session" and e.get("name") == "model_run")


def parse_profile(
    profile: str | os.PathLike | Sequence[dict],
    model: Any = None,
    graph: str = "",
    provenance: dict[str, dict[str, str]] | None = None,
    skip_runs: int = 0,
) -> list[NodeTime]:
    """Per-node kernel time of one onnxruntime profile.

    Args:
        profile: the JSON file ``session.end_profiling()`` returned, or its events.
        model: the ONNX model the session ran (``ExportedGraph.model``), to map
            nodes to FX nodes, modules and source lines; optional.
        graph: a label for the graph (``g0.forward``) copied into each record.
        provenance: a precomputed :func:`node_provenance` of ``model``.
        skip_runs: leave out the kernels of the first ``skip_runs`` runs (a new
            session's first run allocates its memory and is slower).

    Returns:
        One :class:`NodeTime` per ONNX node, slowest first.

    Example:
        >>> path = runner.session.end_profiling()          # doctest: +SKIP
        >>> parse_profile(path, exported.model)[0].label   # doctest: +SKIP
        'node_addmm (FusedGemm) at net.0'
    """
    events = _load_events(profile)
    if provenance is None:
        provenance = node_provenance(model) if model is not None else {}
    cutoff = _end_of_runs(events, skip_runs)
    totals: dict[str, list] = {}
    for e in events:
        if e.get("cat") != "Node":
            continue
        name = e.get("name", "")
        if not name.endswith(_KERNEL_SUFFIX) or e.get("ts", 0) < cutoff:
            continue
        node = onnx_node_of(name)
        args = e.get("args") or {}
        acc = totals.get(node)
        if acc is None:
            totals[node] = [args.get("op_name", ""), float(e.get("dur", 0)), 1, args.get("provider", "")]
        else:
            acc[1] += float(e.get("dur", 0))
            acc[2] += 1
    records = []
    for node, (op_type, dur, count, provider) in totals.items():
        known = provenance.get(node)
        prov = known if known and any(known.values()) else _by_prefix(node, provenance)
        if prov is None:  # made by onnxruntime, or by onnxscript's optimizer without metadata (``n0``)
            prov = {"fx_node": "", "module": UNKNOWN_MODULE if provenance else "", "op": "", "source": ""}
        records.append(
            NodeTime(node=node, op_type=op_type, dur_us=dur, count=count, graph=graph, provider=provider, **prov)
        )
    records.sort(key=lambda r: r.dur_us, reverse=True)
    return records


def _end_of_runs(events: Sequence[dict], skip_runs: int) -> float:
    """The end time (us) of the first ``skip_runs`` ``model_run`` events; -inf for none."""
    if skip_runs <= 0:
        return float("-inf")
    runs = sorted(
        (float(e.get("ts", 0)), float(e.get("dur", 0)))
        for e in events
        if e.get("cat") == "Session" and e.get("name") == "model_run"
    )
    if len(runs) < skip_runs:
        return float("inf")
    ts, dur = runs[skip_runs - 1]
    return ts + dur


def _by_prefix(node: str, provenance: dict[str, dict[str, str]]) -> dict[str, str] | None:
    """Provenance of a node onnxruntime added next to an exported one (``node_Reshape_3_new_reshape``)."""
    best = ""
    for name, prov in provenance.items():
        if len(name) > len(best) and node.startswith(name + "_") and any(prov.values()):
            best = name
    return provenance[best] if best else None


def merge(*profiles: Iterable[NodeTime]) -> list[NodeTime]:
    """Sum the records of several profiles node by node (same graph and node).

    Example:
        >>> a = NodeTime("n", "Gemm", 10.0, 1, graph="g0.forward")
        >>> merge([a], [a])[0].dur_us
        20.0
    """
    out: dict[tuple[str, str], NodeTime] = {}
    for records in profiles:
        for r in records:
            key = (r.graph, r.node)
            if key in out:
                out[key].dur_us += r.dur_us
                out[key].count += r.count
            else:
                out[key] = dataclasses.replace(r)
    return sorted(out.values(), key=lambda r: r.dur_us, reverse=True)


def aggregate(records: Iterable[NodeTime], key: Callable[[NodeTime], str]) -> list[Aggregate]:
    """Group records by ``key(record)``; slowest group first, with its share of the total.

    Example:
        >>> recs = [NodeTime("a", "Gemm", 30.0, 1), NodeTime("b", "Relu", 10.0, 1)]
        >>> [(g.key, g.share) for g in aggregate(recs, lambda r: r.op_type)]
        [('Gemm', 0.75), ('Relu', 0.25)]
    """
    dur: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for r in records:
        k = key(r)
        dur[k] += r.dur_us
        count[k] += r.count
    total = sum(dur.values()) or 1.0
    groups = [Aggregate(k, d, count[k], d / total) for k, d in dur.items()]
    groups.sort(key=lambda g: g.dur_us, reverse=True)
    return groups


def by_op_type(records: Iterable[NodeTime]) -> list[Aggregate]:
    """Kernel time per onnxruntime op type (``FusedGemm``, ``MatMul``...).

    Example:
        >>> by_op_type([NodeTime("a", "Gemm", 3.0, 1)])[0].key
        'Gemm'
    """
    return aggregate(records, lambda r: r.op_type or "?")


def by_module(records: Iterable[NodeTime], depth: int | None = None) -> list[Aggregate]:
    """Kernel time per nn.Module path, optionally cut to ``depth`` components.

    Args:
        records: node records.
        depth: keep the first ``depth`` dotted components (``blocks.0.mlp.fc`` at
            depth 2 is ``blocks.0``); ``None`` keeps the full path.

    Example:
        >>> by_module([NodeTime("a", "Gemm", 3.0, 1, module="blocks.0.fc")], depth=2)[0].key
        'blocks.0'
    """

    def key(r: NodeTime) -> str:
        if not r.module:
            return ROOT_MODULE
        if depth is None or r.module.startswith("<"):
            return r.module
        return ".".join(r.module.split(".")[:depth])

    return aggregate(records, key)


def top_nodes(records: Iterable[NodeTime], n: int = 10) -> list[NodeTime]:
    """The ``n`` slowest nodes.

    Example:
        >>> top_nodes([NodeTime("a", "Gemm", 1.0, 1), NodeTime("b", "Relu", 2.0, 1)], 1)[0].node
        'b'
    """
    return sorted(records, key=lambda r: r.dur_us, reverse=True)[:n]


# ------------------------------------------------------------------ sessions of an ORTModule
def _graph_parts(ortmodule: Any) -> list[tuple[str, Any, Any]]:
    """(graph label, OrtRunner, ExportedGraph | None) of every onnxruntime part."""
    parts = []
    for capture in ortmodule.report.captures:
        for graph in capture.graphs:
            for part in graph.parts:
                parts.append((graph.label, part.runner, part.exported))
    return parts


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


def collect_profile(ortmodule: Any, remove_files: bool = False) -> list[NodeTime]:
    """End the profiles of every session of an ORTModule built with ``profile=True``.

    onnxruntime writes a profile only when it ends, and a session cannot profile
    again afterwards: call this once, after training (or use :class:`ProfileWindow`
    for repeated readings).

    Args:
        ortmodule: an ``ortlab.ORTModule`` created (or reconfigured) with ``profile=True``.
        remove_files: delete the JSON files after reading them.

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
            records.append(parse_profile(path, graph=graph, provenance=_provenance_of(runner, exported)))
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
        for graph, runner, exported in _graph_parts(self.ortmodule):
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
                events = _load_events(path)
                self.runs[graph] = self.runs.get(graph, 0) + max(count_runs(events) - self.skip_runs, 0)
                prov = _provenance_of(runner, exported)
                records.append(parse_profile(events, graph=graph, provenance=prov, skip_runs=self.skip_runs))
            except (OSError, ValueError) as e:
                logger.warning("could not read the onnxruntime profile %s: %s", path, e)
            finally:
                _remove(path)
        return merge(*records)
