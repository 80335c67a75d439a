"""Trace a model's training step (loss and every gradient) and eval step with PyTorch, and export them to ONNX.

Imported only by ``generate_artifacts`` (the one part of ``ortlab.ondevice`` that needs
PyTorch, run where the model is built).

Note [Tracing the training step]
The training model must compute gradients, and the standard onnxruntime wheel has no
gradient builder, so PyTorch differentiates: ``make_fx`` traces
``functionalize(grad(loss of functional_call(model, parameters, inputs)))`` into one
functional aten graph holding the forward, the loss and the backward, with parameters,
buffers, inputs and labels as placeholders in that order. That graph goes through
ortlab's own exporter (``ortlab.onnx.export.export_graph``, with ortlab's decomposition
table), the path every ORTModule graph takes, rather than
``torch.onnx.export(dynamo=True)``: torch.export would re-trace through Dynamo and make
the parameters initializers we would have to lift back into inputs, and torch.onnx's
default decompositions keep torchlib's ``nll_loss_backward``, whose gradients ignore
``total_weight`` (see ``ortlab.capture.decompositions``): cross-entropy would train
with gradients ``N`` times too large. ``functionalize`` turns in-place buffer updates
(BatchNorm's running statistics) into values: each becomes an output ``<name>_updated``
that ``Module`` writes back into the state after the step, as PyTorch updates the buffer.
``torch.func.grad`` rather than ``torch.autograd.grad``: ``functionalize`` hides
``requires_grad`` from the function it wraps.

With ``dynamic_batch`` the inputs' and labels' first dimension is traced as a symbol of
its own (every other size, parameters included, stays static), so one model trains on
any batch size; the graph's inputs name that dimension ``batch``.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Mapping, Sequence

import onnx
import onnx_ir as ir
import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.traceback import preserve_node_meta
from torch.overrides import TorchFunctionMode

from ortlab._compat.torch import FakeTensorMode
from ortlab._index_guards import IndexGuard
from ortlab.capture.decompositions import decomposition_table
from ortlab.errors import ConfigError, ExportError, first_line
from ortlab.ondevice.layout import LAYOUT_KEY, TrainingLayout
from ortlab.onnx.export import ExportedGraph, export_graph
from ortlab.onnx.optimize import optimize_exported
from ortlab.provenance import op_name

__all__ = ["LOSSES", "StepSpec", "prepare_step", "export_step"]

logger = logging.getLogger(__name__)

LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": F.cross_entropy,
    "mse": F.mse_loss,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
    "l1": F.l1_loss,
}


def _as_tensors(value: object, what: str) -> tuple[torch.Tensor, ...]:
    items = (value,) if isinstance(value, torch.Tensor) else tuple(value) if isinstance(value, (tuple, list)) else None
    if items is None or not all(isinstance(t, torch.Tensor) for t in items):
        raise ConfigError(f"{what} must be a tensor or a tuple of tensors; got {type(value).__name__}")
    return items


def _flat_outputs(out: object) -> tuple[list[torch.Tensor], list[str] | None]:
    """The model's outputs as a list of tensors, and their names when it returned a mapping."""
    if isinstance(out, torch.Tensor):
        return [out], None
    if isinstance(out, Mapping):
        items = [(str(k), v) for k, v in out.items() if v is not None]
        if all(isinstance(v, torch.Tensor) for _, v in items):
            return [v for _, v in items], [k for k, _ in items]
    elif isinstance(out, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in out):
        return list(out), None
    raise ConfigError(f"the model returned a {type(out).__name__}; generate_artifacts takes a model returning a "
                      "tensor, a tuple of tensors or a dict of tensors")


@dataclasses.dataclass
class StepSpec:
    """What to trace: the model, which tensors train, example inputs and labels, the loss, and every name.

    Built by :func:`prepare_step`, which checks the names and fills in the defaults.
    """

    model: torch.nn.Module
    tensors: dict[str, torch.Tensor]  # every parameter and buffer, by name
    layout: TrainingLayout
    example_inputs: tuple[torch.Tensor, ...]
    example_labels: tuple[torch.Tensor, ...]
    loss_fn: Callable[..., torch.Tensor] | None


def _names(given: Sequence[str] | None, count: int, stem: str, what: str) -> tuple[str, ...]:
    if given is not None:
        if len(given) != count:
            raise ConfigError(f"{what} has {len(given)} names for {count} values")
        return tuple(given)
    return (stem,) if count == 1 else tuple(f"{stem}_{i}" for i in range(count))


def _check_names(spec: Sequence[tuple[str, Sequence[str]]]) -> None:
    seen: dict[str, str] = {}
    for role, names in spec:
        for name in names:
            if name in seen:
                raise ConfigError(f"the name {name!r} is used twice ({seen[name]} and {role}); name the inputs, "
                                  "labels and outputs apart from the parameters (input_names=, output_names=)")
            seen[name] = role


def prepare_step(
    model: torch.nn.Module,
    example_inputs: object,
    loss: str | Callable[..., torch.Tensor] | None,
    labels: object,
    requires_grad: Sequence[str] | None,
    frozen_params: Sequence[str] | None,
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
    dynamic_batch: bool,
) -> StepSpec:
    """Check the arguments of ``generate_artifacts`` and decide every name and role.

    Raises:
        ConfigError: naming the argument that is wrong and the valid choices.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"generate_artifacts takes a torch.nn.Module; got {type(model).__name__}")
    inputs = _as_tensors(example_inputs, "example_inputs")
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ConfigError(f"loss {loss!r} is not built in; choose one of {', '.join(LOSSES)}, a callable "
                              "(output, *labels) -> scalar, or None when the model returns its loss")
        loss_fn: Callable[..., torch.Tensor] | None = LOSSES[loss]
    elif loss is None or callable(loss):
        loss_fn = loss
    else:
        raise ConfigError(f"loss must be a name ({', '.join(LOSSES)}), a callable or None; got {type(loss).__name__}")

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for what, names in (("requires_grad", requires_grad), ("frozen_params", frozen_params)):
        unknown = [n for n in names or () if n not in params]
        if unknown:
            raise ConfigError(f"{what} names {unknown}, which the model has no parameter called; its parameters are "
                              f"{', '.join(params)}")
    frozen_set = set(frozen_params or ())
    both = sorted(frozen_set & set(requires_grad or ()))
    if both:
        raise ConfigError(f"{both} are both in requires_grad and in frozen_params; name each in one of them")
    wanted = list(requires_grad) if requires_grad is not None else [n for n, p in params.items() if p.requires_grad]
    trainable = tuple(n for n in params if n in set(wanted) and n not in frozen_set)
    if not trainable:
        raise ConfigError("no parameter would train: every parameter is frozen or has requires_grad=False; "
                          "name the ones to train with requires_grad=[...]")
    frozen = tuple(n for n in params if n not in set(trainable)) + tuple(buffers)
    tensors = {**params, **buffers}

    with FakeTensorMode(allow_non_fake_inputs=True):  # shapes only: nothing runs, no buffer changes
        out = torch.func.functional_call(model, {n: t.detach() for n, t in tensors.items()}, inputs)
    outputs, keys = _flat_outputs(out)
    if loss_fn is None and outputs[0].dim() != 0:
        raise ConfigError(f"with loss=None the model's (first) output must be its scalar loss; it has shape "
                          f"{tuple(outputs[0].shape)}. Pass loss='cross_entropy' (or mse, bce_with_logits, l1)")
    if labels is None and loss_fn is not None:
        if not isinstance(loss, str):
            raise ConfigError("a callable loss needs example labels: pass labels=... to generate_artifacts")
        first = outputs[0]
        example = (torch.zeros((first.shape[0], *first.shape[2:]), dtype=torch.long) if loss == "cross_entropy"
                   else torch.zeros(first.shape, dtype=first.dtype))
        labels = (example,)
        logger.info("ortlab.ondevice: example labels made for %s: %s %s", loss, example.dtype, tuple(example.shape))
    example_labels = _as_tensors(labels, "labels") if loss_fn is not None else ()
    if dynamic_batch:
        small = [i for i, t in enumerate(inputs + example_labels) if t.dim() > 0 and t.shape[0] < 2]
        if small:
            raise ConfigError("dynamic_batch needs example inputs and labels with a batch of at least 2 (PyTorch "
                              "specializes sizes 0 and 1); give a bigger example batch or dynamic_batch=False")
    model_outputs = outputs if loss_fn is not None else outputs[1:]
    default_outputs = keys if keys is not None and loss_fn is not None else (keys[1:] if keys else None)
    layout = TrainingLayout(
        trainable=trainable,
        frozen=frozen,
        inputs=_names(input_names, len(inputs), "input", "input_names"),
        labels=_names(None, len(example_labels), "labels", "labels"),
        loss="loss",
        outputs=_names(output_names if output_names is not None else default_outputs, len(model_outputs), "output",
                       "output_names"),
        dynamic_batch=dynamic_batch,
    )
    _check_names([("a parameter", layout.trainable + layout.frozen), ("an input", layout.inputs),
                  ("a label", layout.labels), ("the loss", (layout.loss,)), ("an output", layout.outputs),
                  ("a gradient", layout.gradients), ("an updated buffer", tuple(f"{n}_updated" for n in frozen))])
    return StepSpec(model, tensors, layout, inputs, example_labels, loss_fn)


def _step_function(spec: StepSpec, train: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
    layout, model, loss_fn = spec.layout, spec.model, spec.loss_fn
    n_train, n_frozen, n_in = len(layout.trainable), len(layout.frozen), len(layout.inputs)

    def loss_and_outputs(trainable: tuple, frozen: tuple, inputs: tuple, labels: tuple) -> tuple:
        state = {**dict(zip(layout.trainable, trainable)), **dict(zip(layout.frozen, frozen))}
        outputs, _ = _flat_outputs(torch.func.functional_call(model, state, inputs))
        loss = loss_fn(outputs[0], *labels) if loss_fn is not None else outputs[0]
        if loss.dim() != 0:
            raise ConfigError(f"the loss has shape {tuple(loss.shape)}; it must be a scalar (reduce it)")
        rest = outputs if loss_fn is not None else outputs[1:]
        return loss, (loss.detach(), *(o.detach() for o in rest))

    def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        trainable, frozen = flat[:n_train], flat[n_train:n_train + n_frozen]
        inputs, labels = flat[n_train + n_frozen:n_train + n_frozen + n_in], flat[n_train + n_frozen + n_in:]
        if train:
            grads, aux = torch.func.grad(loss_and_outputs, has_aux=True)(trainable, frozen, inputs, labels)
            return (aux[0], *grads)
        with torch.no_grad():
            return loss_and_outputs(trainable, frozen, inputs, labels)[1]

    return step


class _LinearAsAddmm(TorchFunctionMode):
    """``F.linear`` on more than two dimensions as the ``addmm`` PyTorch's own kernel runs.

    Note [Keeping the batch symbolic through linear]
    Under ``functionalize``, ``F.linear`` of a 3-d input whose weight requires grad asks
    for the input's concrete sizes (torch 2.13: ``aten.size`` instead of ``sym_size``),
    which fixes the symbolic batch to the example's: a GPT's artifacts then took only
    the example batch size. Its C++ kernel flattens the leading dimensions and calls
    ``addmm`` (``_flatten_nd_linear``); written here in Python the sizes stay symbolic and
    the arithmetic is the same.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[0], torch.Tensor) and args[0].dim() > 2:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            flat = x.reshape(-1, x.shape[-1])
            out = torch.addmm(bias, flat, weight.t()) if bias is not None else torch.mm(flat, weight.t())
            return out.reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


def _fake_inputs(spec: StepSpec, mode: FakeTensorMode) -> list[torch.Tensor]:
    layout = spec.layout
    fakes = [mode.from_tensor(spec.tensors[n].detach(), static_shapes=True)
             for n in layout.trainable + layout.frozen]
    for t in spec.example_inputs + spec.example_labels:
        if layout.dynamic_batch and t.dim() > 0:
            context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (t.dim() - 1))
            fakes.append(mode.from_tensor(t, symbolic_context=context))
        else:
            fakes.append(mode.from_tensor(t, static_shapes=True))
    return fakes


def _expand_numel(gm: torch.fx.GraphModule) -> None:
    """Write ``aten.sym_numel(x)`` as the product of ``x``'s sizes: torchlib translates ``sym_size`` and ``*``.

    A mean-reduced loss divides its gradient by the element count; with a symbolic batch
    PyTorch records that count as ``sym_numel`` (mse_loss's backward), which has no
    ONNX translation.
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.sym_numel.default:
            continue
        x = node.args[0]
        shape = x.meta["val"].shape
        static = 1
        product: torch.fx.Node | None = None
        with gm.graph.inserting_before(node):
            for i, size in enumerate(shape):
                if isinstance(size, int):
                    static *= size
                    continue
                dim = gm.graph.call_function(torch.ops.aten.sym_size.int, (x, i))
                dim.meta["val"] = size
                if product is None:
                    product = dim
                else:
                    value = product.meta["val"] * size
                    product = gm.graph.call_function(operator.mul, (product, dim))
                    product.meta["val"] = value
            if product is not None and static != 1:
                value = product.meta["val"] * static
                product = gm.graph.call_function(operator.mul, (product, static))
                product.meta["val"] = value
        node.replace_all_uses_with(product if product is not None else static)
        gm.graph.erase_node(node)


def _add_outputs(gm: torch.fx.GraphModule, extra: Sequence[torch.fx.Node]) -> None:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out.args = (tuple(out.args[0]) + tuple(extra),)


def _trace(spec: StepSpec, train: bool) -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node], _Batch]:
    """The step's FX graph, the buffers it updates (name -> new value's node) and the batch dimension."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = _fake_inputs(spec, mode)
    step = torch.func.functionalize(_step_function(spec, train), remove="mutations")
    was_training = {m: m.training for m in spec.model.modules()}
    spec.model.train(train)
    try:
        with _LinearAsAddmm(), preserve_node_meta():  # original_aten, for the guards' errors (see ondevice.module)
            gm = make_fx(step, decomposition_table=decomposition_table(), tracing_mode="symbolic")(*fakes)
    except ConfigError:
        raise
    except Exception as e:  # anything PyTorch raises while tracing the user's model
        raise ExportError(f"PyTorch could not trace the model's {'training' if train else 'eval'} step: "
                          f"{first_line(e)}. With dynamic_batch=True, code that branches on the batch size "
                          "fails here: try dynamic_batch=False") from e
    finally:
        for m, flag in was_training.items():
            m.training = flag
    layout = spec.layout
    names = list(layout.model_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    updated: dict[str, torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or op_name(node) != "aten.copy_" or node.args[0] not in placeholders:
            continue
        name = names[placeholders.index(node.args[0])]
        if name in layout.trainable:
            raise ConfigError(f"the model writes into the trainable parameter {name!r} in place; freeze it "
                              "(frozen_params=[...]) or write the model without the in-place update")
        if name in layout.frozen:
            updated[name] = node.args[1]
        else:
            logger.warning("ortlab.ondevice: the model writes into its input %s in place; the artifacts do not "
                           "(inputs are not written back)", name)
        gm.graph.erase_node(node)
    _add_outputs(gm, list(updated.values()))  # before dead code goes: the new values only fed the copies
    _expand_numel(gm)
    gm.graph.eliminate_dead_code()
    if train:
        unused = [n for n, p in zip(layout.trainable, placeholders) if not p.users]
        if unused:
            raise ConfigError(f"the parameters {unused} do not reach the loss, so they get no gradient (PyTorch's "
                              "optimizers skip them); freeze them with frozen_params=[...]")
    gm.recompile()
    return gm, updated, _batch_size(fakes[len(layout.trainable) + len(layout.frozen):], mode.shape_env)


@dataclasses.dataclass(frozen=True)
class _Batch:
    """The batch dimension after tracing: the names its symbols print as, and its size if PyTorch fixed it."""

    symbols: frozenset[str]
    fixed: int | None


def _batch_size(fakes: Sequence[torch.Tensor], shape_env: ShapeEnv) -> _Batch:
    symbols: set[str] = set()
    fixed = None
    for t in fakes:
        size = t.shape[0] if t.dim() > 0 else None
        if not isinstance(size, torch.SymInt):
            continue
        final = shape_env.replace(size.node.expr)  # what tracing resolved the symbol to
        symbols |= {str(size.node.expr), str(final)}
        if final.is_number:
            fixed = int(final)
    return _Batch(frozenset(symbols), fixed)


def _name_values(exported: ExportedGraph, inputs: Sequence[str], outputs: Sequence[str],
                 batch: _Batch) -> tuple[IndexGuard, ...]:
    """Give the graph's inputs and outputs their layout names (see Note [Tracing the training step]).

    The index guards stay the last outputs; returned with their outputs' final names.
    """
    graph = exported.model.graph
    every = list(graph.outputs)
    guard_values = every[len(every) - len(exported.interface.guards):] if exported.interface.guards else []
    produced = iter(every[:len(every) - len(guard_values)])
    values: list[ir.Value] = []
    for kind, source in zip(exported.interface.output_kinds, exported.interface.output_sources):
        if kind != "tensor":
            raise ExportError(f"the traced step returns a {kind} where a tensor was expected")
        values.append(next(produced) if source is None else
                      graph.inputs[source[1]] if source[0] == "input" else values[source[1]])
    distinct: list[ir.Value] = []
    taken = {id(v) for v in graph.inputs}
    for i, value in enumerate(values):
        if id(value) in taken:  # an input returned as it is, or one value twice: outputs need values of their own
            copy = ir.Node("", "Identity", inputs=[value], name=f"output_copy_{i}")
            graph.append(copy)
            copy.outputs[0].dtype, copy.outputs[0].shape = value.dtype, value.shape
            value = copy.outputs[0]
        taken.add(id(value))
        distinct.append(value)
    graph.outputs.clear()
    graph.outputs.extend(distinct + guard_values)
    reserved = set(inputs) | set(outputs)
    mine = {id(v) for v in list(graph.inputs) + distinct}
    others = [v for node in graph for v in node.outputs] + list(graph.initializers.values())
    for k, value in enumerate(others):
        if id(value) not in mine and value.name in reserved:
            value.name = f"{value.name}__{k}"
    for value, name in zip(list(graph.inputs) + distinct, list(inputs) + list(outputs)):
        value.name = name
        if batch.symbols and value.shape is not None:
            size = "batch" if batch.fixed is None else batch.fixed
            value.shape = ir.Shape([size if isinstance(d, ir.SymbolicDim) and d.value in batch.symbols else d
                                    for d in value.shape])
    return tuple(dataclasses.replace(g, output=v.name) for g, v in zip(exported.interface.guards, guard_values))


def export_step(spec: StepSpec, train: bool) -> tuple[onnx.ModelProto, TrainingLayout]:
    """The training (``train=True``) or eval model as ONNX, with its layout in its metadata.

    Raises:
        ExportError: when PyTorch cannot trace the step or a node has no ONNX translation.
        ConfigError: when the model's step cannot be trained this way (the message says why).
    """
    gm, updated, batch = _trace(spec, train)
    layout = dataclasses.replace(spec.layout, updated=tuple(updated))
    if batch.fixed is not None:  # correct for the example's batch only: say so, and make the inputs say so
        logger.warning("ortlab.ondevice: the %s step fixes the batch size to %d (PyTorch specialized it while "
                       "tracing); its model takes batches of %d only", "training" if train else "eval", batch.fixed,
                       batch.fixed)
        layout = dataclasses.replace(layout, dynamic_batch=False)
    outputs = ([layout.loss, *layout.gradients] if train else [layout.loss, *layout.outputs])
    outputs += layout.updated_outputs
    name = "training" if train else "eval"
    exported = export_graph(gm, name, guard_indices=True)  # Note [Index guards on the device] in ondevice.module
    if optimize_exported(exported).skipped:  # the optimizer is best effort; the graph as exported is correct
        exported = export_graph(gm, name, guard_indices=True)
    layout = dataclasses.replace(layout, guards=_name_values(exported, layout.model_inputs, outputs, batch))
    exported.model.metadata_props[LAYOUT_KEY] = layout.to_json()
    try:
        return ir.to_proto(exported.model), layout
    except Exception as e:  # onnx_ir raises SerdeError and others
        raise ExportError(f"could not serialize the {name} model: {first_line(e)}") from e

