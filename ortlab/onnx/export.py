"""Translate one AOTAutograd FX graph (forward, backward or inference) to ONNX.

We call torch.onnx's own FX translator (through ``ortlab._compat.torch``) with the
torchlib registry, so every aten op is translated by the same functions
``torch.onnx.export(dynamo=True)`` uses. We do not go through ``torch.export``:
the graph is already functional aten, and re-tracing it would cost seconds and
lose the SymInt inputs that make sizes dynamic.

On top of the translation this module adds what training needs:

* input/output *kinds* (tensor, int, float, bool, None) so the runtime can feed
  SymInts as int64 scalars and give AOTAutograd back Python ints and ``None``s
  at the positions it expects (backward graphs return None for inputs that need
  no grad);
* outputs that are graph inputs or repeated get an Identity so names stay unique;
* provenance on every ONNX node (``ortlab.fx_node``, ``ortlab.module``,
  ``ortlab.source``) so a slow kernel or a diverging value leads back to model code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator

import onnx_ir as ir
import torch
import torch.fx
from onnx_ir.passes.common import InlinePass

from ortlab._compat.torch import (
    EXPORTER_LOGGERS,
    ONNX_IR_VERSION,
    add_opset_imports,
    insert_type_promotion_nodes,
    set_value_type,
    translate_fx_graph,
    unset_fake_temporarily,
)
from ortlab.errors import ExportError, first_line
from ortlab.onnx.guards import add_guards, prepare_guards
from ortlab.onnx.interface import GraphInterface
from ortlab.provenance import INPUT_KEY, module_path, op_name, source_line
from ortlab.stages import count_ops
from ortlab.torchlib import get_registry

__all__ = ["ExportedGraph", "bypass_output_identities", "export_graph", "value_kind"]

logger = logging.getLogger(__name__)


def value_kind(val: object) -> str | None:
    """The kind of an FX value as the runtime exchanges it."""
    if val is None:
        return None
    if isinstance(val, torch.Tensor):
        return "tensor"
    if isinstance(val, (bool, torch.SymBool)):
        return "bool"
    if isinstance(val, (int, torch.SymInt)):
        return "int"
    if isinstance(val, (float, torch.SymFloat)):
        return "float"
    raise ExportError(f"graph value of type {type(val).__name__} cannot cross into onnxruntime")


@dataclasses.dataclass
class ExportedGraph:
    """An ONNX model for one FX graph, with what the runtime needs to call it.

    Attributes:
        model: the ONNX IR model (inputs in FX placeholder order).
        interface: how a runner feeds it and reads its outputs back (kinds, dtypes,
            sources, index guards, views: ``ortlab.onnx.interface``).
        seconds: time the translation took.
    """

    model: ir.Model
    interface: GraphInterface
    seconds: float

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.model.graph.inputs]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.model.graph.outputs]

    def op_counts(self) -> dict[str, int]:
        """ONNX op types and how often each occurs (``ortlab.stages.count_ops``)."""
        return count_ops(self.model)

    def to_bytes(self) -> bytes:
        try:
            return ir.to_proto(self.model).SerializeToString()
        except Exception as e:  # onnx_ir raises SerdeError and others
            raise ExportError(f"could not serialize graph {self.model.graph.name!r}: {first_line(e)}") from e


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch.onnx warns per node about missing module stacks and None outputs; we report those ourselves.
    onnx_ir warns that an empty ``value_ints`` (torchlib's ``index_put`` with no sliced dims) defaults to INTS,
    which is what torchlib meant."""
    loggers = [logging.getLogger(EXPORTER_LOGGERS[0]), logging.getLogger("onnx_ir._convenience")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, old):
            lg.setLevel(level)


def _output_nodes(gm: torch.fx.GraphModule) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (list, tuple)) else [args]


# Note [Graph outputs reshaped in PyTorch]
# onnxruntime copies a Reshape's input into the graph's output buffer where an intermediate
# value's Reshape would share its buffer: a convolution's weight gradient, a GEMM's
# ``[Co, Ci*kh*kw]`` viewed as ``[Co, Ci, kh, kw]``, cost a copy every step (ResNet-18's three
# ``[512, 4608]`` ones ~1.2 ms each of its backward; a MatMul alone into the output 1.59 ms, with
# the Reshape after it 2.55 ms). An output that is a Reshape, Squeeze, Unsqueeze or Flatten of a
# value a node computes is returned as that value, and the runner views it in the FX output's
# shape (``OrtRunner``'s ``output_views``): a view of a contiguous tensor holds the same floats.
# Only outputs of at least 256 KiB: a view is a Python call of ~1 us a step, more than onnxruntime
# takes to copy a small tensor (the tiny MLP's two bias gradients as views: its step 0.962x).
# Where the value's shape or the output's is symbolic, where it is a graph input (the view would
# alias it) or a complex or bool tensor, the node stays.
_VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})
_VIEW_BYTES = 1 << 18


def _output_view(value: ir.Value, val: object, input_index: dict[int, int]) -> tuple[tuple[int, ...] | None, object]:
    """The shape the runner views an output as, and a meta tensor of the value it returns instead, or
    ``(None, None)`` (Note [Graph outputs reshaped in PyTorch])."""
    producer = value.producer()
    if (producer is None or producer.op_type not in _VIEW_OPS or producer.domain not in ("", "ai.onnx")
            or not isinstance(val, torch.Tensor) or val.dtype.is_complex or val.dtype == torch.bool
            or any(type(n) is not int for n in val.shape) or len(value.uses()) > 0
            or val.numel() * val.element_size() < _VIEW_BYTES):
        return None, None
    source = producer.inputs[0]
    if source is None or id(source) in input_index or source.producer() is None or source.shape is None \
            or any(type(d) is not int for d in source.shape.dims) or math.prod(source.shape.dims) != val.numel():
        return None, None
    return tuple(val.shape), torch.empty(tuple(source.shape.dims), dtype=val.dtype, device="meta")


def bypass_output_identities(model: ir.Model) -> int:
    """Return an Identity's input instead of its copy when the Identity only feeds an output.

    ``aten.detach``/``alias`` become Identity nodes; when their result is saved for the
    backward (a graph output), onnxruntime copies the whole tensor every step (a
    forward log-softmax: ~1 ms a step). An output may be any value a node produces, so
    we output the Identity's input and drop the copy. Returns how many were bypassed.
    """
    graph = model.graph
    outputs = list(graph.outputs)
    in_outputs = {id(v) for v in outputs}
    graph_inputs = {id(v) for v in graph.inputs}
    bypassed = 0
    for i, value in enumerate(outputs):
        node = value.producer()
        if node is None or node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.inputs[0]
        if (source is None or id(source) in in_outputs or id(source) in graph_inputs or source.producer() is None
                or len(value.uses()) > 0):
            continue
        source.shape = value.shape if source.shape is None else source.shape
        graph.outputs[i] = source
        in_outputs.add(id(source))
        graph.remove(node, safe=False)
        bypassed += 1
    return bypassed


_COPIES = ("aten.clone", "aten._to_copy", "aten.copy", "aten.lift_fresh_copy")


def _is_copy(node: torch.fx.Node | None) -> bool:
    return node is not None and node.op == "call_function" and op_name(node) in _COPIES


_RESHAPES = ("aten.view", "aten._unsafe_view", "aten.reshape")


def _resolve_inferred_sizes(gm: torch.fx.GraphModule) -> None:
    """Write the size a ``view(x, [0, 2, -1])`` infers: ONNX's Reshape cannot infer it from 0 elements.

    GroupNorm's decomposition views ``(N, G, -1)``; with an empty batch onnxruntime
    failed ("The input tensor cannot be reshaped"). PyTorch knows the result's static
    size, so the -1 is replaced by it.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or op_name(node) not in _RESHAPES or len(node.args) < 2:
            continue
        val, size = node.meta.get("val"), node.args[1]
        if not isinstance(val, torch.Tensor) or not isinstance(size, (list, tuple)) or -1 not in size:
            continue
        shape = list(val.shape)
        if all(isinstance(d, int) for d in shape) and 0 in shape:
            node.update_arg(1, shape)


# Note [A squeeze removes only dims of size 1]
# ``aten.squeeze.dim(x, d)`` leaves ``x`` as it is where ``x.size(d)`` is not 1; ONNX's
# ``Squeeze`` with that axis fails instead ("Dimension of input 0 must be 1 instead of 3"),
# and torchlib translates the one by the other. Dynamo specializes sizes 0 and 1: ``x.squeeze(0)``
# captured with a batch of 1 has a static 1 there, and its guard sends a batch of 3 to a new
# capture with a symbolic batch, known to be at least 2. That graph still holds the squeeze (a
# no-op for every size it will run with: its value keeps the dim), and its Squeeze failed on
# every call of every later size. A static batch of 3 made a model onnxruntime refused, and the
# squeeze ran in PyTorch as if onnxruntime lacked the kernel ("onnxruntime rejects ONNX Squeeze
# on FLOAT"). The graph knows which dims each squeeze removes (its value's
# shape, Dynamo's guards hold it to that): the export squeezes exactly those, the static 1s, by
# axis, and a squeeze that removes none is an ``alias`` of its input. ``squeeze()`` without dims
# (ONNX: whatever is 1 at run time) is given its axes too, so that it cannot remove a dim the
# graph keeps.
_SQUEEZES = (torch.ops.aten.squeeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
             torch.ops.prims.squeeze.default)


def _squeeze_static_ones(gm: torch.fx.GraphModule) -> None:
    """Each squeeze of ``gm`` squeezes the dims it removes, by axis (Note [A squeeze removes only dims of size 1])."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SQUEEZES or not isinstance(node.args[0], torch.fx.Node):
            continue
        x, val = node.args[0], node.meta.get("val")
        x_val = x.meta.get("val")
        if not isinstance(x_val, torch.Tensor) or not isinstance(val, torch.Tensor) or x_val.dim() == 0:
            continue
        rank = x_val.dim()
        if node.target is aten.squeeze.default:
            dims = list(range(rank))
        else:
            dim = node.args[1] if len(node.args) > 1 else next(iter(node.kwargs.values()), None)
            dims = [dim] if isinstance(dim, int) else list(dim)
        ones = sorted({d % rank for d in dims if type(x_val.shape[d % rank]) is int and x_val.shape[d % rank] == 1})
        if len(ones) != rank - val.dim():  # the graph's value says otherwise (a size known only at run time)
            continue
        if node.target is aten.squeeze.dim and ones == [dims[0] % rank]:
            continue  # already exactly that
        node.kwargs = {}
        if not ones:
            node.target, node.args = aten.alias.default, (x,)
            continue
        source = x
        for d in reversed(ones[1:]):  # highest first: the lower axes keep their numbers
            with gm.graph.inserting_before(node):
                step = gm.graph.call_function(aten.squeeze.dim, (source, d))
            step.meta.update(node.meta)  # its model code and module, for the views
            step.meta["val"] = aten.squeeze.dim(source.meta["val"], d)  # a fake tensor computes a fake result
            source = step
        node.target, node.args = aten.squeeze.dim, (source, ones[0])


def _number_first_operands(gm: torch.fx.GraphModule) -> None:
    """Rewrite ``aten.sub.Tensor(1.0, x)`` as ``aten.add.Tensor(aten.neg(x), 1.0)`` (the same float
    result: IEEE subtraction adds the negation), and ``add``/``mul`` with a number first with the
    number second.

    Decompositions can leave a Python number where ``sub.Tensor`` takes its ``self`` tensor
    (XLNet's ``1.0 - attention_mask``, from ``rsub``'s decomposition). Such a node cannot run
    again: torch.onnx's type promotion pass runs it with promoted arguments and the dispatcher
    finds no overload for a float ``self``, so the whole graph ran in PyTorch.
    """
    aten = torch.ops.aten
    for node in gm.graph.nodes:
        if node.op != "call_function" or len(node.args) != 2 or not isinstance(node.args[0], (int, float)) \
                or isinstance(node.args[0], bool) or not isinstance(node.args[1], torch.fx.Node):
            continue
        number, tensor = node.args
        if node.kwargs:  # alpha: left as it is
            continue
        if node.target is aten.sub.Tensor:  # torchlib has no rsub.Scalar
            with gm.graph.inserting_before(node):
                negated = gm.graph.call_function(aten.neg.default, (tensor,))
            negated.meta.update(node.meta)  # its model code and module, for the views
            val = tensor.meta.get("val")
            if isinstance(val, torch.Tensor):
                negated.meta["val"] = aten.neg.default(val)  # a fake tensor computes a fake result
            node.target, node.args = aten.add.Tensor, (negated, number)
        elif node.target in (aten.add.Tensor, aten.mul.Tensor):
            node.args = (tensor, number)


def export_graph(gm: torch.fx.GraphModule, name: str, guard_indices: bool = False,
                 view_outputs: bool = False) -> ExportedGraph:
    """Translate ``gm`` to ONNX.

    Args:
        gm: a functional aten FX graph from AOTAutograd (every op translatable:
            split off the ops placed in PyTorch first, see ``ortlab.runtime.split``).
        name: the ONNX graph name.
        guard_indices: add index guards (forward and no-grad graphs; see
            Note [Index guards] in ``ortlab.onnx.guards``). Value guards (Note [Value guards]) go into
            every graph.
        view_outputs: an output that is a reshape of a value the graph computes returns that value,
            for the runner to view in its shape (``output_views``; Note [Graph outputs reshaped in
            PyTorch]). For models run by ortlab's runner only.

    Raises:
        ExportError: naming the FX node that failed and why.

    Example:
        >>> exported = export_graph(fw_gm, "forward")   # doctest: +SKIP
        >>> exported.op_counts()["MatMul"]               # doctest: +SKIP
    """
    start = time.perf_counter()
    registry = get_registry()
    _number_first_operands(gm)
    _squeeze_static_ones(gm)
    insert_type_promotion_nodes(gm)
    _resolve_inferred_sizes(gm)
    prepare_guards(gm)
    model = ir.Model(
        graph=ir.Graph([], [], nodes=[], name=name),
        ir_version=ONNX_IR_VERSION,
        producer_name="ortlab",
        producer_version=torch.__version__,
    )
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, str(node.target), None), torch.Tensor):
            # Lifted constants carry a FakeTensor as "val"; the initializer needs the data.
            with unset_fake_temporarily():  # AOTAutograd compiles under its FakeTensorMode
                node.meta["val"] = getattr(gm, str(node.target)).detach()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_kinds = []
    for node in placeholders:
        if "val" not in node.meta:
            raise ExportError(f"placeholder {node.name} has no example value; cannot type it for ONNX")
        input_kinds.append(value_kind(node.meta["val"]))
    try:
        with _quiet_exporter():
            values = translate_fx_graph(gm.graph, model, registry)
    except Exception as e:  # torch.onnx raises ConversionError/DispatchError and others
        raise ExportError(f"could not translate graph {name!r} to ONNX: {e}") from e

    graph = model.graph
    graph.outputs.clear()
    input_index = {id(v): i for i, v in enumerate(graph.inputs)}
    first_position: dict[int, int] = {}
    output_kinds: list[str | None] = []
    output_dtypes: list[torch.dtype | None] = []
    output_sources: list[tuple[str, int] | None] = []
    output_views: list[tuple[int, ...] | None] = []
    viewed: list[ir.Node] = []  # the view ops whose outputs the runner makes instead
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    for i, out in enumerate(_output_nodes(gm)):
        if out is None:
            output_kinds.append(None)
            output_dtypes.append(None)
            output_sources.append(None)
            output_views.append(None)
            continue
        if not isinstance(out, torch.fx.Node):
            raise ExportError(f"graph {name!r} returns a constant {out!r} at position {i}; not supported")
        if "val" not in out.meta:  # without it the output would pass for a None
            raise ExportError(f"graph {name!r} output {out.name} has no example value; cannot type it for ONNX")
        val = out.meta["val"]
        kind = value_kind(val)
        output_kinds.append(kind)
        output_dtypes.append(val.dtype if kind == "tensor" else None)
        value = values[out.name]
        if isinstance(value, (list, tuple)):
            raise ExportError(f"graph {name!r} output {out.name} is a sequence; expected one value")
        # detach/alias become Identity copies: return what they alias instead (the
        # saved log-softmax and its detach are then one tensor, as in eager).
        # A clone stays a copy: returning its source would alias what eager returns fresh
        # (``y = m(x); y.add_(1)`` changed ``x``).
        while (producer := value.producer()) is not None and producer.op_type == "Identity" \
                and producer.domain in ("", "ai.onnx") and producer.inputs[0] is not None \
                and not _is_copy(fx_nodes.get(value.name)):
            value = producer.inputs[0]
        view, source_val = _output_view(value, val, input_index) if view_outputs else (None, None)
        if view is not None:
            viewed.append(value.producer())
            value = value.producer().inputs[0]
        output_views.append(view)
        # Inputs returned as they are (AOTAutograd saves parameters for the backward
        # this way) and repeated outputs never cross into onnxruntime: an Identity
        # would copy the whole tensor on every step.
        if id(value) in input_index:
            output_sources.append(("input", input_index[id(value)]))
            continue
        if id(value) in first_position:
            output_sources.append(("output", first_position[id(value)]))
            continue
        first_position[id(value)] = i
        if value.producer() is None:  # an initializer or constant: give it a producer
            ident = ir.Node("", "Identity", inputs=[value], name=f"output_identity_{i}")
            graph.append(ident)
            value = ident.outputs[0]
            value.name = f"{out.name}_out{i}"
        value.dtype = None  # re-derive from the FX value: torchlib's guesses can be off
        set_value_type(value, val if view is None else source_val)
        output_sources.append(None)
        graph.outputs.append(value)

    in_outputs = {id(v) for v in graph.outputs}
    for node in {id(n): n for n in viewed}.values():
        if not any(v.uses() or id(v) in in_outputs for v in node.outputs):
            graph.remove(node, safe=False)
    guards = add_guards(gm, graph, values, indices=guard_indices)  # value guards in every graph
    if not graph.outputs:
        # Every output is an input passed through (dropout in eval, a backward that
        # returns the incoming gradient). onnxruntime refuses a graph without outputs,
        # so it computes one int64 zero that the runner never reads.
        zero = ir.Node("", "Constant", inputs=[], name="no_outputs",
                       attributes=[ir.AttrTensor("value", ir.tensor(0, dtype=ir.DataType.INT64))])
        graph.append(zero)
        zero.outputs[0].name = "ortlab_no_outputs"
        zero.outputs[0].dtype, zero.outputs[0].shape = ir.DataType.INT64, ir.Shape([])
        graph.outputs.append(zero.outputs[0])

    # torchlib's shape guesses for intermediate values can be wrong with symbolic
    # sizes (onnxruntime then warns on every run); let onnxruntime infer them.
    for node in graph:
        fx_node = node.meta.get("node")
        if fx_node is not None:  # before inlining: a function's nodes get its call's metadata
            node.metadata_props["ortlab.fx_node"] = fx_node.name
            node.metadata_props["ortlab.op"] = op_name(fx_node)
            node.metadata_props["ortlab.module"] = module_path(fx_node)
            node.metadata_props["ortlab.source"] = source_line(fx_node)
    if model.functions:
        # onnxruntime would inline these itself, leaving nodes without names its
        # errors could point at; inline them here so every node keeps provenance
        # (onnx_ir's inliner gives each inlined node its call's metadata).
        InlinePass()(model)
    outputs = set(id(v) for v in graph.outputs)
    for index, node in enumerate(graph):
        if not node.name:  # onnxruntime's errors name the node; make every name findable
            fx = node.meta.get("node")
            node.name = f"node_{fx.name}_{node.op_type}_{index}" if fx is not None else f"node_{node.op_type}_{index}"
        for v in node.outputs:
            if id(v) not in outputs:
                v.shape = None
    named = {n.name: n.meta[INPUT_KEY] for n in placeholders if n.meta.get(INPUT_KEY)}
    for value in graph.inputs:  # what each input is (blocks.0.ln1.weight): the views show it
        if value.name in named:
            value.metadata_props[INPUT_KEY] = named[value.name]
    bypass_output_identities(model)
    add_opset_imports(model)
    # onnxruntime 1.31 reads IR version <= 13 while torch's exporter targets newer ones.
    model.ir_version = min(model.ir_version, 10)
    views = output_views if any(v is not None for v in output_views) else []
    interface = GraphInterface(input_kinds, output_kinds, output_dtypes, output_sources, guards, views)
    return ExportedGraph(model, interface, time.perf_counter() - start)
