"""Per-kernel time from onnxruntime's profiler, mapped back to the model's code.

onnxruntime's profiler writes a Chrome-trace JSON file: one ``cat == "Node"`` event
per kernel run, named ``<onnx node>_kernel_time`` with ``args.op_name`` (the kernel's
op type after onnxruntime's fusions) and ``dur`` in microseconds. Every ONNX node
ortlab exports carries ``ortlab.fx_node``, ``ortlab.module``, ``ortlab.op`` and
``ortlab.source`` metadata, so a kernel leads back to the nn.Module and the line that
made it. onnxruntime renames the nodes it fuses (``node_addmm/GemmTransposeFusion/``,
``fused node_addmm/...``): ``ortlab.provenance.onnx_node_of`` reads the ONNX node that
survived the fusion back out of such a name.

Profiling the sessions of an ORTModule (``collect_profile``, ``ProfileWindow``) is in
``ortlab.inspect.profile_window``.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ortlab.provenance import added_beside, node_provenance, onnx_node_of

__all__ = [
    "NodeTime",
    "Aggregate",
    "parse_profile",
    "aggregate",
    "by_op_type",
    "by_module",
    "top_nodes",
    "merge",
    "count_runs",
    "load_events",
    "provenance_of",
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
        per_run_us: its kernel time in each profiled run of its session (one run per step for a
            graph called once a step), for the spread across steps; empty where unknown.
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
    per_run_us: list[float] = dataclasses.field(default_factory=list)

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


def load_events(profile: str | os.PathLike | Sequence[dict]) -> list[dict]:
    """The events of an onnxruntime profile (its JSON file, or the events themselves)."""
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
    return sum(1 for e in load_events(profile) if e.get("cat") == "Session" and e.get("name") == "model_run")


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
    events = load_events(profile)
    if provenance is None:
        provenance = node_provenance(model) if model is not None else {}
    cutoff = _end_of_runs(events, skip_runs)
    starts = sorted(float(e.get("ts", 0)) for e in events
                    if e.get("cat") == "Session" and e.get("name") == "model_run" and float(e.get("ts", 0)) >= cutoff)
    totals: dict[str, list] = {}
    per_run: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != "Node":
            continue
        name = e.get("name", "")
        if not name.endswith(_KERNEL_SUFFIX) or e.get("ts", 0) < cutoff:
            continue
        node = onnx_node_of(name)
        args = e.get("args") or {}
        if starts:  # the run it belongs to: the last that started before it
            run = max(bisect.bisect_right(starts, float(e.get("ts", 0))) - 1, 0)
            runs = per_run.setdefault(node, [0.0] * len(starts))
            runs[run] += float(e.get("dur", 0))
        acc = totals.get(node)
        if acc is None:
            totals[node] = [args.get("op_name", ""), float(e.get("dur", 0)), 1, args.get("provider", "")]
        else:
            acc[1] += float(e.get("dur", 0))
            acc[2] += 1
    records = []
    for node, (op_type, dur, count, provider) in totals.items():
        prov = provenance_of(node, provenance)
        records.append(
            NodeTime(node=node, op_type=op_type, dur_us=dur, count=count, graph=graph, provider=provider,
                     per_run_us=per_run.get(node, []), **prov)
        )
    records.sort(key=lambda r: r.dur_us, reverse=True)
    return records


def provenance_of(node: str, provenance: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{fx_node, module, op, source}`` of an ONNX node (as :func:`onnx_node_of` reads it).

    A node onnxruntime added next to an exported one takes that one's provenance; a node
    with none (made by onnxruntime, or by onnxscript's optimizer without metadata) has
    ``module`` ``<unknown>`` (empty strings when ``provenance`` is empty).

    Example:
        >>> provenance_of("n0", {})["module"]
        ''
    """
    known = provenance.get(node)
    prov = known if known and any(known.values()) else added_beside(node, provenance)
    if prov is None:
        return {"fx_node": "", "module": UNKNOWN_MODULE if provenance else "", "op": "", "source": ""}
    return dict(prov)


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
                out[key].per_run_us = out[key].per_run_us + list(r.per_run_us)
            else:
                out[key] = dataclasses.replace(r, per_run_us=list(r.per_run_us))
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
