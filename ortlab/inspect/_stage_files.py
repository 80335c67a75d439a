"""Saved stage files: what their names say, and the ops and FX nodes of the models in them.

ortlab names every file it saves ``{prefix}[_g{i}]_{rest}_{train|eval}.{py|onnx}`` (see
``ortlab.artifacts``); :func:`parse_stage_file` reads such a name back. Counting the ops
of a saved graph and mapping FX nodes to ONNX nodes read the file once per version
(cached by path and modification time).
"""

from __future__ import annotations

import collections
import functools
import os
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["ONNX_STAGES", "fx_code_op_counts", "onnx_op_counts", "parse_stage_file", "onnx_node_index"]

# {prefix}[_g{i}]_{rest}_{train|eval}.{py|onnx}, see ortlab.artifacts.
_FILE = re.compile(
    r"^(?P<prefix>.+?)(?:_g(?P<index>\d+))?_(?P<rest>[A-Za-z0-9_]+?)_(?P<mode>train|eval)\.(?P<ext>py|onnx)$"
)
_REST = re.compile(r"^(?:g(?P<index>\d+)_)?(?P<rest>[A-Za-z0-9_]+?)_(?P<mode>train|eval)\.(?P<ext>py|onnx)$")
ONNX_STAGES = ("exported", "onnxscript", "ort_basic", "ort_extended", "ort_all", "execution")
_TORCH_OP = re.compile(r"torch\.ops\.(\w+)\.(\w+)(?:\.\w+)?\(")


def fx_code_op_counts(code: str) -> dict[str, int]:
    """Count the ``torch.ops`` calls in an FX graph's printed code (``aten.mm``: 3).

    The joint, forward and backward stages are saved as code; their counts use the
    names ``ortlab.capture.provenance.op_name`` gives (``namespace.op``).

    Example:
        >>> fx_code_op_counts('mm = torch.ops.aten.mm.default(a, b)')
        {'aten.mm': 1}
    """
    counts = collections.Counter(f"{ns}.{op}" for ns, op in _TORCH_OP.findall(code))
    return dict(counts.most_common())


def _graph_nodes(graph: Any) -> Iterator[Any]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _graph_nodes(attr.g)
            for sub in attr.graphs:
                yield from _graph_nodes(sub)


def _onnx_key(node: Any) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


@functools.lru_cache(maxsize=64)
def _onnx_counts_cached(path: str, mtime_ns: int) -> tuple[tuple[str, int], ...]:
    import onnx

    model = onnx.load(path, load_external_data=False)
    counts = collections.Counter(_onnx_key(n) for n in _graph_nodes(model.graph))
    return tuple(counts.most_common())


def onnx_op_counts(path: str) -> dict[str, int]:
    """ONNX op types of a saved model (subgraphs included) and how often each occurs.

    Ops outside the default domain are named ``domain.op`` (``com.microsoft.FusedGemm``).

    Example:
        >>> onnx_op_counts("net_forward_exported_train.onnx")    # doctest: +SKIP
        {'Gemm': 2, 'Tanh': 1}
    """
    return dict(_onnx_counts_cached(os.path.abspath(path), os.stat(path).st_mtime_ns))


def parse_stage_file(name: str, prefix: str | None = None) -> dict[str, Any] | None:
    """Split a saved stage file name into its parts (see ``ortlab.artifacts``).

    Returns ``None`` for names that are not stage files, else a dict with ``prefix``,
    ``index`` (captured graph), ``stage`` (``captured``, ``forward``, ``exported``,
    ``ort_all``...), ``graph`` (``forward``/``backward``/``inference`` for ONNX files),
    ``part`` (``fused_0`` for an onnxruntime partition), ``mode``, ``ext`` and ``label``.
    Give ``prefix`` when it may contain underscores.

    Example:
        >>> parse_stage_file("net_g1_forward_fused_0_ort_all_train.onnx")["label"]
        'g1.forward.fused_0'
    """
    base = os.path.basename(name)
    if prefix is not None:
        if not base.startswith(prefix + "_"):
            return None
        m = _REST.match(base[len(prefix) + 1:])
    else:
        m = _FILE.match(base)
        prefix = m["prefix"] if m is not None else ""
    if m is None:
        return None
    index = int(m["index"] or 0)
    rest, ext = m["rest"], m["ext"]
    graph, part, stage = rest, "", rest
    if ext == "onnx":
        stage = next((s for s in ONNX_STAGES if rest.endswith("_" + s)), "")
        if not stage:
            return None
        head = rest[: -len(stage) - 1]
        graph, _, part = head.partition("_")
    label = f"g{index}" if stage == "captured" else f"g{index}.{graph}" + (f".{part}" if part else "")
    return {"prefix": prefix, "index": index, "stage": stage, "graph": graph, "part": part,
            "mode": m["mode"], "ext": ext, "label": label}


@functools.lru_cache(maxsize=64)
def _fx_index_cached(path: str, mtime_ns: int) -> tuple[tuple[str, str], ...]:
    import onnx

    model = onnx.load(path, load_external_data=False)
    found: dict[str, str] = {}
    producers: dict[str, str] = {}
    for node in model.graph.node:
        for prop in node.metadata_props:
            if prop.key == "ortlab.fx_node":
                found[prop.value] = node.name  # the last ONNX node of an FX node makes its value
        for value in node.output:
            producers.setdefault(value, node.name)
    # Values keep their FX names: getitem_3 (an output of a multi-output op) -> its producer;
    # a value made outside this graph (by an op running in PyTorch) -> the input itself.
    for value, node_name in producers.items():
        found.setdefault(value, node_name)
    for value in model.graph.input:
        found.setdefault(value.name, value.name)
    return tuple(found.items())


def onnx_node_index(path: str) -> dict[str, str]:
    """FX node name -> name of the (last) ONNX node exported for it, from ``ortlab.fx_node``.

    FX values without a node of their own (``getitem_3`` of a multi-output op) map to
    the ONNX node that produces the value of that name, and graph inputs to themselves.

    Example:
        >>> onnx_node_index("net_forward_exported_train.onnx")["tanh"]    # doctest: +SKIP
        'node_tanh'
    """
    return dict(_fx_index_cached(os.path.abspath(path), os.stat(path).st_mtime_ns))
