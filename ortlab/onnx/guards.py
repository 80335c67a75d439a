"""Guards: PyTorch's errors for inputs onnxruntime would silently accept or refuse with its own message.

Note [Index guards]
ONNX's ``Gather`` and ``GatherElements`` count a negative index from the end, and
onnxruntime answers an index past the end with its own ``INVALID_ARGUMENT``. PyTorch
raises instead: ``embedding`` and ``index_select`` want ``0 <= i < n`` (``IndexError:
index out of range in self``), ``gather`` too (``RuntimeError: index -1 is out of
bounds ...``), advanced indexing ``x[idx]`` wants ``-n <= i < n``, and a loss's target
``0 <= t < C`` or ``ignore_index`` (``IndexError: Target -1 is out of bounds.``). Through
onnxruntime, ``nn.Embedding(10, 4)(tensor([1, 2, -1]))`` returned row 9 and
``F.cross_entropy`` with a target of -1 returned a loss: silently wrong. Ops that write at
their indices (``scatter``, ``scatter_add``, ``scatter_reduce``, ``x[idx] = v``, ``index_add``,
``index_copy``) wrote a negative index's values into a row from the end.

So the exporter gives each such op of a forward or no-grad graph a guard: an extra
int64 output ``[min index, max index, size]`` (three reductions over the index tensor,
a few microseconds), and the runner checks it after each run and raises the error
PyTorch raises before anything is returned (:func:`check`). The op itself reads its
index clipped into range (a ``Clip``, which changes nothing for valid indices), so an
index past the end cannot stop the run with onnxruntime's own error before the guard
is read. A loss's target reaches
``gather`` through torch's ``nll_loss`` decomposition with ignored positions already
replaced by 0; the node remembers it came from ``nll_loss`` (``original_aten``), so
the error is the loss's. Backward graphs need no guards: their indices were checked
in the forward.

Note [Value guards]
Other inputs PyTorch refuses depend on values, not indices: an integer division or modulo by
zero (``RuntimeError: ZeroDivisionError``; onnxruntime stopped the run with "Integer division by
zero" or "Integer modulo by zero"), and every check a decomposition states as
``torch._assert_async(cond, message)``: ``binary_cross_entropy``'s "all elements of input should be
between 0 and 1" and "... of target ..." (``ortlab.capture.decompositions``; through onnxruntime a
target of 2 gave a loss), or one the model makes itself. They are guards of the same kind, read
by the same checks (:func:`check`, :func:`check_on_device`, ``ortlab.ondevice``): the guard output
is ``[0, violations, 1]``, so the range test ``0 <= low`` and ``high < size`` fails exactly where
something violated the rule, and the message is PyTorch's. The op itself must not fail first:
the integer divisions divide by 1 where the divisor is 0 (Note [Integer arithmetic stays integer]
in ``ortlab.torchlib.integers``), and ``_assert_async`` translates to nothing. A division whose
result has no elements divides nothing and raises nothing, as in PyTorch. Value guards go into
every graph, backward graphs too: dropping an ``_assert_async`` or dividing by 1 in silence would
be wrong there as anywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import torch
import torch.fx

from ortlab._compat.torch import assert_on_device
from ortlab._index_guards import IndexGuard, check  # torch-free: ortlab.ondevice checks them too
from ortlab.provenance import module_path, op_name, source_line

__all__ = ["IndexGuard", "add_guards", "add_index_guards", "check", "check_on_device", "prepare_guards"]

_LOSSES = ("aten.nll_loss_forward", "aten.nll_loss2d_forward")


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _specs(node: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.Node, int, str, str, str]]:
    """(data, index, dim, lowest, error, message) of each index ``node`` reads, none for other ops."""
    name = op_name(node)
    args = node.args
    if name == "aten.embedding":
        return [(args[0], args[1], 0, "0", "IndexError", "index out of range in self")]
    if name == "aten.index_select":
        return [(args[0], args[2], args[1], "0", "IndexError", "index out of range in self")]
    if name == "aten.gather":
        original = node.meta.get("original_aten")
        if original is not None and op_name_of(original) in _LOSSES:
            return [(args[0], args[2], args[1], "0", "IndexError", "Target {index} is out of bounds.")]
        return [(args[0], args[2], args[1], "0", "RuntimeError",
                 "index {index} is out of bounds for dimension {dim} with size {size}")]
    if name in _SCATTERS:
        return [(args[0], args[2], args[1], "0", "RuntimeError",
                 "index {index} is out of bounds for dimension {dim} with size {size}")]
    if name in ("aten.index", "aten.index_put", "aten._unsafe_index_put") and len(args) > 1:
        original = node.meta.get("original_aten")
        origin = op_name_of(original) if original is not None else ""
        lowest, error, message = _WRITES_FROM.get(origin, ("-size", "IndexError", _OUT_OF_BOUNDS))
        out = []
        for d, index in enumerate(args[1]):
            if isinstance(index, torch.fx.Node) and _is_integer(index):
                out.append((args[0], index, d, lowest, error, message))
        return out
    return []


_OUT_OF_BOUNDS = "index {index} is out of bounds for dimension {dim} with size {size}"
# Ops that write at their indices (``scatter``'s family; ``index_put`` below): PyTorch raises for any index
# outside ``[0, size)`` (``index_put``: ``[-size, size)``); ONNX's ScatterElements and ScatterND count a
# negative one from the end, silently, and answer one past the end with onnxruntime's own error.
_SCATTERS = frozenset({"aten.scatter", "aten.scatter_add", "aten.scatter_reduce"})
# ``index_put`` nodes that torch's decompositions made of ops that forbid negative indices.
_WRITES_FROM = {
    "aten.index_add": ("0", "RuntimeError", _OUT_OF_BOUNDS),
    "aten.index_copy": ("0", "IndexError", "index_copy_(): " + _OUT_OF_BOUNDS),
}


def op_name_of(target: Any) -> str:
    """``aten.nll_loss_forward`` for an OpOverload (``node.meta["original_aten"]``)."""
    return f"{getattr(target, 'namespace', '')}.{getattr(target, '_opname', str(target))}"


def _is_integer(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and val.dtype != torch.bool \
        and not val.is_complex()


def _const(values: list[int], name: str) -> ir.Node:
    return ir.node("Constant", [], attributes={"value": ir.tensor(np.array(values, dtype=np.int64), name=name)})


def prepare_guards(gm: torch.fx.GraphModule) -> None:
    """Give each ``_assert_async`` node the (empty) example value torch.onnx's translator types outputs by: it
    returns nothing, and its condition becomes a guard (Note [Value guards])."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) == "aten._assert_async" and node.meta.get("val") is None:
            node.meta["val"] = ()


def add_guards(gm: torch.fx.GraphModule, graph: ir.Graph, values: dict[str, Any], indices: bool = True) -> list[IndexGuard]:
    """Add a guard output to ``graph`` for each index an op of ``gm`` reads (where ``indices``: forward and
    no-grad graphs, Note [Index guards]) and for each value rule (every graph, Note [Value guards])."""
    guards: list[IndexGuard] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for message, violations in _value_rules(node, values):
            k = len(guards)
            zero, one = _const([0], f"ortlab_guard_{k}_zero"), _const([1], f"ortlab_guard_{k}_one")
            out = ir.node("Concat", [zero.outputs[0], violations[-1].outputs[0], one.outputs[0]], attributes={"axis": 0})
            guards.append(_append(graph, node, [*violations, zero, one, out], out, k, "0", "RuntimeError", message, 0))
        if not indices:
            continue
        for data, index, dim, lowest, error, message in _specs(node):
            data_value, index_value = values.get(getattr(data, "name", "")), values.get(getattr(index, "name", ""))
            data_val = data.meta.get("val") if isinstance(data, torch.fx.Node) else None
            if not isinstance(data_value, ir.Value) or not isinstance(index_value, ir.Value) or \
                    not isinstance(data_val, torch.Tensor) or not _is_integer(index):
                continue
            k = len(guards)
            if data_val.dim() == 0:  # PyTorch indexes a 0-dim tensor as one of size 1 along dim 0 (or -1)
                dim = 0
                size = _const([1], f"ortlab_guard_{k}_size")
            else:
                dim = _dim(int(dim), data_val.dim())
                size = ir.node("Shape", [data_value], attributes={"start": dim, "end": dim + 1})
            as_int64 = ir.node("Cast", [index_value], attributes={"to": ir.DataType.INT64})
            shape = _const([-1], f"ortlab_guard_{k}_flat")
            flat = ir.node("Reshape", [as_int64.outputs[0], shape.outputs[0]])
            low = ir.node("ReduceMin", [flat.outputs[0]], attributes={"keepdims": 1})
            high = ir.node("ReduceMax", [flat.outputs[0]], attributes={"keepdims": 1})
            out = ir.node("Concat", [low.outputs[0], high.outputs[0], size.outputs[0]], attributes={"axis": 0})
            nodes = [as_int64, shape, flat, low, high, size, out]
            nodes += _clip_for(node, index_value, as_int64.outputs[0], size.outputs[0], lowest, index, k)
            guards.append(_append(graph, node, nodes, out, k, lowest, error, message, dim))
    return guards


def add_index_guards(gm: torch.fx.GraphModule, graph: ir.Graph, values: dict[str, Any]) -> list[IndexGuard]:
    """:func:`add_guards` of a forward or no-grad graph: index guards and value guards."""
    return add_guards(gm, graph, values, indices=True)


def _append(graph: ir.Graph, node: torch.fx.Node, nodes: list[ir.Node], out: ir.Node, k: int, lowest: str,
            error: str, message: str, dim: int) -> IndexGuard:
    """Add ``nodes`` to ``graph``, the output of ``out`` (one of them: ``[low, high, size]``) as guard ``k``."""
    for i, n in enumerate(nodes):
        n.name = f"ortlab_guard_{k}_{i}_{n.op_type}"
        n.metadata_props.update({"ortlab.fx_node": node.name, "ortlab.op": op_name(node),
                                 "ortlab.module": module_path(node), "ortlab.source": source_line(node)})
    graph.extend(nodes)
    result = out.outputs[0]
    result.name = f"ortlab_guard_{k}"
    result.dtype, result.shape = ir.DataType.INT64, ir.Shape([3])
    graph.outputs.append(result)
    original = node.meta.get("original_aten")
    op = op_name_of(original) if op_name(node) == "aten._assert_async" and original is not None else op_name(node)
    where = f"{op} at {module_path(node) or '<root>'}"
    if source_line(node):
        where += f", {source_line(node)}"
    return IndexGuard(result.name, lowest, error, message, dim, where)


# Integer ops that raise PyTorch's ZeroDivisionError for a zero divisor (``div`` only when it rounds).
_DIVISIONS = frozenset({"aten.floor_divide", "aten.remainder", "aten.fmod"})
_ZERO_DIVISION = "ZeroDivisionError"
_ASSERT = "Expected Tensor with single nonzero value, but got zero"  # ``_assert_async`` without a message


def _divisor(node: torch.fx.Node) -> object:
    """The divisor of an integer division or modulo ``node`` (a node or a number); None for other ops."""
    name = op_name(node)
    if name == "aten.div":
        if node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None) is None:
            return None
    elif name not in _DIVISIONS:
        return None
    if not _is_integer(node) or len(node.args) < 2:
        return None
    return node.args[1]


def _value_rules(node: torch.fx.Node, values: dict[str, Any]) -> list[tuple[str, list[ir.Node]]]:
    """(PyTorch's message, nodes whose last output is ``[violations]``) of each rule ``node`` must keep
    (Note [Value guards])."""
    name = op_name(node)
    if name == "aten._assert_async":
        cond = values.get(getattr(node.args[0], "name", "")) if node.args else None
        if not isinstance(cond, ir.Value):
            return []
        message = node.args[1] if len(node.args) > 1 else node.kwargs.get("assert_msg", _ASSERT)
        holds = ir.node("Cast", [cond], attributes={"to": ir.DataType.BOOL})
        failed = ir.node("Not", [holds.outputs[0]])
        return [(str(message), [holds, failed, *_count(failed.outputs[0], f"ortlab_assert_{node.name}")])]
    divisor = _divisor(node)
    if divisor is None:
        return []
    result = values.get(node.name)
    if isinstance(divisor, torch.fx.Node):
        value = values.get(divisor.name)
        if not isinstance(value, ir.Value):
            return []
        as_int64 = ir.node("Cast", [value], attributes={"to": ir.DataType.INT64})
        zero = _const([0], f"ortlab_divisor_{node.name}_zero")
        is_zero = ir.node("Equal", [as_int64.outputs[0], zero.outputs[0]])
        nodes = [as_int64, zero, is_zero, *_count(is_zero.outputs[0], f"ortlab_divisor_{node.name}")]
    elif isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and divisor == 0:
        nodes = [_const([1], f"ortlab_divisor_{node.name}_zero")]
    else:
        return []
    if isinstance(result, ir.Value):  # nothing divided: nothing raised
        size = ir.node("Size", [result])
        zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0, dtype=np.int64),
                                                                        name=f"ortlab_divided_{node.name}_zero")})
        nonempty = ir.node("Greater", [size.outputs[0], zero.outputs[0]])
        some = ir.node("Cast", [nonempty.outputs[0]], attributes={"to": ir.DataType.INT64})
        violations = ir.node("Mul", [nodes[-1].outputs[0], some.outputs[0]])
        nodes += [size, zero, nonempty, some, violations]
    return [(_ZERO_DIVISION, nodes)]


def _count(flags: ir.Value, name: str) -> list[ir.Node]:
    """Nodes counting the True ``flags`` into an int64 ``[count]``."""
    as_int64 = ir.node("Cast", [flags], attributes={"to": ir.DataType.INT64})
    shape = _const([-1], f"{name}_flat")
    flat = ir.node("Reshape", [as_int64.outputs[0], shape.outputs[0]])
    count = ir.node("ReduceSum", [flat.outputs[0]], attributes={"keepdims": 1})
    return [as_int64, shape, flat, count]


_ONNX_INT = {torch.int64: ir.DataType.INT64, torch.int32: ir.DataType.INT32, torch.int16: ir.DataType.INT16,
             torch.int8: ir.DataType.INT8, torch.uint8: ir.DataType.UINT8}


def _clip_for(fx_op: torch.fx.Node, index_value: ir.Value, as_int64: ir.Value, size: ir.Value, lowest: str,
              index: torch.fx.Node, k: int) -> list[ir.Node]:
    """Nodes giving ``fx_op``'s own ONNX nodes its index clipped into ``[lowest, size - 1]``."""
    users = [(use.node, use.idx) for use in list(index_value.uses()) if use.node.meta.get("node") is fx_op]
    if not users:
        return []
    size_s = ir.node("Squeeze", [size])
    one = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(1, dtype=np.int64), name=f"ortlab_guard_{k}_one")})
    hi = ir.node("Sub", [size_s.outputs[0], one.outputs[0]])
    if lowest == "-size":
        lo = ir.node("Neg", [size_s.outputs[0]])
    else:
        lo = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0, dtype=np.int64), name=f"ortlab_guard_{k}_zero")})
    clip = ir.node("Clip", [as_int64, lo.outputs[0], hi.outputs[0]])
    nodes = [size_s, one, hi, lo, clip]
    clipped = clip.outputs[0]
    dtype = index.meta["val"].dtype
    if dtype != torch.int64:
        back = ir.node("Cast", [clipped], attributes={"to": _ONNX_INT.get(dtype, ir.DataType.INT64)})
        nodes.append(back)
        clipped = back.outputs[0]
    for user, position in users:
        user.replace_input_with(position, clipped)
    return nodes


# Note [Index guards on CUDA]
# Reading a guard on the host (``check``) waits for the GPU: after every forward, the host stopped until
# the forward's kernels had run, so it could not queue the next ones meanwhile. (On an H200 a GPT-2-sized
# step showed one device-to-host copy of ~13 ms a step, about its forward's GPU time; a guard read after
# the forward is such a wait, though it was not measured apart.) Eager PyTorch checks indices on the GPU,
# without waiting: an index out of range there is
# a device-side assert that a later CUDA call reports. On CUDA the guards do the same: each becomes
# an asynchronous assert of its range test, queued behind the run; the error is the device-side
# assert eager gives, with the op and model line in its message, not PyTorch's CPU IndexError.


def check_on_device(guards: list[IndexGuard], results: list[torch.Tensor]) -> None:
    """:func:`check` for guards on a GPU, without waiting for it (Note [Index guards on CUDA]): each range
    test is an asynchronous assert queued on the current stream."""
    for guard, result in zip(guards, results):
        low, high, size = result.unbind()
        ok = (high < size) & (low >= (-size if guard.lowest == "-size" else 0))
        text = guard.message.format(index="<index>", dim=guard.dim, size="<size>")
        assert_on_device(ok, f"{text} (ortlab: {guard.where})")
