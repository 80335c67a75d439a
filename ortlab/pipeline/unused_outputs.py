"""Gradients of outputs the loss does not use: left out of the backward, as eager leaves them.

Note [Gradients of outputs a loss does not use]
In eager PyTorch an output the loss does not reach gets no gradient: its backward never runs.
A compiled graph is one autograd node for all its outputs, and autograd hands it zeros for the
unused ones (``materialize_grads``). AOTAutograd's backward then multiplies those zeros by each
output's local derivative, and where that derivative is infinite or NaN the zero becomes NaN:
``y = x.log(); z = x * 2`` with ``z.sum().backward()`` gave x's gradient NaN at x = 0 where eager
gives 2 (torch.compile does the same). A model that returns an auxiliary output (a log-probability,
a square root, a normalized vector) and a loss that skips it poisoned the step.

So each compiled graph's autograd node gets a pre-hook that sees which gradients are missing (None)
before autograd fills them with zeros, and the backward, told which of its tangents those are, runs a
variant of the backward graph without them: each such tangent is a symbolic zero (``_without``) that
products, quotients, views and sums keep zero and sums drop, so nothing is multiplied by it; a gradient
made of nothing but them is None, as in eager. The variant is compiled once per set of missing tangents
(the report lists it as a backward graph of its own, with a note).

Autograd's gradients map to the backward's tangents as AOTAutograd's backward prologue keeps them
(``ortlab._compat.torch.tangent_positions``, from the compiled function's metadata); where the metadata
does not say, or the count differs from the graph's tangents, the backward runs as it is. A real
gradient of zeros is a tangent like any other (a loss head that kept no row hands its zeros back). A
graph that draws random numbers in its backward keeps its one backward (leaving an op out would shift
the draws after it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch
import torch.fx

from ortlab._compat.torch import OpOverload, tangent_positions
from ortlab.placement import is_random
from ortlab.runtime.split import copy_graph

__all__ = ["watching", "absent_aware"]

logger = logging.getLogger(__name__)
aten = torch.ops.aten
_NODE = "CompiledFunctionBackward"
_state = threading.local()


class _Missing:
    """The pre-hook of one autograd node: which of its tangents are missing, for the backward that follows."""

    __slots__ = ("positions",)

    def __init__(self, positions: tuple[int, ...]) -> None:
        self.positions = positions

    def __call__(self, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        _state.missing = (len(self.positions),
                          tuple(j for j, i in enumerate(self.positions) if i < len(grad_outputs)
                                and grad_outputs[i] is None))


def _compiled_node(t: torch.Tensor) -> object | None:
    node = t.grad_fn
    if node is None:
        return None
    if type(node).__name__ == _NODE:
        return node
    # an output AOTAutograd rebuilds as a view of a base it returns (Note [Outputs that alias])
    nexts = node.next_functions
    if len(nexts) == 1 and nexts[0][0] is not None and type(nexts[0][0]).__name__ == _NODE:
        return nexts[0][0]
    return None


def watching(compiled: Callable) -> Callable:
    """``compiled`` (the callable Dynamo runs) with a pre-hook on the autograd node of each call's outputs."""

    def run(*args: object) -> object:
        out = compiled(*args)
        if torch.is_grad_enabled():
            seen: set[int] = set()
            for o in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    node = _compiled_node(o)
                    if node is not None and id(node) not in seen:
                        seen.add(id(node))
                        positions = tangent_positions(node)
                        if positions:
                            node.register_prehook(_Missing(positions))  # type: ignore[attr-defined]
        return out

    return run


def absent_aware(fx: torch.fx.GraphModule, fn: Callable,
                 compile_variant: Callable[[torch.fx.GraphModule, str], Callable]) -> Callable:
    """The backward ``fn`` (boxed, compiled from ``fx``), which in a step where some outputs were unused runs the
    variant of ``fx`` without their tangents (compiled by ``compile_variant(graph, note)`` on first need)."""
    placeholders = [n for n in fx.graph.nodes if n.op == "placeholder"]
    tangents = [i for i, n in enumerate(placeholders) if n.name.startswith("tangents")]
    if not tangents or any(is_random(n) for n in fx.graph.nodes if n.op == "call_function"):
        return fn
    variants: dict[tuple[int, ...], Callable | None] = {}

    def run(args: list) -> object:
        count, missing = getattr(_state, "missing", (0, ()))
        _state.missing = (0, ())
        if missing and count == len(tangents):
            if missing not in variants:
                variants[missing] = _variant(fx, [placeholders[tangents[j]].name for j in missing], compile_variant)
            variant = variants[missing]
            if variant is not None:
                return variant(args)
        return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _variant(fx: torch.fx.GraphModule, names: list[str],
             compile_variant: Callable[[torch.fx.GraphModule, str], Callable]) -> Callable | None:
    gm = copy_graph(fx)
    if not _without(gm, set(names)):
        return None
    note = (f"the backward for steps whose loss does not use the outputs with gradients {', '.join(names)}: those "
            "are left out, as eager never runs their backward (Note [Gradients of outputs a loss does not use], "
            "ortlab/pipeline/unused_outputs.py)")
    logger.debug("backward without %s", names)
    return compile_variant(gm, note)


# Ops whose result is zero when the argument at one of these positions is zero (the others finite or not).
_ZERO_IF_ANY = {aten.mul.Tensor: (0, 1), aten.mul.Scalar: (0,), aten.mm.default: (0, 1), aten.bmm.default: (0, 1),
                aten.div.Tensor: (0,), aten.div.Scalar: (0,)}
# Ops linear in their first argument alone, zero when it is.
_ZERO_IF_FIRST = {
    aten.neg.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.unsqueeze.default, aten.clone.default, aten.alias.default, aten.slice.Tensor,
    aten.select.int, aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
    aten._to_copy.default, aten.index_select.default, aten.gather.default, aten.flip.default, aten.roll.default,
    aten.select_backward.default, aten.slice_backward.default, aten.embedding_dense_backward.default,
    aten.as_strided.default, aten.expand_copy.default, aten.view_copy.default, aten.permute_copy.default,
    aten.constant_pad_nd.default, aten.repeat.default, aten.cumsum.default,
}


def _is_zero_value(a: object) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a == 0


def _without(gm: torch.fx.GraphModule, names: set[str]) -> bool:
    """Rewrite ``gm`` with the tangents ``names`` as symbolic zeros (Note [Gradients of outputs a loss does not
    use]); False when it changed nothing worth a session of its own."""
    zero: set[torch.fx.Node] = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in names}
    graph = gm.graph
    made: dict[torch.fx.Node, torch.fx.Node] = {}
    changed = False

    def materialize(z: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
        """Zeros of ``z``'s shape, for an op that is not linear in it."""
        if z in made:
            return made[z]
        val = z.meta.get("val")
        with graph.inserting_before(before):
            if isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape):
                new = graph.call_function(aten.zeros.default, (list(val.shape),),
                                          {"dtype": val.dtype, "device": val.device})
            else:  # sizes only known at run time: zeros like the node (whose values are not read)
                new = graph.call_function(aten.zeros_like.default, (z,), {})
        new.meta = dict(z.meta)
        made[z] = new
        return new

    def same_as(node: torch.fx.Node, other: object) -> bool:
        a, b = node.meta.get("val"), other.meta.get("val") if isinstance(other, torch.fx.Node) else None
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape)

    for node in list(graph.nodes):
        if node.op == "output":
            outs = node.args[0]
            flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            if any(o in zero for o in flat if isinstance(o, torch.fx.Node)):
                node.args = ([None if (isinstance(o, torch.fx.Node) and o in zero) else o for o in flat],)
                changed = True
            continue
        if node.op != "call_function" or node in zero:
            continue
        uses = [a for a in node.all_input_nodes if a in zero]
        if not uses:
            continue
        t = node.target
        args = node.args
        if isinstance(t, OpOverload) and t in _ZERO_IF_ANY:
            if any(i < len(args) and isinstance(args[i], torch.fx.Node) and args[i] in zero for i in _ZERO_IF_ANY[t]):
                zero.add(node)
                changed = True
                continue
        if t in _ZERO_IF_FIRST and args and isinstance(args[0], torch.fx.Node) and args[0] in zero \
                and not any(a in zero for a in node.all_input_nodes if a is not args[0]):
            zero.add(node)
            changed = True
            continue
        if t in (aten.add.Tensor, aten.sub.Tensor) and len(args) == 2 and node.kwargs.get("alpha", 1) == 1:
            a, b = args
            a_zero = isinstance(a, torch.fx.Node) and a in zero
            b_zero = isinstance(b, torch.fx.Node) and b in zero
            if a_zero and (b_zero or _is_zero_value(b)):
                zero.add(node)
                changed = True
                continue
            if b_zero and same_as(node, a):
                node.replace_all_uses_with(a)  # x + 0, x - 0
                changed = True
                continue
            if a_zero and t is aten.add.Tensor and same_as(node, b):
                node.replace_all_uses_with(b)  # 0 + x
                changed = True
                continue
            if a_zero and t is aten.sub.Tensor and same_as(node, b):
                with graph.inserting_before(node):
                    neg = graph.call_function(aten.neg.default, (b,), {})
                neg.meta = dict(node.meta)
                node.replace_all_uses_with(neg)  # 0 - x
                changed = True
                continue
        if t in (aten.where.self,) and len(args) == 3:
            _, a, b = args
            a_zero = isinstance(a, torch.fx.Node) and a in zero
            b_zero = isinstance(b, torch.fx.Node) and b in zero
            if (a_zero or _is_zero_value(a)) and (b_zero or _is_zero_value(b)):
                zero.add(node)
                changed = True
                continue
        if t is aten.masked_fill.Scalar and isinstance(args[0], torch.fx.Node) and args[0] in zero \
                and _is_zero_value(args[2]) and args[1] not in zero:
            zero.add(node)
            changed = True
            continue
        for z in uses:  # an op not linear in it: real zeros
            node.replace_input_with(z, materialize(z, node))
    if not changed:
        return False
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return True
