"""The model OpenVINO's CPU plugin is given: MatMuls whose layout its GEMM runs slowly, split or turned;
max pools' indices and convolutions' gradients in forms it has kernels for (its reference kernels ran
them); and scatters of nothing, which it refuses, dropped (torch-free: the on-device runtime builds
sessions without PyTorch).

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

Note [Max pools' indices for OpenVINO]
PyTorch's ``max_pool2d`` saves the index of each window's maximum for its backward, and the exporter
writes it as ONNX ``MaxPool`` with its second output (torchlib adds a second, 1x1 ``MaxPool`` whose
indices it subtracts to make them per image and channel). OpenVINO's CPU plugin (1.8.1) has no
kernel of its own for that output: both ran on its reference implementation, 228 ms each in a
ResNet-18 forward (batch 16, 64x64) whose 20 convolutions took 61 ms, so the race kept the whole
forward on the CPU provider. The model OpenVINO is given computes both from the window's kh*kw
strided slices of the input padded with -inf: ``ArgMax`` over them (the first maximum, as PyTorch's
kernel scans the window row by row and keeps the first of equal values; ReLU's zeros make ties
common), the window's offset added, then
ONNX's flat index ``((n*C + c)*H + h)*W + w``; the values are the elements it picks (a ``MaxPool``
without indices, or ``ReduceMax``, gives -FLT_MAX instead of -inf for a window of -inf and padding,
on the CPU provider and on OpenVINO). A window whose maximum is -inf (every element -inf,
or padding) gets the first element inside the input, as PyTorch's does. A window holding NaN may
name another element than PyTorch's (its last NaN); the loss is NaN by then. Static shapes, 2-D,
explicit pads and float32 only; other pools are left as they are.

Note [Input gradients of convolutions for OpenVINO]
ortlab's decomposition writes a convolution's input gradient as a GEMM and a ``Col2Im`` (Note
[Convolution gradients as GEMMs] in ``ortlab/capture/decompositions.py``), the fastest form on the
CPU provider. OpenVINO's plugin runs ``Col2Im`` on its reference implementation: 179 ms of a
ResNet-18 backward's 388 (19 of them). For OpenVINO the pattern (``Col2Im(Transpose(Reshape(
MatMul(Transpose(W), dY))))``, W the weight as ``[Co, Ci*kh*kw]``, dY as ``[Co, N*Ho*Wo]``) becomes
the transposed convolution it stands for, ``ConvTranspose(dY, W)``, which the plugin runs with
oneDNN's kernels: the same sums, in another order. It reads dY as ``[N, Co, Ho, Wo]`` where the
exported ``[Co, N*Ho*Wo]`` is a reshaped transpose of it (the weight gradient's GEMM keeps that).
ResNet-18 (batch 16, 64x64), the backward's saved graph alone on the plugin: 252-296 -> 178-189 ms
(the CPU provider: 249-305 ms). Tried and not kept: the weight gradient's patches (the padded
input's strided Slices and their Concat, also on reference kernels, 37 ms) as one grouped
convolution with a one-hot kernel: oneDNN's depthwise kernel and its reorders took 51 ms (see
Note [Weight gradients of convolutions for OpenVINO] for what was kept).

Note [Weight gradients of convolutions for OpenVINO]
ortlab's decomposition writes a convolution's weight gradient as one GEMM of dY with the input's
patches (the kh*kw strided windows of the padded input, batch and channels swapped, stacked:
Note [Convolution gradients as GEMMs]). On OpenVINO's plugin the patches' strided Slices and Concat run on reference
kernels (37 ms of a ResNet-18 backward). Where the output has at least 64 positions (Ho*Wo), its
model computes the gradient as PyTorch's CPU kernels once did: a convolution of the padded input
with dY, batch and channels swapped (the input as ``[C, N, H, W]``, dY as ``[Co, N, Ho, Wo]``
kernels dilated by the stride), sliced to kh x kw and transposed to ``[Co, C*kh*kw]``. One weight
gradient alone through the plugin (batch 16, 3x3, medians of 7): 16x16 outputs 9.8 -> 4.8 ms, 8x8
5.8 -> 4.1 ms, 8x8 with stride 2 5.2 -> 3.9 ms; 4x4 5.2 -> 8.7 ms and 2x2 4.9 -> 40 ms, so smaller
outputs keep the GEMM, and so do 1x1 kernels (their patches are one slice; not measured).
ResNet-18's backward alone, 8 of its 20 weight gradients swapped: 189 -> 176 and 185 -> 166 ms
(363 -> 286 and 412 -> 341 ms under load). The CPU provider's model keeps the GEMM (swapped, the
same shapes took 77 ms against 48).

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

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["prepare_for_openvino", "prepare_for_cuda", "preparation", "MARK", "CUDA_MARK"]

# Written into the model's metadata so that a model prepared once (the cache keeps the
# winner's model) is recognised from its bytes without parsing it again.
MARK = "ortlab.openvino_prepared"
CUDA_MARK = "ortlab.cuda_prepared"  # Note [Input gradients of convolutions on CUDA]
SLICE = 1024
_MIN_WIDTH = 2048  # at most this wide: as fast as it gets
_MIN_DEPTH = 2048  # Note [Deep MatMuls for OpenVINO]
_MIN_WORK = 1 << 28  # multiply-adds: below this, the two transposes cost as much as they save
_MIN_ROWS = 256
_MIN_SPOTS = 64  # output positions (Ho*Wo) from which a swapped convolution beats the patches' GEMM


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


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The values of the graph's initializers and ``Constant`` nodes that hold a small tensor."""
    values = {i.name: numpy_helper.to_array(i) for i in graph.initializer if np.prod(i.dims) <= 16}
    for node in graph.node:
        if (node.op_type == "Constant" and node.output and node.attribute and node.attribute[0].name == "value"
                and np.prod(node.attribute[0].t.dims) <= 16):
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value, name))


def _pool_indices(node: onnx.NodeProto, shapes: dict[str, list], types: dict[str, int]) -> list[onnx.NodeProto] | None:
    """A ``MaxPool`` with indices as the ArgMax of its windows, values and indices (Note [Max pools' indices
    for OpenVINO]); ``None`` where it stays as it is."""
    if (node.op_type != "MaxPool" or node.domain not in ("", "ai.onnx") or len(node.output) < 2
            or not node.output[1] or types.get(node.input[0]) != onnx.TensorProto.FLOAT):
        return None
    x, y, a = shapes.get(node.input[0]), shapes.get(node.output[0]), _attrs(node)
    if (x is None or y is None or len(x) != 4 or len(y) != 4 or None in x or None in y
            or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"") or a.get("storage_order", 0) != 0):
        return None
    (n, c, h, w), (ho, wo) = x, y[2:]
    kh, kw = a["kernel_shape"]
    sh, sw = a.get("strides", [1, 1])
    dh, dw = a.get("dilations", [1, 1])
    pt, pl, _, _ = a.get("pads", [0, 0, 0, 0])
    base = node.name or node.output[0]
    names = iter(f"{base}__ov_{i}" for i in range(10_000))
    made: list[onnx.NodeProto] = []

    def add(op: str, inputs: list[str], **attrs: object) -> str:
        out = next(names)
        made.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def const(value: np.ndarray) -> str:
        out = next(names)
        made.append(_const(out, value))
        return out

    # padded with -inf up to the last window's end (ceil_mode windows may pass the input's end)
    bottom = max(0, (ho - 1) * sh + (kh - 1) * dh + 1 - h - pt)
    right = max(0, (wo - 1) * sw + (kw - 1) * dw + 1 - w - pl)
    padded = add("Pad", [node.input[0], const(np.array([0, 0, pt, pl, 0, 0, bottom, right], np.int64)),
                         const(np.array(-np.inf, np.float32))])
    axes, steps = const(np.array([2, 3], np.int64)), const(np.array([sh, sw], np.int64))
    at = const(np.array([2], np.int64))
    windows = []
    for i in range(kh):
        for j in range(kw):
            starts = const(np.array([i * dh, j * dw], np.int64))
            ends = const(np.array([i * dh + (ho - 1) * sh + 1, j * dw + (wo - 1) * sw + 1], np.int64))
            windows.append(add("Unsqueeze", [add("Slice", [padded, starts, ends, axes, steps]), at]))
    stacked = add("Concat", windows, axis=2)
    first = add("ArgMax", [stacked], axis=2, keepdims=0, select_last_index=0)
    # The values are the elements picked: a MaxPool without indices, or ReduceMax, gives -FLT_MAX, not -inf,
    # for a window of -inf and padding (onnxruntime's CPU provider and OpenVINO's alike).
    made.append(helper.make_node("Squeeze", [add("GatherElements", [stacked, add("Unsqueeze", [first, at])], axis=2),
                                             at], [node.output[0]], name=base))
    offsets = np.arange(kh * kw)
    rows = add("Add", [add("Gather", [const((offsets // kw * dh).astype(np.int64)), first]),
                       const((np.arange(ho) * sh - pt).astype(np.int64).reshape(ho, 1))])
    cols = add("Add", [add("Gather", [const((offsets % kw * dw).astype(np.int64)), first]),
                       const((np.arange(wo) * sw - pl).astype(np.int64).reshape(1, wo))])
    picked = add("Add", [add("Mul", [rows, const(np.array(w, np.int64))]), cols])  # h * W + w in the image
    # A window whose maximum is -inf: PyTorch's kernel keeps the first element inside the input.
    top = np.arange(ho) * sh - pt
    left = np.arange(wo) * sw - pl
    top = np.where(top < 0, top + (-top + dh - 1) // dh * dh, top)
    left = np.where(left < 0, left + (-left + dw - 1) // dw * dw, left)
    inside = const((top.reshape(ho, 1) * w + left.reshape(1, wo)).astype(np.int64))
    empty = add("Equal", [node.output[0], const(np.array(-np.inf, np.float32))])
    planes = const((np.arange(n * c, dtype=np.int64) * h * w).reshape(n, c, 1, 1))  # ONNX's indices are flat
    made.append(helper.make_node("Add", [add("Where", [empty, inside, picked]), planes], [node.output[1]],
                                 name=f"{base}__ov_indices"))
    return made


def _deconvolution(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto], shapes: dict[str, list],
                   constants: dict[str, np.ndarray]) -> list[onnx.NodeProto] | None:
    """A convolution's input gradient, ``Col2Im`` of a GEMM, as the ``ConvTranspose`` it stands for (Note
    [Input gradients of convolutions for OpenVINO]); ``None`` where the pattern is not there."""
    if node.op_type != "Col2Im" or node.domain not in ("", "ai.onnx"):
        return None
    chain = [node]
    for op, inp in (("Transpose", 0), ("Reshape", 0), ("MatMul", 0), ("Transpose", 0)):
        found = producer.get(chain[-1].input[inp])
        if found is None or found.op_type != op or found.domain not in ("", "ai.onnx"):
            return None
        chain.append(found)
    _, turn, reshape, matmul, wt = chain
    if _attrs(turn).get("perm") != [1, 0, 2] or _attrs(wt).get("perm") != [1, 0]:
        return None
    weight, grad = wt.input[0], matmul.input[1]
    image, block, target = (constants.get(name) for name in (node.input[1], node.input[2], reshape.input[1]))
    wshape, gshape = shapes.get(weight), shapes.get(grad)
    if (image is None or block is None or target is None or image.shape != (2,) or block.shape != (2,)
            or target.shape != (3,) or wshape is None or gshape is None or len(wshape) != 2 or len(gshape) != 2
            or None in wshape or None in gshape):
        return None
    a = _attrs(node)
    (hh, ww), (kh, kw) = (int(v) for v in image), (int(v) for v in block)
    sh, sw = a.get("strides", [1, 1])
    dh, dw = a.get("dilations", [1, 1])
    pt, pl, pb, pr = a.get("pads", [0, 0, 0, 0])
    (co, ckk), (co_g, cols) = wshape, gshape
    target = [int(v) for v in target]
    if target.count(-1) == 1 and 0 not in target:  # the exporter writes view(-1, N, L)
        target[target.index(-1)] = ckk * cols // -int(np.prod(target))
    c, (rows, batch, spots) = ckk // (kh * kw), target
    ho, wo = (hh + pt + pb - dh * (kh - 1) - 1) // sh + 1, (ww + pl + pr - dw * (kw - 1) - 1) // sw + 1
    extra = [hh - (sh * (ho - 1) + dh * (kh - 1) + 1 - pt - pb), ww - (sw * (wo - 1) + dw * (kw - 1) + 1 - pl - pr)]
    if (c * kh * kw != ckk or co_g != co or rows != ckk or spots != ho * wo or batch * spots != cols
            or not all(0 <= e < max(s, d) for e, s, d in zip(extra, (sh, sw), (dh, dw)))):
        return None
    base = node.name or node.output[0]
    g4, d, w4 = f"{base}__ov_grad", f"{base}__ov_grad_nchw", f"{base}__ov_weight"
    # dY as [Co, N*Ho*Wo] is mostly a reshaped transpose of dY as [N, Co, Ho, Wo] (the weight gradient's
    # GEMM reads it too): the ConvTranspose takes that instead of transposing it back.
    flat = producer.get(grad)
    turned = producer.get(flat.input[0]) if flat is not None and flat.op_type == "Reshape" else None
    if (turned is not None and turned.op_type == "Transpose" and _attrs(turned).get("perm") == [1, 0, 2, 3]
            and shapes.get(turned.input[0]) == [batch, co, ho, wo]):
        made = []
        d = turned.input[0]
    else:
        made = [_const(f"{g4}_shape", np.array([co, batch, ho, wo], np.int64)),
                helper.make_node("Reshape", [grad, f"{g4}_shape"], [g4], name=g4),
                helper.make_node("Transpose", [g4], [d], name=d, perm=[1, 0, 2, 3])]
    return [*made,
            _const(f"{w4}_shape", np.array([co, c, kh, kw], np.int64)),
            helper.make_node("Reshape", [weight, f"{w4}_shape"], [w4], name=w4),
            helper.make_node("ConvTranspose", [d, w4], list(node.output), name=base, kernel_shape=[kh, kw],
                             strides=[sh, sw], pads=[pt, pl, pb, pr], dilations=[dh, dw], output_padding=extra)]


def _window(value: str, producer: dict[str, onnx.NodeProto],
            constants: dict[str, np.ndarray]) -> tuple[str, dict[int, tuple[int, int]]] | None:
    """The 4-D tensor a chain of ``Slice`` nodes reads, and each sliced axis's (start, step); ``None`` where
    a slice's arguments are not constants."""
    sliced: dict[int, tuple[int, int]] = {}
    node = producer.get(value)
    while node is not None and node.op_type == "Slice" and node.domain in ("", "ai.onnx"):
        names = [*node.input[1:], "", "", ""][:4]
        starts, _, axes, steps = (constants.get(name) if name else None for name in names)
        if starts is None or (names[2] and axes is None) or (names[3] and steps is None):
            return None
        axes = np.arange(len(starts)) if axes is None else axes
        steps = np.ones(len(starts), np.int64) if steps is None else steps
        for axis, start, step in zip(axes, starts, steps):
            axis = int(axis) % 4
            if axis in sliced or start < 0 or step < 1:
                return None
            sliced[axis] = (int(start), int(step))
        value, node = node.input[0], producer.get(node.input[0])
    return value, sliced


def _stacked_windows(node: onnx.NodeProto | None, producer: dict[str, onnx.NodeProto], shapes: dict[str, list],
                     constants: dict[str, np.ndarray]) -> tuple[str, tuple[int, ...]] | None:
    """``node`` as the stack (``Concat`` on axis 1 of ``Unsqueeze``d strided slices) of one tensor's kh*kw
    windows, ``[C, kh*kw, N, Ho, Wo]`` from a ``[C, N, H, W]`` tensor: that tensor and ``(kh, kw, dh, dw, sh, sw)``."""
    out = shapes.get(node.output[0]) if node is not None and node.output else None
    if (node is None or node.op_type != "Concat" or _attrs(node).get("axis") not in (1, -4) or out is None
            or len(out) != 5 or None in out or len(node.input) != out[1] or len(node.input) < 2):
        return None
    channels, taps, batch, ho, wo = out
    source, starts, steps = None, [], set()
    for value in node.input:
        unsqueeze = producer.get(value)
        if (unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.input) != 2
                or [int(a) for a in np.atleast_1d(constants.get(unsqueeze.input[1], np.array([])))] != [1]):
            return None
        found = _window(unsqueeze.input[0], producer, constants)
        if found is None or (source is not None and found[0] != source):
            return None
        source, sliced = found
        if set(sliced) - {2, 3}:  # a window of the spatial dims only
            return None
        starts.append((sliced.get(2, (0, 1))[0], sliced.get(3, (0, 1))[0]))
        steps.add((sliced.get(2, (0, 1))[1], sliced.get(3, (0, 1))[1]))
    x = shapes.get(source)
    if x is None or len(x) != 4 or None in x or x[:2] != [channels, batch] or len(steps) != 1:
        return None
    (sh, sw), rows, cols = steps.pop(), sorted({r for r, _ in starts}), sorted({c for _, c in starts})
    kh, kw = len(rows), len(cols)
    dh = rows[1] - rows[0] if kh > 1 else 1
    dw = cols[1] - cols[0] if kw > 1 else 1
    if (kh * kw != taps or starts != [(i * dh, j * dw) for i in range(kh) for j in range(kw)]
            or (kh - 1) * dh + sh * (ho - 1) >= x[2] or (kw - 1) * dw + sw * (wo - 1) >= x[3]):
        return None  # (the last window must lie inside the tensor)
    return source, (kh, kw, dh, dw, sh, sw)


def _swapped_weight_gradient(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto], shapes: dict[str, list],
                             types: dict[str, int], constants: dict[str, np.ndarray]) -> list[onnx.NodeProto] | None:
    """A convolution's weight gradient, ``dY @ patches^T``, as a convolution of the input with dY, batch and
    channels swapped (Note [Weight gradients of convolutions for OpenVINO]); ``None`` where the pattern is
    not there or the output is small."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    chain = []
    for value, ops in ((node.input[0], ("Reshape", "Transpose")), (node.input[1], ("Transpose", "Reshape"))):
        found = producer.get(value)
        for op in ops:
            if found is None or found.op_type != op:
                return None
            chain.append(found)
            found = producer.get(found.input[0])
        chain.append(found)
    _, turned, _, cols_t, _, stack = chain
    if _attrs(turned).get("perm") != [1, 0, 2, 3] or _attrs(cols_t).get("perm") != [1, 0]:
        return None
    windows = _stacked_windows(stack, producer, shapes, constants)
    grad, out = turned.input[0], shapes.get(node.output[0])
    if windows is None or types.get(windows[0]) != onnx.TensorProto.FLOAT or out is None or len(out) != 2:
        return None
    source, (kh, kw, dh, dw, sh, sw) = windows
    (channels, batch, _, _), dy = shapes[source], shapes.get(grad)
    if dy is None or len(dy) != 4 or None in dy or dy[0] != batch or dy[2] * dy[3] < _MIN_SPOTS:
        return None
    co, ho, wo = dy[1], dy[2], dy[3]
    if out != [co, channels * kh * kw] or [ho, wo] != shapes[stack.output[0]][3:]:
        return None
    base = node.name or node.output[0]
    names = [f"{base}__ov_{what}" for what in ("product", "kernel_size", "axes", "zero", "taps", "turned", "shape")]
    product, size, axes, zero, taps, back, shape = names
    # The windows' source is the padded input with batch and channels swapped already: the Conv's input.
    return [helper.make_node("Conv", [source, turned.output[0]], [product], name=product, dilations=[sh, sw],
                             strides=[dh, dw]),
            _const(zero, np.array([0, 0], np.int64)), _const(size, np.array([kh, kw], np.int64)),
            _const(axes, np.array([2, 3], np.int64)),
            helper.make_node("Slice", [product, zero, size, axes], [taps], name=taps),
            helper.make_node("Transpose", [taps], [back], name=back, perm=[1, 0, 2, 3]),
            _const(shape, np.array(out, np.int64)),
            helper.make_node("Reshape", [back, shape], list(node.output), name=base)]


def _reads(node: onnx.NodeProto) -> list[str]:
    """The names ``node`` reads: its inputs, and the outer names its subgraphs (an ``If``'s branches) read."""
    names = list(node.input)
    for a in node.attribute:
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                    a.graphs if a.type == onnx.AttributeProto.GRAPHS else []):
            for inner in sub.node:
                names.extend(_reads(inner))
            names.extend(o.name for o in sub.output)
    return names


def _drop_unused(graph: onnx.GraphProto) -> None:
    """Nodes whose results nothing reads any more (what a rewrite replaced); the order of the others is kept
    (ortlab's guard nodes follow the nodes that read them). Our own pass: onnx_ir's RemoveUnusedNodesPass
    works on its IR, and this module edits the ``ModelProto`` it was given without converting it."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    live, pending = set(), [o.name for o in graph.output]
    while pending:
        i = producer.get(pending.pop())
        if i is not None and i not in live:
            live.add(i)
            pending.extend(_reads(graph.node[i]))
    kept = [node for i, node in enumerate(graph.node) if i in live]
    del graph.node[:]
    graph.node.extend(kept)
    read = {name for node in kept for name in _reads(node)} | {o.name for o in graph.output}
    initializers = [i for i in graph.initializer if i.name in read]
    del graph.initializer[:]
    graph.initializer.extend(initializers)


def _rewrite_convolution_parts(graph: onnx.GraphProto, shapes: dict[str, list],
                               types: dict[str, int]) -> tuple[int, int, int]:
    """Note [Max pools' indices for OpenVINO], Note [Input gradients of convolutions for OpenVINO] and Note
    [Weight gradients of convolutions for OpenVINO]: how many pools, input gradients and weight gradients
    were rewritten."""
    if not any(n.op_type in ("MaxPool", "Col2Im", "Concat") for n in graph.node) or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return 0, 0, 0
    constants = _constants(graph)
    producer = {out: node for node in graph.node for out in node.output}
    pools, deconvolutions, swapped = _substitute(graph, (
        lambda node: _pool_indices(node, shapes, types),
        lambda node: _deconvolution(node, producer, shapes, constants),
        lambda node: _swapped_weight_gradient(node, producer, shapes, types, constants)))
    return pools, deconvolutions, swapped


def _substitute(graph: onnx.GraphProto, rewrites: Sequence[Callable[[onnx.NodeProto], list | None]]) -> list[int]:
    """Each node of ``graph`` replaced by the nodes the first of ``rewrites`` makes for it (``None``: not its
    pattern), which keep its metadata (provenance); what the replaced nodes read and nothing else does goes.
    Returns how many nodes each rewrite replaced."""
    counts, nodes = [0] * len(rewrites), []
    for node in graph.node:
        for i, rewrite in enumerate(rewrites):
            made = rewrite(node)
            if made is not None:
                counts[i] += 1
                for m in made:
                    m.metadata_props.extend(node.metadata_props)
                nodes.extend(made)
                break
        else:
            nodes.append(node)
    if any(counts):
        del graph.node[:]
        graph.node.extend(nodes)
        _drop_unused(graph)
    return counts


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


def _shapes_and_types(graph: onnx.GraphProto) -> tuple[dict[str, list], dict[str, int]]:
    shapes, types = {}, {}
    for v in [*graph.input, *graph.value_info, *graph.output]:
        dims = v.type.tensor_type.shape.dim
        shapes[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        types[v.name] = v.type.tensor_type.elem_type
    return shapes, types


# Note [Input gradients of convolutions on CUDA]
# onnxruntime's CUDA provider has no ``Col2Im`` kernel: the ``Col2Im`` of a convolution's input gradient
# (Note [Convolution gradients as GEMMs]) ran on the CPU provider, each with a copy of its columns to
# the host and of its image back (ResNet-18 on an H200: 19 of each a step, Col2Im 14.6 ms of host time
# a step against 1.8 ms for eager's whole step on the GPU). The CUDA provider's model takes the same
# rewrite as OpenVINO's (Note [Input gradients of convolutions for OpenVINO]): ``ConvTranspose(dY, W)``,
# which cuDNN runs as the data gradient it is.


def prepare_for_cuda(model: bytes) -> bytes:
    """``model`` with its convolutions' input gradients as ``ConvTranspose`` (Note [Input gradients of
    convolutions on CUDA]); the model's metadata says how many. ``model`` itself where nothing changes."""
    if CUDA_MARK.encode() in model or b"Col2Im" not in model:
        return model
    proto = onnx.load_from_string(model)
    graph = proto.graph
    # Subgraphs (BatchNorm's backward has Ifs) are left as they are; what they read stays (_drop_unused).
    shapes, _ = _shapes_and_types(graph)
    constants = _constants(graph)
    producer = {out: node for node in graph.node for out in node.output}
    (deconvolutions,) = _substitute(graph, (lambda node: _deconvolution(node, producer, shapes, constants),))
    if not deconvolutions:
        return model
    proto.metadata_props.append(onnx.StringStringEntryProto(key=CUDA_MARK,
                                                            value=f"{deconvolutions} Col2Im(s) as ConvTranspose"))
    return proto.SerializeToString()


def prepare_for_openvino(model: bytes) -> bytes:
    """``model`` with its slow-layout MatMuls split (Note [Wide MatMuls for OpenVINO]) or computed transposed
    (Note [Deep MatMuls for OpenVINO]), its max pools' indices computed (Note [Max pools' indices for
    OpenVINO]), its convolutions' gradients as convolutions (Note [Input gradients of convolutions for
    OpenVINO], Note [Weight gradients of convolutions for OpenVINO]) and its scatters of nothing dropped
    (Note [Scatters of nothing for OpenVINO]). The model's metadata says what was done.

    Returns ``model`` itself (the same object) when nothing changes or it was prepared before.
    """
    if MARK.encode() in model:
        return model
    proto = onnx.load_from_string(model)
    graph = proto.graph
    shapes, types = _shapes_and_types(graph)
    scatters = _drop_empty_scatters(graph, shapes)
    pools, deconvolutions, swapped = _rewrite_convolution_parts(graph, shapes, types)
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
    if not split and not turned and not scatters and not pools and not deconvolutions and not swapped:
        return model
    del graph.node[:]
    graph.node.extend(nodes)
    done = [f"{split} MatMul(s) split"] if split else []
    done += [f"{turned} MatMul(s) computed transposed"] if turned else []
    done += [f"{scatters} ScatterND(s) without an index dropped"] if scatters else []
    done += [f"{pools} MaxPool(s) with their indices computed"] if pools else []
    done += [f"{deconvolutions} Col2Im(s) as ConvTranspose"] if deconvolutions else []
    done += [f"{swapped} weight gradient(s) as a swapped Conv"] if swapped else []
    proto.metadata_props.append(onnx.StringStringEntryProto(key=MARK, value=", ".join(done)))
    return proto.SerializeToString()


def preparation(model: object) -> str:
    """What :func:`prepare_for_openvino` or :func:`prepare_for_cuda` did to ``model``, for the report
    (``"OpenVINO's model: 3 MatMul(s) split, ..."``), or ``""``."""
    if not isinstance(model, bytes) or (MARK.encode() not in model and CUDA_MARK.encode() not in model):
        return ""
    proto = onnx.ModelProto()
    proto.ParseFromString(model)
    who = {MARK: "OpenVINO's model", CUDA_MARK: "CUDA's model"}
    return next((f"{who[p.key]}: {p.value}" for p in proto.metadata_props if p.key in who), "")
