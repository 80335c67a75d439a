"""Where each ONNX node came from: the FX node, aten op, nn.Module path and source line.

The exporter writes these as ``ortlab.*`` node metadata (see ortlab/onnx/export.py).
onnxruntime's optimized models drop node metadata, so the on-disk cache stores this
map beside each model and runners carry it (``OrtRunner.provenance``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["node_provenance"]


def _nodes_of(model: Any) -> Iterable[tuple[str, dict[str, str]]]:
    """(name, metadata) of every node of an onnx_ir Model or an onnx ModelProto."""
    graph = getattr(model, "graph", None)
    if graph is None:
        return []
    if hasattr(graph, "all_nodes"):  # onnx_ir
        return ((n.name or "", dict(n.metadata_props)) for n in graph.all_nodes())
    return ((n.name, {p.key: p.value for p in n.metadata_props}) for n in graph.node)  # ModelProto


def node_provenance(model: Any) -> dict[str, dict[str, str]]:
    """Map each ONNX node name of ``model`` to its ortlab provenance.

    Args:
        model: an ``onnx_ir.Model`` (``ExportedGraph.model``) or an ``onnx.ModelProto``.

    Returns:
        ``{node name: {"fx_node", "module", "op", "source"}}``; nodes without ortlab
        metadata map to empty strings.

    Example:
        >>> prov = node_provenance(exported.model)       # doctest: +SKIP
        >>> prov["node_addmm"]["module"]                 # doctest: +SKIP
        'net.0'
    """
    out: dict[str, dict[str, str]] = {}
    for name, meta in _nodes_of(model):
        out[name] = {
            "fx_node": meta.get("ortlab.fx_node", ""),
            "module": meta.get("ortlab.module", ""),
            "op": meta.get("ortlab.op", ""),
            "source": meta.get("ortlab.source", ""),
        }
    return out
