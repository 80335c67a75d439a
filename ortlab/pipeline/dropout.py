"""Dropout masks drawn ahead of the graph, so that a graph with dropout runs in one onnxruntime part.

Note [Dropout masks drawn ahead of the graph]
A random op runs in PyTorch so that it draws eager's random numbers (``ortlab.placement``), and
the graph is cut around it: a BERT-base forward with dropout on ran as 51 parts, 37 dropouts in
PyTorch between them, each part a session of its own with its own first-call measurement and a
hand-over of its outputs. Yet a dropout's mask depends only on its input's shape, strides and
dtype, and on the random stream, never on the input's values. So where every random op of a graph
is a ``native_dropout`` with a static shape, each mask is drawn at the top of the graph, in the
graph's order (which is eager's: Note [Random ops keep eager's order] in ``ortlab.runtime.split``),
by ``native_dropout`` itself on a zero tensor laid out as eager's input was: the same kernel, the
same draws from the stream, so the same mask as eager's, and the stream left where eager leaves
it. What the dropout computed from its input, ``input * mask * (1 / (1 - p))``, becomes two
multiplies the graph's onnxruntime part runs (eager's kernel multiplies by the mask, then by the
scale). The dropout's output and mask nodes keep their names, so tools that follow a node by name
(the comparison with eager, the toggles) still find them.

A graph holding any other random op (``rand`` for stochastic depth, ``bernoulli``) keeps its
dropouts where they are: drawing some numbers earlier would change which numbers the others get.
So does a dropout named in ``fallback_ops``, one whose shape is symbolic or empty, and one
whose probability is not a plain number. The masks are drawn in PyTorch, reported as random ops
like the dropouts were.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch
import torch.fx

from ortlab.placement import RANDOM_OPS, matches
from ortlab.provenance import op_name

__all__ = ["dropout_mask", "hoist_dropout_masks", "HOISTED_REASON"]

aten = torch.ops.aten

HOISTED_REASON = ("random op (a dropout's mask): drawn in PyTorch at the top of the graph, in eager's order, so the "
                  "masks are eager's; the dropout's multiplies run in onnxruntime")


@functools.lru_cache(maxsize=32)
def _zeros(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of this layout, made once: ``native_dropout`` only reads them, and a fresh tensor each step cost
    its page faults (3 ms of the 21 a [8, 12, 128, 128] mask took here)."""
    return torch.zeros_like(torch.empty_strided(shape, stride, dtype=dtype, device=device),
                            memory_format=torch.preserve_format)


def dropout_mask(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: torch.device,
                 p: float) -> torch.Tensor:
    """The mask ``native_dropout`` draws for an input of this layout (Note [Dropout masks drawn ahead of the
    graph]): the same kernel on zeros laid out so, whose output is dropped."""
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


def hoist_dropout_masks(gm: torch.fx.GraphModule, fallback_ops: Sequence[str] = ()) -> int:
    """Draw every dropout's mask at the top of ``gm`` and multiply in the graph, in place (Note [Dropout masks
    drawn ahead of the graph]); the number of dropouts changed (0: the graph is left as it was). Dropouts
    with p = 1 draw nothing, as eager's (Note [A dropout of everything draws nothing])."""
    graph = gm.graph
    everything = _drop_everything(gm)
    randoms = [n for n in graph.nodes if n.op == "call_function" and op_name(n) in RANDOM_OPS]
    dropouts = [n for n in randoms if n.target is aten.native_dropout.default]
    found = [_hoistable(n) for n in dropouts]
    uses = [_getitems(n) for n in dropouts]
    # Left where they are: other random ops beside them, a dropout that cannot be drawn ahead (_hoistable), one
    # read other than as out[0] and out[1] (never seen from AOTAutograd), or one named in fallback_ops.
    if (not dropouts or len(dropouts) != len(randoms) or None in found or None in uses
            or any(matches(n, selector) for n in dropouts for selector in fallback_ops)):
        if everything:
            graph.lint()
            gm.recompile()
        return 0
    top = next(n for n in graph.nodes if n.op != "placeholder")
    masks = []
    for node, (p, value), items in zip(dropouts, found, uses):  # type: ignore[misc]
        args = (tuple(value.shape), tuple(value.stride()), value.dtype, value.device, p)
        mask = items.get(1)
        if mask is None:
            with graph.inserting_before(top):
                mask = graph.call_function(dropout_mask, args)
            mask.meta["val"] = node.meta["val"][1] if isinstance(node.meta.get("val"), (tuple, list)) else None
        else:  # out[1] becomes the draw, under the name eager's graph gave the mask
            mask.target, mask.args, mask.kwargs = dropout_mask, args, {}
            top.prepend(mask)
        mask.meta.update(_provenance(node))
        masks.append(mask)
    for node, (p, _), items, mask in zip(dropouts, found, uses, masks):  # type: ignore[misc]
        out = items.get(0)
        if out is not None:  # out[0] becomes input * mask * scale, as eager's kernel computes it
            with graph.inserting_before(out):
                masked = graph.call_function(aten.mul.Tensor, (node.args[0], mask))
            masked.meta.update(_provenance(node))
            masked.meta["val"] = out.meta.get("val")
            out.target, out.args, out.kwargs = aten.mul.Tensor, (masked, 1.0 / (1.0 - p)), {}  # p < 1 here
            out.meta.update(_provenance(node))
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return len(dropouts)
