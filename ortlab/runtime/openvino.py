"""The model OpenVINO's CPU plugin is given: MatMuls whose layout its GEMM runs slowly, split, and scatters
of nothing, which it refuses, dropped (torch-free: the on-device runtime builds sessions without PyTorch).

Note [Wide MatMuls for OpenVINO]
OpenVINO's CPU plugin (the one in ``onnxruntime-ep-openvino`` 1.8.1, and openvino 2026.4 alone)
runs a MatMul whose second input is a computed ``[K, N]`` tensor (not a weight it can pack
ahead, not a transposed view) at less than half its usual speed for some widths N. Measured on
the 2-core Intel Xeon (AMX, AVX-512), M=1024, f32, GFLOP/s of one MatMul alone:

    K     N      as it is   split in 1024-column slices   B given as [N, K]
    768   2048   237        -                             252
    768   2560   171        223                           258
    768   3072   114        221                           257
    1024  3072   104        241                           215
    3072  3072    84        253                           -
    768   4096   239        225                           248
    768   8192   243        218                           -

N=3072 is the feed-forward width of BERT-base, GPT-2-small and ViT-B, and the backward has two
such MatMuls per layer: the input gradient of the second projection (``dY @ W2``, W2 is
``[768, 3072]``) and its weight gradient (``dY^T @ G``, G the saved ``[tokens, 3072]``
activation). In BERT-base's backward they took 95 of its ~145 ms per layer. Transposing B
instead costs a copy OpenVINO folds away again (it fuses a Transpose into the MatMul), so
each such MatMul becomes MatMuls over column slices of B, concatenated: the same dot products,
on slices OpenVINO runs at full speed. Widths that are multiples of 4096 ran fast as they
were and are left alone; the race (``ortlab.runtime.race``) still measures the whole graph
against the CPU provider, which runs the unsplit model.

This is ortlab's own pass, not an onnxscript rewrite rule: it depends on a static shape and on
which provider will run the model, and applies to the plugin's model only.

Note [Deep MatMuls for OpenVINO]
The backward's input gradients are ``dY @ W``: B is the weight as PyTorch keeps it, ``[K, N]``
with K the layer's output width, which OpenVINO's GEMM runs slowly when K is large against N.
On the 2-core Intel Xeon without AMX (AVX-512), M=1024, f32, one MatMul alone through the plugin,
medians of 7 rounds in turns (``python benchmarks/gemm_engines.py``):

    K      N     dY @ W   (W^T dY^T)^T   torch.mm (MKL)   MLAS
    3072   768    65.6 ms     36.1 ms        29.4 ms     43.3 ms
    2304   768    33.9 ms     21.6 ms        25.3 ms     28.8 ms
    50257  768     849 ms      375 ms         321 ms      437 ms   (the LM head's, 1024 kept rows)
    768    768     7.5 ms      (not deep: left as it is; turned, 22 -> 26 ms in a run under load)

The GPT-2-small-sized model's backward alone (saved graphs, standalone sessions in turns): the body
3.78 -> 3.22 s, the LM head and loss 1.60 -> 1.15 s. Computed as
``Transpose(MatMul(Transpose(W), Transpose(dY)))``, OpenVINO folds both input transposes into its
GEMM's fast layout and copies only the ``[M, N]`` result. The same dot products; only the order of
the sums inside OpenVINO's kernel changes. A MatMul is turned when K >= 2048, K >= 2N and it is
large enough (a symbolic M, as label sparsity's kept rows, counts as 256 rows); wide ones are split
instead (above).

Note [Scatters of nothing for OpenVINO]
A ``ScatterND`` whose indices hold no index (shape ``[0, k]``: no update) returns its data as it
is. The exporter writes one for each ``slice_scatter`` of an empty slice: Phi-3's backward has
four, where its rotary embedding covers the whole head and ``torch.cat`` joins an empty
pass-through part. OpenVINO's plugin (1.8.1) refuses the whole graph ("Input names mismatch
between OpenVINO and ONNX. OpenVINO input has no ONNX binding"), so the race dropped it and
a graph pinned to it ran in PyTorch. Its model takes the data instead (an ``Identity`` only
where the scatter's result is a graph output); the other providers run the graph as exported.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["prepare_for_openvino", "MARK"]

# Written into the model's metadata so that a model prepared once (the cache keeps the
# winner's model) is recognised from its bytes without parsing it again.
MARK = "ortlab.openvino_prepared"
SLICE = 1024
_MIN_WIDTH = 2048  # at most this wide: as fast as it gets
_MIN_DEPTH = 2048  # Note [Deep MatMuls for OpenVINO]
_MIN_WORK = 1 << 28  # multiply-adds: below this, the two transposes cost as much as they save
_MIN_ROWS = 256


def _slices(width: int) -> list[int] | None:
    if width <= _MIN_WIDTH or width % 4096 == 0:
        return None
    return [SLICE] * (width // SLICE) + ([width % SLICE] if width % SLICE else [])


def _deep(a: list | None, b: list | None) -> bool:
    """Whether ``a @ b`` (both 2-D, B's shape static) is deep (Note [Deep MatMuls for OpenVINO])."""
    if a is None or b is None or len(a) != 2 or len(b) != 2 or None in b:
        return False
    (m, _), (k, n) = a, b  # a symbolic M (label sparsity's kept rows) counts as _MIN_ROWS
    return k >= _MIN_DEPTH and k >= 2 * n and (m or _MIN_ROWS) * k * n >= _MIN_WORK


def _split(graph: onnx.GraphProto, node: onnx.NodeProto, b: str, sizes: list[int]) -> list[onnx.NodeProto]:
    """``node`` (``a @ b``) as MatMuls over column slices of ``b``, concatenated (Note [Wide MatMuls for
    OpenVINO])."""
    base = node.name or node.output[0]
    sizes_name = f"{base}__ov_slices"
    graph.initializer.append(numpy_helper.from_array(np.array(sizes, dtype=np.int64), sizes_name))
    pieces = [f"{base}__ov_b{i}" for i in range(len(sizes))]
    products = [f"{base}__ov_mm{i}" for i in range(len(sizes))]
    made = [helper.make_node("Split", [b, sizes_name], pieces, name=f"{base}__ov_split", axis=1)]
    made += [helper.make_node("MatMul", [node.input[0], p], [o], name=o) for p, o in zip(pieces, products)]
    made.append(helper.make_node("Concat", products, list(node.output), name=base, axis=-1))
    return made


def _turned(node: onnx.NodeProto, b: str) -> list[onnx.NodeProto]:
    """``node`` (``a @ b``) as ``(b^T a^T)^T`` (Note [Deep MatMuls for OpenVINO])."""
    base = node.name or node.output[0]
    bt, at, yt = f"{base}__ov_bt", f"{base}__ov_at", f"{base}__ov_yt"
    return [helper.make_node("Transpose", [b], [bt], name=bt, perm=[1, 0]),
            helper.make_node("Transpose", [node.input[0]], [at], name=at, perm=[1, 0]),
            helper.make_node("MatMul", [bt, at], [yt], name=f"{base}__ov_mm"),
            helper.make_node("Transpose", [yt], list(node.output), name=base, perm=[1, 0])]


def _empty_index_sets(graph: onnx.GraphProto, shapes: dict[str, list]) -> set[str]:
    """The names of constant or statically shaped ``ScatterND`` indices that hold no index."""
    constant = {i.name: list(i.dims) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output and node.attribute and node.attribute[0].name == "value":
            constant[node.output[0]] = list(node.attribute[0].t.dims)
    empty = set()
    for node in graph.node:
        if node.op_type != "ScatterND" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        dims = constant.get(node.input[1], shapes.get(node.input[1]))
        if dims and any(d == 0 for d in dims[:-1]):  # no update: the leading dimensions count the updates
            empty.add(node.input[1])
    return empty


def _drop_empty_scatters(graph: onnx.GraphProto, shapes: dict[str, list]) -> int:
    """Note [Scatters of nothing for OpenVINO]: each ScatterND without an index gives way to its data;
    returns how many did."""
    empty = _empty_index_sets(graph, shapes)
    if not empty or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                        for n in graph.node for a in n.attribute):
        return 0  # (a subgraph may read a dropped result by name from the outer scope)
    outputs = {o.name for o in graph.output}
    alias: dict[str, str] = {}
    nodes, dropped = [], 0
    for node in graph.node:
        inputs = [alias.get(i, i) for i in node.input]
        if node.op_type == "ScatterND" and node.domain in ("", "ai.onnx") and inputs[1] in empty:
            dropped += 1
            if node.output[0] in outputs:
                made = helper.make_node("Identity", [inputs[0]], [node.output[0]], name=node.name)
                made.metadata_props.extend(node.metadata_props)
                nodes.append(made)
            else:
                alias[node.output[0]] = inputs[0]
            continue
        del node.input[:]
        node.input.extend(inputs)
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return dropped


def prepare_for_openvino(model: bytes) -> bytes:
    """``model`` with its slow-layout MatMuls split (Note [Wide MatMuls for OpenVINO]) or computed transposed
    (Note [Deep MatMuls for OpenVINO]) and its scatters of nothing dropped (Note [Scatters of nothing for
    OpenVINO]).

    Returns ``model`` itself (the same object) when nothing changes or it was prepared before.
    """
    if MARK.encode() in model:
        return model
    proto = onnx.load_from_string(model)
    graph = proto.graph
    shapes = {}
    for v in [*graph.input, *graph.value_info, *graph.output]:
        dims = v.type.tensor_type.shape.dim
        shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    scatters = _drop_empty_scatters(graph, shapes)
    constant = {i.name for i in graph.initializer}
    producer = {}
    for node in graph.node:
        for out in node.output:
            producer[out] = node
    nodes, split, turned = [], 0, 0
    for node in graph.node:
        b = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        shape = shapes.get(b) if b is not None else None
        made_by = producer.get(b) if b is not None else None
        sizes = _slices(shape[1]) if shape is not None and len(shape) == 2 and shape[1] else None
        if (b is None or b in constant or (made_by is not None and made_by.op_type in ("Transpose", "Constant"))
                or node.domain not in ("", "ai.onnx")):
            made = None
        elif sizes is not None:
            made, split = _split(graph, node, b, sizes), split + 1
        elif _deep(shapes.get(node.input[0]), shape):
            made, turned = _turned(node, b), turned + 1
        else:
            made = None
        if made is None:
            nodes.append(node)
            continue
        for m in made:
            m.metadata_props.extend(node.metadata_props)  # provenance (module, source line) stays with them
        nodes.extend(made)
    if not split and not turned and not scatters:
        return model
    del graph.node[:]
    graph.node.extend(nodes)
    done = [f"{split} MatMul(s) split"] if split else []
    done += [f"{turned} MatMul(s) computed transposed"] if turned else []
    done += [f"{scatters} ScatterND(s) without an index dropped"] if scatters else []
    proto.metadata_props.append(onnx.StringStringEntryProto(key=MARK, value=", ".join(done)))
    return proto.SerializeToString()
