"""Rewrites of a graph for onnxruntime's CPU provider: the same values, from kernels it runs faster.

A training graph differs from the inference graphs onnxruntime's CPU kernels were tuned
for: its weights are inputs, not constants, and its backward is full of selects and
windows. Three rewrites close part of that gap; each keeps the graph's values (the select and
the window exactly, the convolution as a float32 convolution summed in another order, within
the parity tolerance), and each is measured in ``benchmarks/results``:

* Note [Where as a checked multiply]: ``Where`` with a full-size condition.
* Note [Convolutions in the blocked layout]: ``Conv`` with a weight that is not a constant.
* Note [One Slice for a window]: a ``Slice`` of a ``Slice`` along other axes.
* Note [GELU in one kernel]: a GELU as one onnxruntime kernel (``Gelu``, ``FastGelu``).
* Note [A max pool's plane offsets]: the offsets torchlib reads from a 1x1 ``MaxPool``'s indices, as constants.
* Note [Input gradients as blocked convolutions]: a stride-1 convolution's input gradient on a large image.

One more makes the CPU provider's values PyTorch's, at every optimization level:

* Note [A -0.0 from Where's first branch]: a ``Where`` whose first branch may select a -0.0, swapped.

They run on the graphs of the CPU provider's sessions: where OpenVINO is a candidate in the
provider race, it is given the graph as exported (Note [The CPU provider races with its
rewrites] in ``ortlab.pipeline.part``). OpenVINO runs ``Where`` and ``Conv`` well as they are,
has no kernels for onnxruntime's blocked-layout ops, and its model is matched against the
slices as exported (``ortlab.runtime.openvino``).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from ortlab._compat.onnxscript import exact_rules
from ortlab.errors import first_line

__all__ = ["CpuRewrites", "blocked_convolutions", "checked_selects", "exact_selects", "expanded_broadcasts", "found_in",
           "fused_gelus", "input_gradients", "merged_slices", "nchwc_block_size", "pool_offsets", "rewrite_for_cpu"]

logger = logging.getLogger(__name__)

NCHWC = "com.microsoft.nchwc"
_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE)


@dataclasses.dataclass
class CpuRewrites:
    """What :func:`rewrite_for_cpu` did to one graph.

    Attributes:
        selects: ``Where`` nodes now checked multiplies.
        convolutions: ``Conv`` nodes now in the blocked layout.
        why_not_blocked: why no convolution was (empty when one was, or none could be).
        slices: ``Slice`` nodes of a ``Slice`` now one ``Slice`` of its input.
        gelus: GELUs now one onnxruntime kernel each (``Gelu``, ``FastGelu``).
        input_gradients: convolutions' input gradients (``Col2Im`` of a GEMM) now convolutions.
        broadcasts: elementwise ops whose per-channel operand is now expanded over the small planes.
        exact: ``Where`` nodes with their branches swapped to keep a -0.0 (values, not speed: not in the notes).
    """

    selects: int = 0
    convolutions: int = 0
    why_not_blocked: str = ""
    slices: int = 0
    gelus: int = 0
    input_gradients: int = 0
    broadcasts: int = 0
    exact: int = 0

    def any(self) -> bool:
        return bool(self.exact) or any(getattr(self, field) for field, _, _ in _REPORTED)

    def notes(self, where: str) -> list[str]:
        """The report's lines for the graph ``where``."""
        out = []
        for field, _, line in _REPORTED:
            if getattr(self, field):
                out.append(f"{where}: " + line.format(n=getattr(self, field)))
            if field == "convolutions" and self.why_not_blocked:
                out.append(f"{where}: convolutions kept in onnxruntime's plain layout: {self.why_not_blocked}")
        return out


# The names of the nodes that mark a rewrite, which onnxruntime keeps in the model it optimizes: a cached
# model (stored as onnxruntime optimized it) is read for them, so a cached start reports them too.
SELECT_SUFFIX = "_checked_select"
BLOCKED_SUFFIX = "_blocked_nchwc"
MERGED_SUFFIX = "_one_slice"
GELU_SUFFIX = "_one_gelu"
DGRAD_SUFFIX = "_input_gradient_conv"
EXPAND_SUFFIX = "_expanded_operand"


# Each counted rewrite: its field of ``CpuRewrites``, the suffixes its nodes' names end in, and its report line.
_REPORTED: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("selects", (SELECT_SUFFIX,),
     "{n} Where node(s) with a full-size condition run as a multiply by the condition, checked for NaN (the select "
     "runs instead when one appears; Note [Where as a checked multiply] in ortlab.runtime.cpu_rewrites)"),
    ("convolutions", (BLOCKED_SUFFIX,),
     "{n} convolution(s) run in onnxruntime's blocked (NCHWc) layout, their weights reordered each step (Note "
     "[Convolutions in the blocked layout])"),
    ("slices", (MERGED_SUFFIX,),
     "{n} Slice(s) of a Slice along other axes run as one Slice of its input (Note [One Slice for a window])"),
    ("gelus", (GELU_SUFFIX,),
     "{n} GELU(s) run as one onnxruntime kernel each (Gelu, FastGelu), not five or eight elementwise ones (Note "
     "[GELU in one kernel])"),
    ("input_gradients", (DGRAD_SUFFIX, DGRAD_SUFFIX + BLOCKED_SUFFIX),
     "{n} convolution input gradient(s) run as a convolution with the flipped weight, not a GEMM and a Col2Im "
     "(Note [Input gradients as blocked convolutions])"),
    ("broadcasts", (EXPAND_SUFFIX,),
     "{n} elementwise op(s) take their per-channel operand expanded over small planes, not broadcast in short "
     "spans (Note [Per-channel operands over small planes])"),
)


def found_in(model: onnx.ModelProto) -> CpuRewrites:
    """The rewrites a model (as ortlab or onnxruntime wrote it) holds, counted by their nodes' names."""
    names = [node.name for node in model.graph.node]
    return CpuRewrites(**{field: sum(n.endswith(suffixes) for n in names) for field, suffixes, _ in _REPORTED})


def rewrite_for_cpu(model: ir.Model, level: str) -> CpuRewrites:
    """Apply the CPU provider's rewrites to ``model`` in place, for a session at optimization ``level``.

    The blocked layout is onnxruntime's own layout optimization, which it applies at level
    ``all`` only; the checked selects apply at every level but ``disable``.
    """
    done = CpuRewrites()
    if level == "disable":
        done.exact = exact_selects(model)  # values, not speed: at every level (Note [A -0.0 from Where's first branch])
        return done
    done.selects = checked_selects(model)
    done.exact = exact_selects(model)  # after the checked selects: theirs are exact, their If's Where is swapped
    pool_offsets(model)  # a constant computed early, as onnxscript's folding does: not a decision to report
    done.slices = merged_slices(model)
    done.broadcasts = expanded_broadcasts(model)
    if level in ("extended", "all"):  # the level onnxruntime's own GeluFusion runs from
        done.gelus = fused_gelus(model)
    if level == "all" and any(n.op_type in ("Conv", "Col2Im") and n.domain in ("", "ai.onnx") for n in model.graph):
        block, why = nchwc_block_size()
        if block:
            done.input_gradients = input_gradients(model, block)
            done.convolutions = blocked_convolutions(model, block)
        else:
            done.why_not_blocked = why
    return done


# Note [Where as a checked multiply]
# onnxruntime's CPU ``Where`` selects in three single-threaded passes (condition and X,
# condition and Y, then a merge of the two) with two temporaries, and with a condition as
# large as its result it takes its per-element path: 2.0 ms on an [8, 4, 128, 128] float
# tensor, where a ``Mul`` takes 0.05 ms (AMD EPYC, 2 threads). Every ReLU's gradient
# (``threshold_backward``) is such a Where: 17 of them took 11 ms of ResNet-18's backward.
#
# A multiply by the condition is the select whenever it makes no NaN: for ``Where(c, x, y)``,
# ``x * c + y * !c`` is ``x`` or ``y`` when both are finite (``v * 1`` and ``v + 0`` are exact),
# and an infinite or NaN operand makes a NaN where the select would have dropped it (inf * 0)
# or kept a NaN. So the rewrite computes the product, sums it (one NaN makes the sum NaN),
# and an ``If`` keeps the product when the sum is not NaN and runs the original ``Where``
# when it is. The result is the select's in every case; only a step whose select meets an
# inf or a NaN pays for both. A one-element constant +0 operand drops its term
# (``threshold_backward``: ``g * !c``).
#
# Note [Signed zeros through a checked multiply]
# A product's zeros carry signs the select would not give: a dropped negative term is -0 (``g * 0``
# where relu masked a negative gradient, eager's +0: 400k such zeros in a [1024, 1024] relu6's
# gradient), and a kept -0 plus a dropped +0 is +0 (``remainder(-0.0, 1)``, PyTorch's -0.0; the
# decompositions keep such zeros in Where's second branch, Note [Where keeps -0.0 from its second
# branch only] in ortlab.capture.float_edges). So:
# * one term (a constant +0 operand): ``g * !c + z``, with ``z = (0 - !c) * 0``: -0 where g passes
#   (``v + -0`` is v, a -0 included) and +0 wherever the select writes the constant (``±0 + +0`` is +0),
#   for three more elementwise ops (ResNet-18: 13 of them). Until 2026-11-28 ``z`` was +0, and a kept
#   -0 came out +0 (a pow gradient's -0 at a zero base, 1 of 943,593 in an OpInfo sample);
# * two terms: the check sums ``1 / product`` instead of the product, which is ±inf at any zero (and
#   still NaN at a NaN), and the exact Where runs where the sum is not finite. A select of two
#   tensors that gives exact zeros pays for both; one whose values are never zero (or where an
#   infinite operand already sends it to the Where, as the -inf of an attention mask) does not.
#
# With a condition smaller than the result (a causal mask [T, T] beside scores [B, H, T, T])
# onnxruntime's Where copies spans and is fast enough that the If costs as much as it saves
# (measured on the GPT's forward), so those stay. So do Wheres of two one-element operands
# (``where(x > 0, 1, slope)``): onnxruntime selects those fast, 1.6 ms with the multiply by x on 1M
# float32 elements (one thread) against 2.9 ms as a checked multiply, and 13 ms for ``where(c, x, x * s)``
# (benchmarks/where_forms.py, results/epyc-avx2/where_forms.txt). onnxruntime's ``BitCast`` (opset 26) would
# give an exact select of bitwise ops, but our graphs are opset 18, and its integer kernels
# are no faster (0.38 ms on the same tensor).
# Below this many elements a Where costs less than the nodes and the If that replace it
# (the If and its copy cost ~0.15 ms; the rewrite saves ~3 ns an element). ResNet-18's backward:
# 13 of its Where nodes rewritten, 10.9 ms of Where -> ~3 ms of Mul, ReduceSum, Cast, Not and If.
MIN_SELECT_ELEMENTS = 1 << 16


def _numel(value: ir.Value) -> int | None:
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return math.prod(shape)


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """The array of a constant operand (an initializer or a ``Constant`` node's ``value``), else ``None``."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        node = value.producer()
        if (node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx")
                or "value" not in node.attributes):
            return None
        tensor = node.attributes["value"].as_tensor()
    return np.asarray(tensor.numpy())


def _one_element(value: ir.Value) -> bool:
    """Whether ``value`` has one element (by its shape, or as a constant)."""
    if _numel(value) == 1:
        return True
    array = _constant(value)
    return array is not None and array.size == 1


def _scalar(value: ir.Value) -> float | None:
    """The value of a constant operand with one element, else ``None``."""
    array = _constant(value)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(()))


def _node(op: str, inputs: list[ir.Value], like: ir.Node, domain: str = "", name: str | None = None,
          **attributes: object) -> ir.Node:
    """A node standing for (part of) ``like``: it carries ``like``'s provenance (the model code behind it)."""
    node = ir.node(op, inputs, attributes or None, domain=domain, name=name)
    node.metadata_props.update(like.metadata_props)
    return node


def _replace(graph: ir.Graph, old: ir.Node, nodes: list[ir.Node], result: ir.Value) -> None:
    """Put ``nodes`` where ``old`` was, ``result`` (their last output) in place of ``old``'s output and name."""
    out = old.outputs[0]
    result.dtype, result.shape = out.dtype, out.shape
    # Names of their own, unique beside the graph's (a value the serializer names itself could repeat one in
    # an If's branch, which onnxruntime rejects: a graph must be in SSA form).
    count = 0
    for index, node in enumerate(nodes):
        if not node.name and old.name:  # named after ``old``: provenance.added_beside finds its provenance
            node.name = f"{old.name}_cpu{index}"
        for inner in (node, *(n for g in _subgraphs(node) for n in g)):
            for value in inner.outputs:
                if value is not result:
                    value.name = f"{out.name}_cpu{count}"
                    count += 1
    graph.insert_before(old, nodes)
    ir.convenience.replace_all_uses_with(out, result, replace_graph_outputs=True)
    name = out.name
    graph.remove(old, safe=True)
    result.name = name


def _subgraphs(node: ir.Node) -> list[ir.Graph]:
    return [a.value for a in node.attributes.values() if a.type == ir.AttributeType.GRAPH]


def checked_selects(model: ir.Model) -> int:
    """Rewrite the top graph's large float ``Where`` nodes with a full-size condition (Note [Where as a checked
    multiply]); returns how many."""
    graph = model.graph
    rewritten = 0
    for where in list(graph):
        if where.op_type != "Where" or where.domain not in ("", "ai.onnx") or len(where.inputs) != 3:
            continue
        cond, x, y = where.inputs
        out = where.outputs[0]
        if out.dtype not in _FLOATS or cond is None or x is None or y is None:
            continue
        numel = _numel(out)
        if numel is None or numel < MIN_SELECT_ELEMENTS or _numel(cond) != numel:
            continue
        if _one_element(x) and _one_element(y):  # onnxruntime's scalar path is faster (Note [Where as a checked ...])
            continue
        nodes: list[ir.Node] = []
        terms = []
        for operand, when in ((x, True), (y, False)):
            constant = _scalar(operand)
            if constant == 0.0 and math.copysign(1.0, constant) > 0:  # +0 (Note [Signed zeros through ...])
                continue
            mask = cond
            if not when:
                nodes.append(_node("Not", [cond], where))
                mask = nodes[-1].outputs[0]
            nodes.append(_node("Cast", [mask], where, to=out.dtype))
            nodes.append(_node("Mul", [operand, nodes[-1].outputs[0]], where))
            terms.append(nodes[-1].outputs[0])
        if not terms:
            continue  # Where(c, 0, 0)
        # Note [Signed zeros through a checked multiply]
        if len(terms) == 2:
            nodes.append(_node("Add", terms, where))
            product = nodes[-1].outputs[0]
            nodes.append(_node("Reciprocal", [product], where))  # ±inf at a zero, NaN at a NaN
            nodes.append(_node("ReduceSum", [nodes[-1].outputs[0]], where, keepdims=0))
            total = nodes[-1].outputs[0]
            nodes.append(_node("IsNaN", [total], where))
            nodes.append(_node("IsInf", [total], where))
            nodes.append(_node("Or", [nodes[-2].outputs[0], nodes[-1].outputs[0]], where))
        else:
            kept = nodes[-2].outputs[0]  # the term's mask as 0 or 1 (the Cast before its Mul)
            zero = ir.node("Constant", [], {"value": ir.tensor(np.zeros((), dtype=out.dtype.numpy()))})
            nodes.append(zero)
            nodes.append(_node("Sub", [zero.outputs[0], kept], where))  # -1 where kept, +0 where not
            nodes.append(_node("Mul", [nodes[-1].outputs[0], zero.outputs[0]], where))  # -0 where kept, +0 where not
            nodes.append(_node("Add", [terms[0], nodes[-1].outputs[0]], where))  # kept: v + -0 = v; masked: +0
            product = nodes[-1].outputs[0]
            nodes.append(_node("ReduceSum", [product], where, keepdims=0))
            nodes.append(_node("IsNaN", [nodes[-1].outputs[0]], where))
        exact = ir.node("Where", [cond, x, y])
        keep = ir.node("Identity", [product])  # an If's branch cannot output an outer value itself
        for value in (exact.outputs[0], keep.outputs[0]):
            value.dtype, value.shape = out.dtype, out.shape
        base = where.name or "where"
        choose = _node("If", [nodes[-1].outputs[0]], where, name=f"{base}{SELECT_SUFFIX}",
                       then_branch=ir.Graph([], [exact.outputs[0]], nodes=[exact], name=f"{base}_exact"),
                       else_branch=ir.Graph([], [keep.outputs[0]], nodes=[keep], name=f"{base}_product"))
        nodes.append(choose)
        _replace(graph, where, nodes, choose.outputs[0])
        rewritten += 1
    return rewritten


# Note [A -0.0 from Where's first branch]
# onnxruntime's CPU ``Where`` selects from each branch into a temporary (the other branch's places +0.0)
# and merges the two as ``x_sel != 0 ? x_sel : y_sel`` (where_op.cc): a -0.0 selected from its first
# branch (X) equals 0, so the merge takes the second's +0.0 there; a -0.0 from Y stays. PyTorch's
# ``where`` keeps both. A gradient masked by a select, ``where(mask, grad, 0)`` (``clamp``, ``hardtanh``,
# ``relu6``, ``hardsigmoid``, ``nll_loss`` and ``cross_entropy``, the even split of ``max()``, ``min()``,
# ``median()``), was +0.0 where the incoming gradient was -0.0 and eager's -0.0; so was a forward
# ``torch.where(mask, x, 0)`` at ``x = -0.0``. A float Where whose second branch can hold no -0.0 (a
# constant without one, or a cast, reshape or expand of one, a Where between such, or integers) and whose first can, has its
# branches swapped and its condition negated: by ``Equal(c, false)``, not ``Not``, which onnxruntime's
# NotWhereFusion folds back into the Where with the branches swapped again (a ``Not`` that makes the
# condition is dropped instead). The negation is one pass over bools, within the noise of the Where
# (benchmarks/where_forms.py: 5.97 against 5.86 ms on 1M elements, 0.27 against 0.28 ms on 64K, one
# thread). Large Wheres with a full-size condition are checked multiplies, exact already (Note [Signed
# zeros through a checked multiply]); the Where their If runs at a NaN or inf is swapped here too. A
# Where of two tensors that may both hold -0.0 stays: the decompositions put the value that must keep
# its sign second (Note [Where keeps -0.0 from its second branch only] in ortlab.capture.float_edges), or
# select between constants and multiply (Note [A slope's gradient as a product], there too).
_SIGN_KEEPING = ("Cast", "CastLike", "Expand", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity")


def _no_negative_zero(value: ir.Value | None, depth: int = 0) -> bool:
    """Whether ``value`` can hold no -0.0: not a float, a constant without one (or a ``ConstantOfShape`` of one),
    a cast, reshape or expand of such a value, or a Where between two of them."""
    if value is None:
        return False
    if value.dtype is not None and not value.dtype.is_floating_point():
        return True
    array = _constant(value)
    if array is not None:
        return not bool(np.any((array == 0) & np.signbit(array)))
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or depth > 8:
        return False
    if node.op_type == "ConstantOfShape":
        attribute = node.attributes.get("value")
        if attribute is None:
            return True  # +0.0
        array = np.asarray(attribute.as_tensor().numpy())
        return not bool(np.any((array == 0) & np.signbit(array)))
    if node.op_type == "Where" and len(node.inputs) == 3:  # a select between two values without -0.0
        return _no_negative_zero(node.inputs[1], depth + 1) and _no_negative_zero(node.inputs[2], depth + 1)
    return node.op_type in _SIGN_KEEPING and bool(node.inputs) and _no_negative_zero(node.inputs[0], depth + 1)


def _graphs(graph: ir.Graph) -> list[ir.Graph]:
    """``graph`` and its nodes' subgraphs, at every depth."""
    found = [graph]
    for node in graph:
        for sub in _subgraphs(node):
            found.extend(_graphs(sub))
    return found


def exact_selects(model: ir.Model) -> int:
    """Swap the branches of the float ``Where`` nodes (subgraphs' too) whose first branch may select a -0.0 and
    whose second holds none (Note [A -0.0 from Where's first branch]); returns how many."""
    swapped = 0
    for graph in _graphs(model.graph):
        for where in list(graph):
            if where.op_type != "Where" or where.domain not in ("", "ai.onnx") or len(where.inputs) != 3:
                continue
            cond, x, y = where.inputs
            out = where.outputs[0]
            if cond is None or out.dtype is None or not out.dtype.is_floating_point():
                continue
            if _no_negative_zero(x) or not _no_negative_zero(y):
                continue
            producer = cond.producer()
            if producer is not None and producer.op_type == "Not" and producer.domain in ("", "ai.onnx"):
                negated = producer.inputs[0]
            else:
                base = out.name or f"where{swapped}"
                # Named after the Where, so the provenance restored by node name in onnxruntime's optimized
                # models finds them (provenance.added_beside).
                node_base = where.name or base
                false = _node("Constant", [], where, name=f"{node_base}_false", value=ir.tensor(np.array(False)))
                equal = _node("Equal", [cond, false.outputs[0]], where, name=f"{node_base}_negated")
                false.outputs[0].name, equal.outputs[0].name = f"{base}_false", f"{base}_negated"
                equal.outputs[0].dtype, equal.outputs[0].shape = ir.DataType.BOOL, cond.shape
                graph.insert_before(where, [false, equal])
                negated = equal.outputs[0]
            where.replace_input_with(0, negated)
            where.replace_input_with(1, y)
            where.replace_input_with(2, x)
            if producer is not None and producer.op_type == "Not" and not cond.uses() and not cond.is_graph_output():
                producer.graph.remove(producer, safe=True)
            swapped += 1
    return swapped


# Note [Convolutions in the blocked layout]
# onnxruntime's CPU provider runs a convolution fast in its blocked layout (NCHWc: channels
# in blocks of 8 or 16, the vector width), but it moves a graph there only for convolutions
# whose weights are constants, which it reorders once when the session is built. In training
# the weights are inputs, so every convolution ran as im2col and a GEMM per image: 52 ms of
# ResNet-18's 72 ms forward (batch 16, 64x64), 6 ms against 1.4 ms for a 512-channel 3x3
# convolution on 2x2 maps, where the GEMM is 4 columns wide.
#
# The rewrite does what onnxruntime's layout transformer does, with the weight reordered by
# the graph each step: ``ReorderInput`` (to NCHWc), the ``com.microsoft.nchwc`` Conv with the
# weight laid out OIHWBiBo (OIHWBo where the input has fewer channels than a block and stays
# NCHW: the 3-channel stem), ``ReorderOutput`` (back to NCHW), and the weight reordered in the
# graph (Note [Reordering a weight with ReorderInput]). ResNet-18's forward (AMD EPYC with
# AVX-512, onnxruntime's profiler): Conv 52 -> 23 ms, plus 2 ms of activation reorders and the
# weights' (11.5 ms as Transposes, see below); 72 -> 57 ms.
#
# The block size is MLAS's for the CPU (16 on an AMD EPYC with AVX-512): it is read from
# ``ReorderInput`` itself, and a blocked convolution of each layout is checked against the
# plain one before any graph uses them; should a later onnxruntime lay its weights out
# otherwise, the check fails and the convolutions stay as they are, said in the report.
# Grouped convolutions, and channel counts that are not multiples of the block, stay as they are.
# So do 1x1 convolutions with stride 1 and no padding: onnxruntime runs them as one GEMM per image
# with no im2col, and blocked (the activations reordered in and out) they ran 0.6-0.9x as fast
# (MobileNetV2's pointwise convolutions; its step 3% slower with them blocked).
#
# A kernel larger than 7x7 is a gradient's: a weight gradient computed as a convolution of the
# input with dY as the kernel (ResNet-18's 7x7 stem, Note [Convolution gradients as GEMMs]).
# Its "weight" is as large as an activation, and reordering it cost more (4.5 ms a step) than
# the blocked kernel saved, so those stay.
MAX_BLOCKED_TAPS = 49

# Note [Reordering a weight with ReorderInput]
# A weight [O, I, kh, kw] is [O/B, Bo, I/B, Bi, kh*kw] in memory; the blocked Conv reads it as
# [O/B, I/B, kh*kw, Bi, Bo]. onnxruntime's Transpose moves it slowly: one 5-D permutation took
# 8.5 ms for a 512x512x3x3 weight, two Transposes that each move one axis 3.5 ms (PyTorch's
# permute: 0.9 ms), 11.5 ms of ResNet-18's forward for its 20 weights. ``ReorderInput`` (MLAS's
# vectorized NCHW -> NCHWc copy, the op that reorders activations) makes both moves when the
# weight is viewed as an image:
# * NCHW [O/B, Bo, I*kh*kw, 1], one block of channels: Bo moves last, [O/B, I/B, Bi, kh*kw, Bo];
# * NHWC [(O/B)(I/B), Bi, 1, kh*kw*Bo], channel blocks of Bo: the blocks (kh*kw) move before the
#   rows (Bi), [(O/B)(I/B), kh*kw, Bi, 1, Bo].
# The same floats in the same places (a copy). Each weight read from memory, as after an
# optimizer step (benchmarks/weight_reorder.py): 512x512x3x3 3.5 -> 2.4 ms, 256x256x3x3
# 0.89 -> 0.20 ms, ResNet-18's 20 weights 15.8 -> 8.8 ms; in its step's profile the weights'
# reorders went from 11.5 to ~5 ms and the forward from ~55 to ~47 ms. The probe below runs a
# rewritten convolution of each layout against the plain one, so a changed ReorderInput keeps
# convolutions plain.
_BLOCK: list[tuple[int, str]] = []


def _probe(block: int) -> str:
    """Why a blocked convolution with the weight laid out as :func:`blocked_convolutions` lays it out does not
    match onnxruntime's plain one ("" when it does)."""
    for channels in (2 * block, 3):  # OIHWBiBo, and OIHWBo for an input that stays NCHW
        why = _probe_one(block, channels)
        if why:
            return why
    return ""


def _probe_one(block: int, channels: int) -> str:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, channels, 5, 5)).astype(np.float32)
    w = rng.standard_normal((block, channels, 3, 3)).astype(np.float32)
    b = rng.standard_normal((block,)).astype(np.float32)
    results = []
    for blocked in (False, True):
        graph_inputs = [ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(a.shape))
                        for n, a in (("x", x), ("w", w), ("b", b))]
        conv = ir.node("Conv", graph_inputs, {"pads": [1, 1, 1, 1], "strides": [2, 2]})
        conv.outputs[0].dtype = ir.DataType.FLOAT
        conv.outputs[0].shape = ir.Shape([2, block, 3, 3])
        graph = ir.Graph(graph_inputs, [conv.outputs[0]], nodes=[conv], opset_imports={"": 18})
        probe = ir.Model(graph, ir_version=10)
        if blocked and blocked_convolutions(probe, block) != 1:
            return "the probe's convolution was not rewritten"
        session = ort.InferenceSession(ir.to_proto(probe).SerializeToString(), providers=["CPUExecutionProvider"])
        results.append(session.run(None, {"x": x, "w": w, "b": b})[0])
    plain, ours = results
    if not np.allclose(ours, plain, rtol=1e-4, atol=1e-4):
        return (f"a blocked convolution did not match the plain one (max difference "
                f"{float(np.abs(ours - plain).max()):.3g}): this onnxruntime lays out its weights otherwise")
    return ""


def nchwc_block_size() -> tuple[int, str]:
    """The CPU's NCHWc block size, or 0 and why the blocked layout is not used (checked once a process)."""
    if not _BLOCK:
        try:
            x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 4, 1, 1]))
            node = ir.node("ReorderInput", [x], {"channels_last": 0}, domain=NCHWC)
            model = ir.Model(ir.Graph([x], [node.outputs[0]], nodes=[node], opset_imports={"": 18, NCHWC: 1}),
                             ir_version=10)
            session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
            block = int(session.run(None, {"x": np.zeros((1, 4, 1, 1), np.float32)})[0].shape[1])
            why = _probe(block) if block in (8, 16) else f"an unexpected NCHWc block size {block}"
        except Exception as e:  # a build without the NCHWc kernels (or a changed contract)
            block, why = 0, f"onnxruntime's NCHWc kernels are not usable here: {first_line(e)}"
        if why:
            logger.info("ortlab: %s", why)
        _BLOCK.append((0, why) if why else (block, ""))
    return _BLOCK[0]


def _ints_of(attrs: dict, name: str, value: int) -> bool:
    """Whether the ints attribute ``name`` is absent (its default, ``value`` everywhere) or all ``value``."""
    return name not in attrs or all(v == value for v in attrs[name].as_ints())


def _ints(values: list[int]) -> ir.Node:
    return ir.node("Constant", [], {"value": ir.tensor(np.array(values, dtype=np.int64))})


def blocked_convolutions(model: ir.Model, block: int) -> int:
    """Rewrite the top graph's float 2-D convolutions whose weights are not constants into onnxruntime's NCHWc
    layout with block size ``block`` (Note [Convolutions in the blocked layout]); returns how many."""
    graph = model.graph
    rewritten = 0
    for conv in list(graph):
        if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(conv.inputs) < 2:
            continue
        x, w = conv.inputs[0], conv.inputs[1]
        bias = conv.inputs[2] if len(conv.inputs) > 2 else None
        if x is None or w is None or w.const_value is not None or x.dtype != ir.DataType.FLOAT:
            continue
        shapes = (x.shape, w.shape, conv.outputs[0].shape)
        if any(s is None or len(s) != 4 or not all(isinstance(d, int) for d in s) for s in shapes):
            continue
        attrs = conv.attributes
        if "group" in attrs and attrs["group"].as_int() != 1:
            continue
        if "auto_pad" in attrs and attrs["auto_pad"].as_string() not in ("NOTSET", ""):
            continue
        co, ci, kh, kw = w.shape
        taps = kh * kw
        if co % block or (ci % block and ci >= block) or 0 in x.shape or taps > MAX_BLOCKED_TAPS:
            continue
        if taps == 1 and _ints_of(attrs, "strides", 1) and _ints_of(attrs, "pads", 0):
            continue  # a GEMM per image already, no im2col: blocked it ran 0.6-0.9x as fast
        # The weight's reorder (Note [Reordering a weight with ReorderInput]): [O/B, Bo, I*kh*kw] as NCHW
        # with one block of channels (Bo), moved last: [O/B, I*kh*kw, Bo], OIHWBo (for an NCHW input).
        nodes: list[ir.Node] = [_ints([co // block, block, ci * taps, 1])]
        nodes.append(_node("Reshape", [w, nodes[-1].outputs[0]], conv))
        nodes.append(_node("ReorderInput", [nodes[-1].outputs[0]], conv, domain=NCHWC, channels_last=0))
        if ci % block == 0:
            if taps > 1:  # [(O/B)(I/B), Bi, 1, kh*kw*Bo] as NHWC, blocks of Bo: [.., kh*kw, Bi, 1, Bo]: OIHWBiBo
                nodes.append(_ints([(co // block) * (ci // block), block, 1, taps * block]))
                nodes.append(_node("Reshape", [nodes[-2].outputs[0], nodes[-1].outputs[0]], conv))
                nodes.append(_node("ReorderInput", [nodes[-1].outputs[0]], conv, domain=NCHWC, channels_last=1))
            reordered = nodes[-1].outputs[0]
            nodes.append(_node("ReorderInput", [x], conv, domain=NCHWC, channels_last=0))
            x_in = nodes[-1].outputs[0]
        else:
            reordered, x_in = nodes[-1].outputs[0], x
        nodes.append(_ints([co, ci, kh, kw]))
        nodes.append(_node("Reshape", [reordered, nodes[-1].outputs[0]], conv))
        blocked = _node("Conv", [x_in, nodes[-1].outputs[0], *([bias] if bias is not None else [])], conv,
                        domain=NCHWC, name=f"{conv.name or 'conv'}{BLOCKED_SUFFIX}")
        for name in ("pads", "strides", "dilations", "kernel_shape"):
            if name in attrs:
                blocked.attributes[name] = attrs[name]
        nodes.append(blocked)
        nodes.append(_node("ReorderOutput", [blocked.outputs[0]], conv, domain=NCHWC, channels_last=0, channels=co))
        _replace(graph, conv, nodes, nodes[-1].outputs[0])
        rewritten += 1
    if rewritten:
        model.opset_imports[NCHWC] = 1
    return rewritten


# Note [One Slice for a window]
# A window of a tensor, ``x[:, :, a:b:s, c:d:s]`` (the patches of a convolution's weight gradient:
# Note [Convolution gradients as GEMMs] in ``ortlab.capture.decompositions``), is two ``aten.slice``
# ops, one per axis, exported as a ``Slice`` of a ``Slice``: the first copies every row the window
# touches, the second copies the window out of that copy. One ``Slice`` over both axes copies the
# window once, from the input. Along different axes the two slices are independent (each axis
# keeps its length through the other), so the one ``Slice`` takes both lists of starts, ends, axes
# and steps as they are: the same elements, bit for bit. The first ``Slice`` stays where something
# else reads it. ResNet-18's backward (onnxruntime's profiler, per step, medians of 3 windows):
# Slice kernels 14.0 -> 12.5 ms at batch 16 of 64x64 images, 14.9 -> 12.4 ms at batch 4 of
# 160x160; the whole step moved within its noise (0.995x and 1.041x in two runs of
# ``benchmarks/cpu_rewrites.py --model resnet18 --batch 4 --size 160 --only slices``).


def _int_list(value: ir.Value | None) -> list[int] | None:
    """The integers of a constant 1-D operand, else ``None``."""
    array = _constant(value)
    if array is None or array.ndim != 1 or array.dtype.kind not in "iu":
        return None
    return [int(v) for v in array]


def _slice_lists(node: ir.Node, rank: int | None) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """A ``Slice``'s starts, ends, non-negative axes and steps, all constant; ``None`` where one is not (or the
    input's ``rank`` is unknown where an axis counts from the end)."""
    inputs = [*node.inputs, None, None][:5]
    starts, ends = _int_list(inputs[1]), _int_list(inputs[2])
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    axes = list(range(len(starts))) if inputs[3] is None else _int_list(inputs[3])
    steps = [1] * len(starts) if inputs[4] is None else _int_list(inputs[4])
    if axes is None or steps is None or len(axes) != len(starts) or len(steps) != len(starts) or 0 in steps:
        return None
    if any(a < 0 for a in axes):
        if rank is None:
            return None
        axes = [a + rank if a < 0 else a for a in axes]
    return starts, ends, axes, steps


def merged_slices(model: ir.Model) -> int:
    """Rewrite the top graph's ``Slice`` nodes of a ``Slice`` along other axes as one ``Slice`` of its input
    (Note [One Slice for a window]); returns how many."""
    graph = model.graph
    merged = 0
    for outer in list(graph):
        if outer.op_type != "Slice" or outer.domain not in ("", "ai.onnx") or outer.inputs[0] is None:
            continue
        inner = outer.inputs[0].producer()
        if inner is None or inner.op_type != "Slice" or inner.domain not in ("", "ai.onnx"):
            continue
        shape = inner.inputs[0].shape if inner.inputs[0] is not None else None
        rank = len(shape) if shape is not None else None  # a Slice keeps its input's rank
        first, second = _slice_lists(inner, rank), _slice_lists(outer, rank)
        if first is None or second is None or set(first[2]) & set(second[2]):
            continue
        lists = [_ints(a + b) for a, b in zip(first, second)]
        one = _node("Slice", [inner.inputs[0], *(n.outputs[0] for n in lists)], outer,
                    name=f"{outer.name or 'slice'}{MERGED_SUFFIX}")
        _replace(graph, outer, [*lists, one], one.outputs[0])
        if not inner.outputs[0].uses() and not inner.outputs[0].is_graph_output():
            graph.remove(inner, safe=True)
        merged += 1
    return merged


# Note [GELU in one kernel]
# torchlib writes the exact GELU as ``x * (0.5 * (1 + erf(x / sqrt(2))))``, five elementwise
# passes (Div, Erf, Add, Mul, Mul) over the MLP's widest activation, and the tanh approximation
# (``approximate="tanh"``) as eight. onnxruntime has one-pass kernels for both (com.microsoft
# ``Gelu`` and ``FastGelu``), and its own GeluFusion (level extended and up) puts ``Gelu`` in
# place of ``(x * (1 + erf(x / sqrt(2)))) * 0.5``, but not of torchlib's order, so the exported
# GELUs stayed five kernels. onnxscript's rewrite rules for onnxruntime match torchlib's forms
# (``onnxscript.rewriter.ort_fusions``: ``erfgelu`` and ``gelu``), so the rewrite applies those,
# for float32 GELUs only (the CPU provider's kernels are float's), their constants matched
# exactly (a GELU written with 0.5 one ulp off, or sqrt(2) as 1.41421, stays as written; Note
# [Pattern constants matched exactly] in ortlab._compat.onnxscript). A fused node is named after
# its FX node, ``node_gelu_one_gelu`` (the report finds it so in a cached model), and keeps the
# exported node's provenance (the rules copy its metadata): kernel tables and netron links show
# the model's line.
#
# The kernels compute with their own erf and tanh, within a few ulps of the exported nodes
# (relative 3.5e-7 on the GPT's forward). The GPT's forward (d=256, 4 layers, [8, 128, 1024]
# GELUs), AMD EPYC with AVX-512, 2 threads: ~0.75 ms a GELU in five kernels, 0.38 ms in one
# (onnxruntime's profiler); whole steps 1.002-1.030x (GPT), 1.012x (GPT-2-small-sized) and 1.014x (the
# BERT-base-sized encoder without dropout, 12 GELUs of [8, 128, 3072]): within their noise, as the kernel
# times say (~1 ms saved a GELU of 3.1M elements), measured
# with ``benchmarks/cpu_rewrites.py --only gelus``. The gradient (``gelu_backward``) stays as
# exported: the standard onnxruntime wheel has no GeluGrad kernel. OpenVINO gets the graph as
# exported: these rewrites are the CPU provider's.
_GELU_OPS = ("Gelu", "FastGelu")
_GELU_RULES: list = []


def _gelu_rules():  # noqa: ANN202 (an onnxscript RewriteRuleSet, or None)
    """onnxscript's GELU rules for onnxruntime, each for float32 inputs only; None where this onnxscript has none."""
    if not _GELU_RULES:
        try:
            from onnxscript.rewriter import pattern
            from onnxscript.rewriter.ort_fusions import erfgelu, gelu
        except ImportError as e:  # a future onnxscript that moved them: GELUs stay as exported
            logger.info("ortlab: onnxscript's GELU rules are not importable here (%s)", first_line(e))
            _GELU_RULES.append(None)
            return None

        def float32(context, x, **_):  # noqa: ANN001, ANN202, ARG001
            return x.dtype == ir.DataType.FLOAT

        tanh = gelu.GeluTanhFusion()
        rules = [pattern.RewriteRule(erfgelu.erf_gelu_pattern_1, erfgelu.gelu, float32),
                 pattern.RewriteRule(erfgelu.erf_gelu_pattern_2, erfgelu.gelu, float32),
                 pattern.RewriteRule(tanh.pattern, tanh.rewrite, float32)]
        # their 0.5, 1, sqrt(2), 0.044715 and sqrt(2/pi) matched exactly (Note [Pattern constants matched exactly])
        rules = exact_rules(rules)
        _GELU_RULES.append(pattern.RewriteRuleSet(rules) if rules else None)
    return _GELU_RULES[0]


def fused_gelus(model: ir.Model) -> int:
    """Replace the graph's float32 GELUs as torchlib writes them by onnxruntime's one-pass kernels
    (Note [GELU in one kernel]); returns how many."""
    rules = _gelu_rules()
    if rules is None:
        return 0
    fused = rules.apply_to_model(model)
    if fused:
        taken = {node.name for node in model.graph.all_nodes()}
        for node in model.graph.all_nodes():
            if node.domain == "com.microsoft" and node.op_type in _GELU_OPS and not node.name.endswith(GELU_SUFFIX):
                # named as the exporter names the FX node's last node (node_gelu), where that name is free
                fx_node = node.metadata_props.get("ortlab.fx_node")
                name = f"node_{fx_node}{GELU_SUFFIX}" if fx_node else ""
                node.name = name if name and name not in taken else f"{node.name or 'gelu'}{GELU_SUFFIX}"
                taken.add(node.name)
        # the GELUs' constants, now read by nothing (onnxruntime would warn as it removed them)
        ir.passes.common.RemoveUnusedNodesPass()(model)
    return fused


# Note [A max pool's plane offsets]
# ONNX's MaxPool numbers its indices across the whole tensor ((n * C + c) * H * W + ...), PyTorch's
# within each plane. torchlib's ``max_pool2d_with_indices`` takes the difference from a second
# MaxPool, a 1x1 one over the whole input whose indices are those positions, sliced to the
# first of each plane, [N, C, 1, 1]: a pass over the pool's input (ResNet-18's stem, [16, 64,
# 32, 32]: 1.76 ms a step of a 3.5 ms pool, AMD EPYC with AVX-512) for a tensor that only the
# input's shape decides. Where the shape is static and the 1x1 pool's values are unused, the
# slices of its indices become the constants they always are (``np.arange`` sliced alike), as a
# constant folding would if the folder could see through a MaxPool: no decision, nothing to
# report. Small results only (a slice of more than 65,536 offsets stays computed); the positions
# are built per axis, never for the whole input.
_MAX_OFFSETS = 1 << 16


def _is_one_by_one(pool: ir.Node) -> bool:
    """A MaxPool whose window is one element, stride 1, no padding or dilation: its indices are the positions."""
    attrs = pool.attributes
    kernel = attrs["kernel_shape"].as_ints() if "kernel_shape" in attrs else []
    return (bool(kernel) and all(k == 1 for k in kernel) and _ints_of(attrs, "strides", 1)
            and _ints_of(attrs, "pads", 0) and _ints_of(attrs, "dilations", 1)
            and ("storage_order" not in attrs or attrs["storage_order"].as_int() == 0)
            and ("auto_pad" not in attrs or attrs["auto_pad"].as_string() in ("NOTSET", "")))


def _positions(shape: list[int], lists: tuple[list[int], ...]) -> np.ndarray | None:
    """``np.arange(prod(shape)).reshape(shape)`` sliced by a Slice's constant ``lists``, built from each axis's
    own positions (the input can be large; the slice is small), or ``None`` above ``_MAX_OFFSETS`` elements."""
    window = [slice(None)] * len(shape)
    for start, end, axis, step in zip(*lists):
        window[axis] = slice(start, end, step)
    kept = [np.arange(size, dtype=np.int64)[w] for size, w in zip(shape, window)]
    if math.prod(len(k) for k in kept) > _MAX_OFFSETS:
        return None
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    result = np.zeros([len(k) for k in kept], dtype=np.int64)
    for axis, (k, stride) in enumerate(zip(kept, strides)):
        result += (k * stride).reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return result


def pool_offsets(model: ir.Model) -> int:
    """Replace the slices of a 1x1 ``MaxPool``'s indices with the constants they are (Note [A max pool's plane
    offsets]); returns how many pools went."""
    graph = model.graph
    gone = 0
    for pool in list(graph):
        if (pool.op_type != "MaxPool" or pool.domain not in ("", "ai.onnx") or len(pool.outputs) != 2
                or pool.inputs[0] is None or not _is_one_by_one(pool)):
            continue
        values, indices = pool.outputs
        shape = pool.inputs[0].shape
        if (values.uses() or values.is_graph_output() or indices.is_graph_output() or shape is None
                or not all(isinstance(d, int) for d in shape)):
            continue
        slices = [use.node for use in indices.uses()]
        if not slices or any(n.op_type != "Slice" or n.domain not in ("", "ai.onnx") or n.inputs[0] is not indices
                             for n in slices):
            continue
        results = []
        for node in slices:
            lists = _slice_lists(node, len(shape))
            if lists is None or any(step <= 0 for step in lists[3]):
                break
            result = _positions(shape, lists)
            if result is None:
                break
            results.append(result)
        if len(results) != len(slices):
            continue
        for node, result in zip(slices, results):
            const = _node("Constant", [], node, value=ir.tensor(np.ascontiguousarray(result)))
            _replace(graph, node, [const], const.outputs[0])
        graph.remove(pool, safe=True)
        gone += 1
    return gone


# Note [Input gradients as blocked convolutions]
# ortlab writes a convolution's input gradient as a GEMM and a ``Col2Im`` (Note [Convolution gradients
# as GEMMs] in ``ortlab.capture.decompositions``). With stride 1 and no dilation it is also a plain
# convolution of dY with the weight's channels swapped and its taps flipped, padded by k-1-p, which
# the blocked layout then runs (Note [Convolutions in the blocked layout]) with MLAS's direct NCHWc
# kernels. onnxruntime sessions alone, batch 16, 3x3 (AMD EPYC Zen 4, 2 threads; Col2Im path against
# the blocked convolution, medians of 30): 16x16 images with 64 channels 2.70-2.79 -> 1.53-1.81 ms;
# 8x8 with 128, 2.35-2.39 -> 1.99-2.21; 4x4 with 256, 2.38-2.46 -> 3.35-3.49; 2x2 with 512,
# 2.9-3.1 -> 10.4-18.8 ms (the weight's reorder outweighs the work). So only images of at least
# 16x16 (``MIN_DGRAD_POSITIONS``) are rewritten. The sums are the same products in another order
# (float32 differences of ~1e-6 relative).
MIN_DGRAD_POSITIONS = 256
_INT64_MIN = -(2**63)


def _attr_ints(node: ir.Node, name: str, default: list[int]) -> list[int]:
    return list(node.attributes[name].as_ints()) if name in node.attributes else default


def input_gradients(model: ir.Model, block: int) -> int:
    """Rewrite the top graph's stride-1 convolution input gradients (``Col2Im`` of a GEMM) on images of at least
    ``MIN_DGRAD_POSITIONS`` positions as convolutions that the blocked layout then runs (Note [Input gradients as
    blocked convolutions]); returns how many."""
    graph = model.graph
    done = 0
    for col2im in list(graph):
        if col2im.op_type != "Col2Im" or col2im.domain not in ("", "ai.onnx") or len(col2im.inputs) != 3:
            continue
        chain = [col2im]
        for op in ("Transpose", "Reshape", "MatMul", "Transpose"):
            value = chain[-1].inputs[0]
            found = value.producer() if value is not None else None
            if found is None or found.op_type != op or found.domain not in ("", "ai.onnx"):
                break
            chain.append(found)
        if len(chain) != 5:
            continue
        _, turn, _, matmul, wt = chain
        if _attr_ints(turn, "perm", []) != [1, 0, 2] or _attr_ints(wt, "perm", []) != [1, 0]:
            continue
        image, taps = _constant(col2im.inputs[1]), _constant(col2im.inputs[2])
        w, dy, out = wt.inputs[0], matmul.inputs[1], col2im.outputs[0]
        if image is None or taps is None or image.shape != (2,) or taps.shape != (2,):
            continue
        if any(v is None or v.shape is None or not all(isinstance(d, int) for d in v.shape) for v in (w, dy, out)):
            continue
        if w.dtype != ir.DataType.FLOAT or len(w.shape) != 2 or len(dy.shape) != 2 or len(out.shape) != 4:
            continue
        (h, wd), (kh, kw) = (int(v) for v in image), (int(v) for v in taps)
        pt, pl, pb, pr = _attr_ints(col2im, "pads", [0, 0, 0, 0])
        if _attr_ints(col2im, "strides", [1, 1]) != [1, 1] or _attr_ints(col2im, "dilations", [1, 1]) != [1, 1]:
            continue
        n, c = out.shape[0], out.shape[1]
        co, ckk = w.shape
        ho, wo = h + pt + pb - kh + 1, wd + pl + pr - kw + 1
        if (ckk != c * kh * kw or dy.shape[0] != co or dy.shape[1] != n * ho * wo or ho * wo < MIN_DGRAD_POSITIONS
                or max(pt, pb) > kh - 1 or max(pl, pr) > kw - 1 or co % block or (c % block and c >= block)):
            continue
        nodes: list[ir.Node] = []
        # dY as [N, Co, Ho, Wo]: the exported [Co, N*Ho*Wo] is mostly a reshaped transpose of it.
        flat = dy.producer()
        turned = flat.inputs[0].producer() if flat is not None and flat.op_type == "Reshape" else None
        if (turned is not None and turned.op_type == "Transpose" and _attr_ints(turned, "perm", []) == [1, 0, 2, 3]
                and turned.inputs[0].shape is not None and list(turned.inputs[0].shape) == [n, co, ho, wo]):
            dy4 = turned.inputs[0]
        else:
            nodes.append(_ints([co, n, ho, wo]))
            nodes.append(_node("Reshape", [dy, nodes[-1].outputs[0]], col2im))
            nodes.append(_node("Transpose", [nodes[-1].outputs[0]], col2im, perm=[1, 0, 2, 3]))
            dy4 = nodes[-1].outputs[0]
        # The weight [Co, C*kh*kw] as [C, Co, kh, kw], its taps flipped (a Slice with steps -1).
        shape4 = _ints([co, c, kh, kw])
        weight4 = _node("Reshape", [w, shape4.outputs[0]], col2im)
        swapped = _node("Transpose", [weight4.outputs[0]], col2im, perm=[1, 0, 2, 3])
        starts, ends, axes, steps = (_ints(v) for v in ([-1, -1], [_INT64_MIN, _INT64_MIN], [2, 3], [-1, -1]))
        flipped = _node("Slice", [swapped.outputs[0], *(v.outputs[0] for v in (starts, ends, axes, steps))], col2im)
        nodes += [shape4, weight4, swapped, starts, ends, axes, steps, flipped]
        for made, shape in ((weight4, [co, c, kh, kw]), (swapped, [c, co, kh, kw]), (flipped, [c, co, kh, kw])):
            made.outputs[0].shape, made.outputs[0].dtype = ir.Shape(shape), ir.DataType.FLOAT  # the blocking reads them
        if dy4.shape is None:
            dy4.shape, dy4.dtype = ir.Shape([n, co, ho, wo]), ir.DataType.FLOAT
        conv = _node("Conv", [dy4, flipped.outputs[0]], col2im, name=f"{col2im.name or 'col2im'}{DGRAD_SUFFIX}",
                     pads=[kh - 1 - pt, kw - 1 - pl, kh - 1 - pb, kw - 1 - pr], kernel_shape=[kh, kw])
        nodes.append(conv)
        conv.outputs[0].shape, conv.outputs[0].dtype = out.shape, out.dtype
        _replace(graph, col2im, nodes, conv.outputs[0])
        for i, made in enumerate(nodes[:-1]):  # names of their own: the blocking names its nodes after the Conv's
            made.outputs[0].name = f"{conv.outputs[0].name}_dgrad{i}"
        done += 1
    if done:  # the GEMMs and reshapes the Col2Ims read
        ir.passes.common.RemoveUnusedNodesPass()(model)
    return done


# Note [Per-channel operands over small planes]
# onnxruntime's CPU broadcast of a per-channel operand ``[1, C, 1, 1]`` against ``[N, C, H, W]`` runs
# one span of H*W elements at a time, and a span's own cost dominates where the planes are small:
# a batch norm's ``x - mean`` on ResNet-18's ``[16, 512, 2, 2]`` took 170 us, against 15 us for one
# pass over the same tensor. With the operand expanded first to ``[1, C, H, W]`` (an ``Expand`` of
# C*H*W elements) the op broadcasts along the batch only, in N spans of C*H*W: 43 us (``[16, 256,
# 4, 4]``: 104 -> 40 us, ``[16, 128, 8, 8]``: 73 -> 58 us; at 16x16 the expanded form is slower,
# 44 -> 58 us; AMD EPYC Zen 4, 2 threads). So Add, Sub, Mul and Div whose smaller operand varies in
# leading dims only, and is broadcast over trailing dims of at most ``MAX_BROADCAST_SPAN`` elements
# against a full-shaped float operand, take that operand expanded over those trailing dims, once
# per operand however many ops read it: the same elements meet in the same op, so the result is
# bit for bit the same. Batch norm's forward and backward on the small feature maps of every CNN
# are such ops. In a training graph an Expand costs ~20 us, so 8x8 planes (spans of 64) gained
# nothing: with them ResNet-18's step was 0.998x; with spans up to 16 it is 1.038-1.040x
# (``python benchmarks/cpu_rewrites.py --model resnet18 --only broadcasts``).
MAX_BROADCAST_SPAN = 16
_BROADCAST_OPS = ("Add", "Sub", "Mul", "Div")


def expanded_broadcasts(model: ir.Model) -> int:
    """Give the top graph's elementwise ops over small planes their per-channel operand expanded (Note
    [Per-channel operands over small planes]); returns how many."""
    graph = model.graph
    done = 0
    expanded: dict[tuple[int, tuple[int, ...]], ir.Value] = {}  # one Expand per operand and shape
    for node in list(graph):
        if node.op_type not in _BROADCAST_OPS or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        if a is None or b is None or a.dtype not in _FLOATS or b.dtype != a.dtype:
            continue
        shapes = [v.shape for v in (a, b)]
        if any(sh is None or not all(isinstance(d, int) for d in sh) for sh in shapes):
            continue
        sa, sb = (list(sh) for sh in shapes)
        if len(sa) == len(sb) and sa == sb:
            continue
        big, small = (0, 1) if math.prod(sa) >= math.prod(sb) else (1, 0)
        full, part = (sa, sb) if big == 0 else (sb, sa)
        part = [1] * (len(full) - len(part)) + part
        if len(part) != len(full) or any(p not in (1, f) for p, f in zip(part, full)):
            continue  # not a plain broadcast of the smaller operand against a full-shaped one
        last = max((i for i, p in enumerate(part) if p != 1), default=None)
        if last is None or last == len(full) - 1:
            continue  # a scalar, or an operand that varies along the last dim: long spans already
        span = math.prod(full[last + 1:])
        target = part[:last + 1] + full[last + 1:]
        if span > MAX_BROADCAST_SPAN or math.prod(target) * 2 > math.prod(full):
            continue
        operand = node.inputs[small]
        key = (id(operand), tuple(target))
        if key not in expanded:
            shape = _ints(target)
            expand = _node("Expand", [operand, shape.outputs[0]], node, name=f"{node.name or node.op_type}{EXPAND_SUFFIX}")
            expand.outputs[0].name = f"{node.outputs[0].name}{EXPAND_SUFFIX}"
            expand.outputs[0].dtype, expand.outputs[0].shape = a.dtype, ir.Shape(target)
            graph.insert_before(node, [shape, expand])
            expanded[key] = expand.outputs[0]
        node.replace_input_with(small, expanded[key])
        done += 1
    return done
