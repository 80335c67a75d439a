"""Random numbers drawn ahead of the graph, so that a graph with dropout or stochastic depth runs in one
onnxruntime part.

Note [Random draws ahead of the graph]
A random op runs in PyTorch so that it draws eager's random numbers (``ortlab.placement``), and
the graph is cut around it: a BERT-base forward with dropout on ran as 51 parts, 37 dropouts in
PyTorch between them, each part a session of its own with its own first-call measurement and a
hand-over of its outputs. Yet what most random ops draw depends only on shapes, strides and
dtypes, and on the random stream, never on a tensor's values:

* a dropout's mask (``native_dropout``) on its input's layout. Its mask is drawn by
  ``native_dropout`` itself on a zero tensor laid out as eager's input was, and what the dropout
  computed from its input, ``input * mask * (1 / (1 - p))``, becomes two multiplies the graph's
  onnxruntime part runs (eager's kernel multiplies by the mask, then by the scale);
* ``rand``, ``randn``, ``randint``, ``randperm`` with every argument a plain value (stochastic
  depth's ``torch.rand((batch, 1, 1))`` in Hugging Face's Swin, ConvNeXt, BEiT, SegFormer): they
  read no tensor, and move to the top as they are;
* ``rand_like``, ``randn_like``, ``randint_like``, ``bernoulli.p`` (``empty(...).bernoulli_(p)``:
  ``dropout2d``, timm's ``drop_path``) and the in-place draws ``uniform_``, ``normal_``,
  ``exponential_``, ``cauchy_``, ``log_normal_``, ``geometric_`` (traced as functional ops on
  their tensor), which read their tensor's layout, not its values: each runs as it is on a zero
  tensor of that layout.

So where every random op of a graph is one of these, with static shapes, each is drawn at the top
of the graph, in the graph's order (which is eager's: Note [Random ops keep eager's order] in
``ortlab.runtime.split``): the same kernels, the same draws from the stream, so eager's numbers,
and the stream left where eager leaves it. Nothing onnxruntime runs draws from PyTorch's stream,
so drawing earlier changes nothing else. The nodes keep their names, so tools that follow a node
by name (the comparison with eager, the toggles) still find them.

A graph holding any other random op (``bernoulli`` of a tensor of probabilities, ``multinomial``,
``poisson``, ``normal`` about a tensor of means, RReLU's noise, a draw of a symbolic or empty shape,
one given a generator) keeps all of its random ops where they
are: drawing some numbers earlier would change which numbers the others get. So does a graph with
a random op named in ``fallback_ops``. The draws run in PyTorch, reported as random ops with the
reason they run where they do.
"""

from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx

from ortlab.placement import is_random, matches
from ortlab.provenance import op_name

__all__ = ["DRAWN_REASON", "HOISTED_REASON", "draw_random_ahead", "dropout_mask", "replayed_dropout_mask",
           "save_rng_state"]

aten = torch.ops.aten

HOISTED_REASON = ("random op (a dropout's mask): drawn in PyTorch at the top of the graph, in eager's order, so the "
                  "masks are eager's; the dropout's multiplies run in onnxruntime")
DRAWN_REASON = ("random op: drawn in PyTorch at the top of the graph, in eager's order, so its numbers are eager's; "
                "what uses them runs in onnxruntime")


@functools.lru_cache(maxsize=32)
def _zeros(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of this layout, made once: the draws only read their layout, and a fresh tensor each step cost
    its page faults (3 ms of the 21 a [8, 12, 128, 128] dropout mask took here)."""
    return torch.zeros_like(torch.empty_strided(shape, stride, dtype=dtype, device=device),
                            memory_format=torch.preserve_format)


def dropout_mask(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: torch.device,
                 p: float) -> torch.Tensor:
    """The mask ``native_dropout`` draws for an input of this layout (Note [Random draws ahead of the graph]): the same kernel on zeros laid out so, whose output is dropped."""
    return aten.native_dropout.default(_zeros(tuple(shape), tuple(stride), dtype, device), p, True)[1]


dropout_mask._ortlab_random = HOISTED_REASON  # type: ignore[attr-defined]  # placed in PyTorch, this reason


def _arguments(node: torch.fx.Node) -> tuple[object, object, object]:
    """A ``native_dropout`` node's input, probability and ``train`` flag (None: training, as ATen reads it)."""
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], node.kwargs.get("p", args[1]), node.kwargs.get("train", args[2])


def _provenance(node: torch.fx.Node) -> dict:
    """What the nodes that take over a dropout's work keep of its meta: all but its value."""
    return {k: v for k, v in node.meta.items() if k != "val"}


def _getitems(node: torch.fx.Node) -> dict[int, torch.fx.Node] | None:
    """The ``out[0]`` and ``out[1]`` nodes of a dropout, by index; None where something else reads it."""
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    return items if len(items) == len(node.users) else None


def _hoistable(node: torch.fx.Node) -> tuple[float, torch.Tensor] | None:
    """The probability and eager's input (a fake tensor) of a dropout whose mask can be drawn ahead."""
    x, p, train = _arguments(node)
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if (train is False or type(p) not in (int, float) or not isinstance(value, torch.Tensor)
            or not value.dtype.is_floating_point
            or any(not isinstance(s, int) for s in (*value.shape, *value.stride())) or value.numel() == 0):
        return None
    return float(p), value


def _drop_everything(gm: torch.fx.GraphModule) -> int:
    """Dropouts with p = 1 as ``x * 0`` and an all-False mask, drawing nothing (Note [A dropout of everything draws
    nothing]); how many there were."""
    graph, done = gm.graph, 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is aten.native_dropout.default]:
        x, p, train = _arguments(node)
        items = _getitems(node)
        if train is False or type(p) not in (int, float) or p != 1 or items is None:
            continue
        meta = _provenance(node)
        if 0 in items:
            items[0].target, items[0].args, items[0].kwargs = aten.mul.Tensor, (x, 0.0), {}
            items[0].meta.update(meta)
        if 1 in items:
            items[1].target, items[1].args, items[1].kwargs = aten.zeros_like.default, (x,), {"dtype": torch.bool}
            items[1].meta.update(meta)
        graph.erase_node(node)
        done += 1
    return done


# Note [A dropout of everything draws nothing]
# Eager's ``F.dropout`` (``nn.Dropout``) on the CPU returns ``input * 0`` for p = 1 without
# drawing a number, where the ``native_dropout`` AOTAutograd traces it into draws a whole mask
# of zeros: run in PyTorch, it moved the random stream on, and every later random op (the next
# step's dropouts) drew other numbers than eager's. Such a dropout is computed as eager does.


def _on_zeros(op: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
    """``op`` run on zeros of its tensor's layout, which is all it reads of the tensor (Note [Random draws ahead of
    the graph]); placed in PyTorch with ``DRAWN_REASON``."""

    def draw(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             *args: object, **kwargs: object) -> torch.Tensor:
        return op(_zeros(shape, stride, dtype, device), *args, **kwargs)

    draw.__name__ = draw.__qualname__ = name
    draw._ortlab_random = DRAWN_REASON  # type: ignore[attr-defined]
    return draw


# The ops that read only their tensor's layout, each drawn on zeros of it.
_ON_ZEROS = {op: _on_zeros(op, f"{op._opname}_ahead") for op in (
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
    aten.bernoulli.p, aten.uniform.default, aten.normal_functional.default, aten.exponential.default,
    aten.cauchy.default, aten.log_normal.default, aten.geometric.default)}
# The ops that read no tensor: drawn ahead as they are where every argument is a plain value.
_NO_TENSOR = {aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low,
              aten.randperm.default}


def _static_layout(value: object) -> bool:
    return (isinstance(value, torch.Tensor) and value.numel() > 0
            and all(isinstance(s, int) for s in (*value.shape, *value.stride())))


def _leaves(args: object) -> list[object]:
    out: list[object] = []
    torch.fx.node.map_aggregate(args, out.append)
    return out


def _plain(args: object, kwargs: dict) -> bool:
    """No argument is a node or a symbolic number, and no generator is given."""
    return (kwargs.get("generator") is None
            and not any(isinstance(a, (torch.fx.Node, torch.SymInt, torch.SymFloat)) for a in _leaves((args, kwargs))))


def _tensor_layout(node: torch.fx.Node) -> torch.Tensor | None:
    """Eager's value (a fake tensor) of the tensor a layout-only draw reads, where it can be drawn ahead."""
    x = node.args[0] if node.args else None
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return value if _static_layout(value) and _plain(node.args[1:], node.kwargs) else None  # type: ignore[return-value]


# Note [Checkpointed dropouts drawn ahead]
# Activation checkpointing (``torch.utils.checkpoint``, Hugging Face's ``gradient_checkpointing_enable()``)
# makes AOTAutograd wrap each random op of a checkpointed region: the forward runs it as
# ``run_and_save_rng_state(native_dropout, x, p, train)``, which saves the CPU generator's state and
# draws, and the backward recomputes it as ``run_with_rng_state(state, native_dropout, x, p, train)``,
# which draws from that state and puts the generator back as it was. Both are dropouts drawn ahead like
# any other: the forward's saves the state (``torch.get_rng_state()``) and draws the mask at the top;
# the backward's draws the mask from the saved state at the top of the backward, leaving the stream as
# it found it. A Hugging Face RoBERTa with gradient checkpointing and dropout then ran in one part per
# graph instead of 21. Other ops inside these wrappers, and other devices, keep them where they are.
def _rng_wrapper(node: torch.fx.Node) -> str | None:
    """``saved`` or ``replayed`` for AOTAutograd's wrappers around a CPU dropout; None for anything else."""
    name = op_name(node)
    if name not in ("run_and_save_rng_state", "run_with_rng_state"):
        return None
    args = list(node.args)
    if name == "run_with_rng_state":
        args = args[1:]
    if not args or args[0] is not aten.native_dropout.default or node.kwargs:
        return None
    inner = list(args[1:]) + [None] * (3 - len(args[1:]))
    x, p, train = inner[:3]
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if (train is False or type(p) not in (int, float) or not (0 <= p < 1) or not _static_layout(value)
            or not value.dtype.is_floating_point or value.device.type != "cpu"):
        return None
    return "saved" if name == "run_and_save_rng_state" else "replayed"


def save_rng_state() -> torch.Tensor:
    """The CPU generator's state, as ``run_and_save_rng_state`` saves it (Note [Checkpointed dropouts drawn ahead])."""
    return torch.get_rng_state()


save_rng_state._ortlab_random = DRAWN_REASON  # type: ignore[attr-defined]


def replayed_dropout_mask(state: torch.Tensor, shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
                          device: torch.device, p: float) -> torch.Tensor:
    """The mask a checkpointed dropout drew from ``state``, drawn again with the generator put back after it, as
    ``run_with_rng_state`` does (Note [Checkpointed dropouts drawn ahead])."""
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return dropout_mask(shape, stride, dtype, device, p)
    finally:
        torch.set_rng_state(current)


replayed_dropout_mask._ortlab_random = HOISTED_REASON  # type: ignore[attr-defined]


def _wrapper_items(node: torch.fx.Node, kind: str) -> tuple | None:
    """(state item or None, out item or None, mask item or None) of a wrapper whose users are only these items."""
    items = _getitems(node)
    if items is None or set(items) - {0, 1}:
        return None
    if kind == "replayed":  # (dropout's output, mask)
        return None, items.get(0), items.get(1)
    state, result = items.get(0), items.get(1)  # (state, (dropout's output, mask))
    inner = _getitems(result) if result is not None else {}
    if inner is None or set(inner) - {0, 1}:
        return None
    return state, inner.get(0), inner.get(1)


def _plan(node: torch.fx.Node) -> str | None:
    """How a random op is drawn ahead ("dropout", "as is", "on zeros", "saved dropout", "replayed dropout"); None
    where it cannot be."""
    wrapper = _rng_wrapper(node)
    if wrapper is not None:
        return f"{wrapper} dropout" if _wrapper_items(node, wrapper) is not None else None
    if node.target is aten.native_dropout.default:
        return "dropout" if _hoistable(node) is not None and _getitems(node) is not None else None
    if node.target in _NO_TENSOR:
        return "as is" if _plain(node.args, node.kwargs) and _static_layout(node.meta.get("val")) else None
    if node.target in _ON_ZEROS:
        return "on zeros" if _tensor_layout(node) is not None else None
    return None


def draw_random_ahead(gm: torch.fx.GraphModule, fallback_ops: Sequence[str] = ()) -> collections.Counter[str]:
    """Draw every random op of ``gm`` at its top, in its order, in place (Note [Random draws ahead of the graph]);
    how many of each kind were moved ("dropout mask", or the op's name), empty where the graph is left as it was.
    Dropouts with p = 1 draw nothing, as eager's (Note [A dropout of everything draws nothing])."""
    graph = gm.graph
    everything = _drop_everything(gm)
    randoms = [n for n in graph.nodes if is_random(n)]
    plans = [_plan(n) for n in randoms]
    # Left where they are: a random op that cannot be drawn ahead, or one named in fallback_ops, beside any others.
    if not randoms or None in plans or any(matches(n, selector) for n in randoms for selector in fallback_ops):
        if everything:
            graph.lint()
            gm.recompile()
        return collections.Counter()
    drawn: list[torch.fx.Node] = []  # in the graph's order, to be moved to its top
    done: collections.Counter[str] = collections.Counter()
    for node, plan in zip(randoms, plans):
        if plan == "dropout":
            drawn.append(_dropout_ahead(graph, node))
            done["dropout mask"] += 1
            continue
        if plan in ("saved dropout", "replayed dropout"):
            drawn.extend(_checkpointed_dropout_ahead(graph, node, plan.split()[0]))
            done["dropout mask"] += 1
            continue
        done[op_name(node)] += 1
        if plan == "on zeros":
            value = _tensor_layout(node)
            layout = (tuple(value.shape), tuple(value.stride()), value.dtype, value.device)  # type: ignore[union-attr]
            node.target, node.args = _ON_ZEROS[node.target], (*layout, *node.args[1:])  # type: ignore[index]
        else:
            node.meta["ortlab_random"] = DRAWN_REASON
        drawn.append(node)
    anchor = next((n for n in reversed(graph.nodes) if n.op == "placeholder"), None)
    for node in drawn:
        if anchor is None:  # a graph without inputs: the first draw goes first
            first = next(iter(graph.nodes))
            if first is not node:
                first.prepend(node)
        else:
            anchor.append(node)
        anchor = node
    graph.lint()
    gm.recompile()
    return done


def _dropout_ahead(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    """A dropout as its mask's draw (returned, still in place) and ``input * mask * scale`` where out[0] was."""
    p, value = _hoistable(node)  # type: ignore[misc]
    items = _getitems(node) or {}
    args = (tuple(value.shape), tuple(value.stride()), value.dtype, value.device, p)
    mask = items.get(1)
    if mask is None:
        with graph.inserting_before(node):
            mask = graph.call_function(dropout_mask, args)
        mask.meta["val"] = node.meta["val"][1] if isinstance(node.meta.get("val"), (tuple, list)) else None
    else:  # out[1] becomes the draw, under the name eager's graph gave the mask
        mask.target, mask.args, mask.kwargs = dropout_mask, args, {}
    mask.meta.update(_provenance(node))
    if items.get(0) is not None:
        _masked_and_scaled(graph, items[0], node.args[0], mask, p, _provenance(node))
    graph.erase_node(node)
    return mask


def _masked_and_scaled(graph: torch.fx.Graph, out: torch.fx.Node, x: torch.fx.Node, mask: torch.fx.Node, p: float,
                       meta: dict) -> None:
    """A dropout's output node ``out`` rewritten as ``x * mask * (1 / (1 - p))``, as eager's kernel computes it."""
    with graph.inserting_before(out):
        masked = graph.call_function(aten.mul.Tensor, (x, mask))
    masked.meta.update(meta)
    masked.meta["val"] = out.meta.get("val")
    out.target, out.args, out.kwargs = aten.mul.Tensor, (masked, 1.0 / (1.0 - p)), {}  # p < 1 here
    out.meta.update(meta)


def _checkpointed_dropout_ahead(graph: torch.fx.Graph, node: torch.fx.Node, kind: str) -> list[torch.fx.Node]:
    """A checkpointed dropout (Note [Checkpointed dropouts drawn ahead]) as its draws (returned in order, still in
    place: the saved state, then the mask) and ``input * mask * scale`` where its output was."""
    state, out, mask = _wrapper_items(node, kind)  # type: ignore[misc]
    args = list(node.args[1:] if kind == "saved" else node.args[2:])
    x, p = args[0], float(args[1])
    value = x.meta["val"]
    layout = (tuple(value.shape), tuple(value.stride()), value.dtype, value.device, p)
    meta = _provenance(node)
    drawn: list[torch.fx.Node] = []
    if kind == "saved":
        if state is None:
            with graph.inserting_before(node):
                state = graph.call_function(save_rng_state, ())
        else:
            state.target, state.args, state.kwargs = save_rng_state, (), {}
        state.meta.update(meta)
        drawn.append(state)
        draw, draw_args = dropout_mask, layout
    else:
        draw, draw_args = replayed_dropout_mask, (node.args[0], *layout)
    if mask is None:
        with graph.inserting_before(node):
            mask = graph.call_function(draw, draw_args)
        mask.meta["val"] = value.new_empty_strided(value.shape, value.stride(), dtype=torch.bool)
    else:
        mask.target, mask.args, mask.kwargs = draw, draw_args, {}
    mask.meta.update(meta)
    drawn.append(mask)
    if out is not None:
        _masked_and_scaled(graph, out, x, mask, p, meta)
    result = next((u for u in node.users), None) if kind == "saved" else None
    if result is not None and not result.users:
        graph.erase_node(result)
    if not node.users:
        graph.erase_node(node)
    return drawn
