"""The optimizer as one ONNX graph: every parameter's AdamW, Adam or SGD update in one run.

Torch-free (onnx and numpy only): the on-device ``Optimizer`` runs this graph on numpy
arrays, and ``ortlab.optim.FusedAdam`` runs the same graph on a torch model's parameters.

The graph's inputs are ``learning_rate`` (float64), ``step`` (int64, the 1-based number
of the update being made) and, for each parameter ``p`` in order, ``p``, ``p_grad`` and
its state (``p_exp_avg``, ``p_exp_avg_sq`` for Adam and AdamW; none for SGD). Its outputs
are ``p_updated`` and the new state (``p_exp_avg_updated``, ...). With a shared schedule
(the on-device optimizer) ``learning_rate`` and ``step`` are scalars; with a per-parameter
schedule (``FusedAdam``: param groups with their own learning rates, parameters that
skipped steps without a gradient) they are vectors with one entry per parameter.

Note [The update, as PyTorch computes it]
The graph follows ``torch.optim.Adam``/``AdamW``'s single-tensor path (what they run on the
CPU by default, torch 2.13) operation by operation, so results agree to float rounding:

* the bias corrections are Python floats there: ``1 - beta1 ** step``,
  ``(1 - beta2 ** step) ** 0.5``, ``lr / bias_correction1`` and the decoupled decay
  ``1 - lr * weight_decay`` are computed here in float64, then cast to the parameter's
  dtype, as PyTorch casts a Python scalar where it meets a float32 tensor;
* ``exp_avg.lerp_(grad, 1 - beta1)`` is ``m + w * (g - m)`` for ``w < 0.5``
  (``g - (g - m) * (1 - w)`` otherwise), ``exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)``
  is ``v * beta2 + ((1 - beta2) * g) * g``, ``param.addcdiv_(m, denom, -step_size)`` is
  ``p + (-step_size * m) / denom``, and Adam's L2 term is ``g + weight_decay * p``.

PyTorch's vectorized lerp uses a fused multiply-add where this graph rounds twice, so a
moment can differ in its last bit; over 100 steps the parameters stay within 1e-6.

Note [Updating in place]
The optimizers hand onnxruntime each parameter's and each moment's own buffer as the
buffer of its updated output (``ortlab.ondevice.inplace``): no copy in, no copy out. That
is only correct when nothing reads an input after the node that overwrites it has run.
onnxruntime runs a node after all of its ancestors and in no other order we can rely on,
so the rule is: every node that reads ``p`` (or ``m``, ``v``) must be an ancestor of, or
be, the node producing ``p_updated`` (``m``'s, ``v``'s). The graph below is built that
way (the decay reads ``p`` on the way to ``p_updated``; the moments' reads of ``m`` and
``v`` lead to their new values), and :func:`check_in_place` proves it for every built
graph before a session sees it. A graph breaking the rule computed ``2x + y`` with the
new ``y`` in our test: writes through a shared buffer are silent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ortlab.errors import ConfigError, InternalError

__all__ = [
    "KINDS",
    "LEARNING_RATE",
    "STEP",
    "LAYOUT_KEY",
    "UpdateRule",
    "ParamSlot",
    "state_names",
    "slot_inputs",
    "slot_outputs",
    "build_optimizer_model",
    "aliases",
    "check_in_place",
    "OptimizerLayout",
]

KINDS = ("adamw", "adam", "sgd")
LEARNING_RATE = "learning_rate"
STEP = "step"
LAYOUT_KEY = "ortlab.ondevice.optimizer"
OPSET = 18
_FLOAT_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE}


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    """How a parameter is updated: the optimizer and its constant hyperparameters.

    The learning rate is not part of the rule: it is an input of the graph, set per step.

    Args:
        kind: ``"adamw"`` (decoupled weight decay, ``torch.optim.AdamW``), ``"adam"`` (L2
            added to the gradient, ``torch.optim.Adam``) or ``"sgd"`` (plain, no momentum).
        betas: Adam's moment coefficients.
        eps: added to Adam's denominator.
        weight_decay: AdamW's decoupled decay, or the L2 coefficient of Adam and SGD.

    Example:
        >>> UpdateRule.default("sgd")
        UpdateRule(kind='sgd', betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0)
    """

    kind: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"optimizer {self.kind!r} is not supported; choose one of {', '.join(KINDS)}.")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"betas must both lie in [0, 1), got {self.betas}.")
        if self.eps < 0 or self.weight_decay < 0:
            raise ConfigError(f"eps and weight_decay must be >= 0, got eps={self.eps}, "
                              f"weight_decay={self.weight_decay}.")
        object.__setattr__(self, "betas", (float(b1), float(b2)))

    @classmethod
    def default(cls, kind: str) -> UpdateRule:
        """PyTorch's defaults for ``kind``: AdamW decays by 0.01, Adam and SGD not at all."""
        return cls(kind=kind, weight_decay=0.01 if kind == "adamw" else 0.0)

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One parameter of the optimizer graph: its name, dtype, shape and rule."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str, ...]
    rule: UpdateRule

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if self.dtype not in _FLOAT_TYPES:
            raise ConfigError(
                f"parameter {self.name!r} is {self.dtype}; the optimizer graph updates float32 and float64 "
                "parameters. Keep float32 master weights for fp16 training (ortlab.optim.FP16_Optimizer "
                "scales the loss)."
            )


def state_names(kind: str) -> tuple[str, ...]:
    """The optimizer state each parameter carries under ``kind`` (as ``torch.optim`` names it)."""
    return ("exp_avg", "exp_avg_sq") if kind in ("adamw", "adam") else ()


def slot_inputs(name: str, kind: str) -> list[str]:
    """The graph inputs of parameter ``name``: itself, its gradient, its state."""
    return [name, f"{name}_grad", *(f"{name}_{s}" for s in state_names(kind))]


def slot_outputs(name: str, kind: str) -> list[str]:
    """The graph outputs of parameter ``name``: its new value and new state, in :func:`slot_inputs` order."""
    return [f"{name}_updated", *(f"{name}_{s}_updated" for s in state_names(kind))]


@dataclasses.dataclass(frozen=True)
class OptimizerLayout:
    """What an optimizer graph updates, stored in its metadata (``LAYOUT_KEY``).

    Attributes:
        kind: adamw, adam or sgd.
        params: the parameter names, in input order.
        per_param_schedule: whether ``learning_rate`` and ``step`` are vectors (one entry
            per parameter) rather than scalars.
        rules: each parameter's rule.
    """

    kind: str
    params: tuple[str, ...]
    per_param_schedule: bool
    rules: tuple[UpdateRule, ...]

    def to_json(self) -> str:
        return json.dumps({"version": 1, "kind": self.kind, "params": list(self.params),
                           "per_param_schedule": self.per_param_schedule,
                           "rules": [r.as_dict() for r in self.rules]})

    @classmethod
    def from_json(cls, text: str) -> OptimizerLayout:
        data = json.loads(text)
        rules = tuple(UpdateRule(r["kind"], tuple(r["betas"]), r["eps"], r["weight_decay"]) for r in data["rules"])
        return cls(data["kind"], tuple(data["params"]), bool(data["per_param_schedule"]), rules)


class _GraphWriter:
    """Nodes and deduplicated constants of one graph, with generated unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._constants: dict[tuple, str] = {}
        self._count = 0

    def constant(self, value: float | Sequence[float], elem_type: int) -> str:
        array = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(elem_type))
        key = (elem_type, array.shape, array.tobytes())
        if key not in self._constants:
            name = f"const_{len(self._constants)}"
            self.initializers.append(onnx.numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]

    def node(self, op: str, inputs: Sequence[str], output: str | None = None, **attributes: object) -> str:
        self._count += 1
        output = output or f"{op.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=f"{op}_{self._count}", **attributes))
        return output

    def nodes_out(self, op: str, inputs: Sequence[str], count: int, **attributes: object) -> list[str]:
        self._count += 1
        outputs = [f"{op.lower()}_{self._count}_{i}" for i in range(count)]
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=f"{op}_{self._count}", **attributes))
        return outputs


Scalars = dict[str, dict[int, str]]  # quantity (step_size, bc2_sqrt, decay) -> ONNX dtype -> value name


def _schedule(w: _GraphWriter, slots: Sequence[ParamSlot], kind: str, per_param: bool) -> list[Scalars]:
    """Per slot, the scalars its update needs (``step_size``, ``bc2_sqrt``, ``decay``), per dtype.

    Computed in float64 (see Note [The update, as PyTorch computes it]): once per distinct
    rule with a shared schedule, as one vector over all parameters with a per-parameter one
    (then split into a scalar per parameter).
    """
    D = TensorProto.DOUBLE
    rows: list[UpdateRule]
    if per_param:
        rows, row_of = [s.rule for s in slots], list(range(len(slots)))
    else:
        distinct: dict[UpdateRule, int] = {}
        row_of = [distinct.setdefault(s.rule, len(distinct)) for s in slots]
        rows = list(distinct)
    if kind != "sgd":  # SGD has no bias correction: ``step`` stays an unused input
        step = w.node("Cast", [STEP], to=D)
        one = w.constant(1.0, D)

    def vector(values: list[float], row: int | None) -> str:
        return w.constant(values if row is None else values[row], D)

    def quantities(row: int | None) -> dict[str, str]:
        lr = LEARNING_RATE
        out: dict[str, str] = {}
        if kind == "sgd":
            out["step_size"] = w.node("Neg", [lr])
            return out
        b1 = vector([r.betas[0] for r in rows], row)
        b2 = vector([r.betas[1] for r in rows], row)
        bc1 = w.node("Sub", [one, w.node("Pow", [b1, step])])
        out["step_size"] = w.node("Neg", [w.node("Div", [lr, bc1])])
        bc2 = w.node("Sub", [one, w.node("Pow", [b2, step])])
        out["bc2_sqrt"] = w.node("Pow", [bc2, w.constant(0.5, D)])
        if kind == "adamw":
            wd = vector([r.weight_decay for r in rows], row)
            out["decay"] = w.node("Sub", [one, w.node("Mul", [lr, wd])])
        return out

    dtypes = sorted({_FLOAT_TYPES[s.dtype] for s in slots})
    per_row: list[Scalars] = []
    if per_param:
        # One vector per quantity, cast per dtype, split into one [1]-shaped scalar per parameter.
        vectors = quantities(None)
        split: dict[str, dict[int, list[str]]] = {}
        for q, name in vectors.items():
            split[q] = {}
            for t in dtypes:
                cast = name if t == D else w.node("Cast", [name], to=t)
                split[q][t] = w.nodes_out("Split", [cast], len(slots), axis=0, num_outputs=len(slots))
        for i in range(len(slots)):
            per_row.append({q: {t: parts[i] for t, parts in by_type.items()} for q, by_type in split.items()})
    else:
        for r in range(len(rows)):
            vectors = quantities(r)
            per_row.append({q: {t: (name if t == D else w.node("Cast", [name], to=t)) for t in dtypes}
                            for q, name in vectors.items()})
    scalars = [per_row[row_of[i]] for i in range(len(slots))]
    for i, s in enumerate(slots):
        if per_param and len(s.shape) == 0:  # a [1]-shaped scalar would make a 0-d parameter's update [1]-shaped
            scalars[i] = {q: {t: w.node("Squeeze", [v]) for t, v in by_type.items()}
                          for q, by_type in scalars[i].items()}
    return scalars


def _update(w: _GraphWriter, slot: ParamSlot, kind: str, scalars: Scalars) -> None:
    """The nodes updating one parameter (see Note [The update, as PyTorch computes it])."""
    t = _FLOAT_TYPES[slot.dtype]
    rule = slot.rule
    names_in, names_out = slot_inputs(slot.name, kind), slot_outputs(slot.name, kind)
    p, g = names_in[0], names_in[1]
    if kind in ("adam", "sgd") and rule.weight_decay != 0:
        g = w.node("Add", [g, w.node("Mul", [p, w.constant(rule.weight_decay, t)])])
    if kind == "sgd":
        w.node("Add", [p, w.node("Mul", [g, scalars["step_size"][t]])], output=names_out[0])
        return
    m, v = names_in[2], names_in[3]
    if kind == "adamw" and rule.weight_decay != 0:
        p = w.node("Mul", [p, scalars["decay"][t]])
    b1, b2 = rule.betas
    weight = np.float32(1.0 - b1) if t == TensorProto.FLOAT else np.float64(1.0 - b1)
    diff = w.node("Sub", [g, m])
    if abs(float(weight)) < 0.5:  # torch's lerp picks the form by the weight
        m_new = w.node("Add", [m, w.node("Mul", [w.constant(float(weight), t), diff])], output=names_out[1])
    else:
        rest = float(type(weight)(1) - weight)
        m_new = w.node("Sub", [g, w.node("Mul", [diff, w.constant(rest, t)])], output=names_out[1])
    scaled_g = w.node("Mul", [w.constant(1.0 - b2, t), g])
    v_new = w.node("Add", [w.node("Mul", [v, w.constant(b2, t)]), w.node("Mul", [scaled_g, g])], output=names_out[2])
    denom = w.node("Add", [w.node("Div", [w.node("Sqrt", [v_new]), scalars["bc2_sqrt"][t]]), w.constant(rule.eps, t)])
    step = w.node("Div", [w.node("Mul", [scalars["step_size"][t], m_new]), denom])
    w.node("Add", [p, step], output=names_out[0])


def build_optimizer_model(slots: Sequence[ParamSlot], *, per_param_schedule: bool = False) -> onnx.ModelProto:
    """The ONNX model updating every parameter in ``slots`` in one run.

    Args:
        slots: the parameters, in input order; they must share one ``rule.kind``.
        per_param_schedule: ``learning_rate`` and ``step`` are vectors with one entry per
            parameter (``FusedAdam``) instead of scalars (the on-device optimizer).

    Raises:
        ConfigError: for an empty list, mixed kinds, names that collide, or a dtype other
            than float32/float64.

    Example:
        >>> rule = UpdateRule.default("adamw")
        >>> model = build_optimizer_model([ParamSlot("w", np.float32, (4, 3), rule)])
        >>> [i.name for i in model.graph.input]
        ['learning_rate', 'step', 'w', 'w_grad', 'w_exp_avg', 'w_exp_avg_sq']
    """
    if not slots:
        raise ConfigError("the optimizer graph needs at least one parameter to update; none were given.")
    kinds = {s.rule.kind for s in slots}
    if len(kinds) > 1:
        raise ConfigError(f"one optimizer graph updates with one kind of optimizer; got {sorted(kinds)}.")
    kind = kinds.pop()
    names = [n for s in slots for n in slot_inputs(s.name, kind) + slot_outputs(s.name, kind)]
    names += [LEARNING_RATE, STEP]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        dup = sorted({n for n in names if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
        raise ConfigError(f"parameter names give the optimizer graph duplicate value names {dup}; rename the "
                          "parameters (a parameter may not be called 'step', or 'x_grad' beside 'x').")
    w = _GraphWriter()
    scalars = _schedule(w, slots, kind, per_param_schedule)
    for slot, s in zip(slots, scalars):
        _update(w, slot, kind, s)

    sched_shape = [len(slots)] if per_param_schedule else []
    inputs = [helper.make_tensor_value_info(LEARNING_RATE, TensorProto.DOUBLE, sched_shape),
              helper.make_tensor_value_info(STEP, TensorProto.INT64, sched_shape)]
    outputs = []
    for s in slots:
        t = _FLOAT_TYPES[s.dtype]
        inputs += [helper.make_tensor_value_info(n, t, list(s.shape)) for n in slot_inputs(s.name, kind)]
        outputs += [helper.make_tensor_value_info(n, t, list(s.shape)) for n in slot_outputs(s.name, kind)]
    graph = helper.make_graph(w.nodes, f"ortlab_{kind}_update", inputs, outputs, w.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="ortlab")
    model.ir_version = 10  # onnxruntime 1.20+ reads it
    layout = OptimizerLayout(kind, tuple(s.name for s in slots), per_param_schedule, tuple(s.rule for s in slots))
    helper.set_model_props(model, {LAYOUT_KEY: layout.to_json()})
    problems = check_in_place(model, aliases(layout))
    if problems:
        raise InternalError("the optimizer graph reads an input after overwriting it in place: " + "; ".join(problems),
                            context=graph.name)
    return model


def aliases(layout: OptimizerLayout) -> list[tuple[str, str]]:
    """``(input, output)`` pairs that share a buffer when the graph runs in place."""
    pairs = []
    for name in layout.params:
        ins, outs = slot_inputs(name, layout.kind), slot_outputs(name, layout.kind)
        pairs += [(ins[0], outs[0])] + list(zip(ins[2:], outs[1:]))
    return pairs


def check_in_place(model: onnx.ModelProto, pairs: Sequence[tuple[str, str]]) -> list[str]:
    """Why ``model`` cannot run with each ``(input, output)`` pair sharing a buffer (empty: it can).

    See Note [Updating in place]: every reader of the input must be the output's producer
    or one of its ancestors.
    """
    nodes = list(model.graph.node)
    producer = {out: i for i, n in enumerate(nodes) for out in n.output}
    problems = []
    for source, target in pairs:
        if target not in producer:
            problems.append(f"{target} is not produced by a node")
            continue
        ancestors, stack = set(), [producer[target]]
        while stack:
            i = stack.pop()
            if i in ancestors:
                continue
            ancestors.add(i)
            stack += [producer[x] for x in nodes[i].input if x in producer]
        late = [nodes[i].name for i, n in enumerate(nodes) if source in n.input and i not in ancestors]
        if late:
            problems.append(f"{', '.join(late)} read {source} but may run after {target} overwrote it")
    return problems
