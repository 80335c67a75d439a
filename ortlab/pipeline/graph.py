"""Compile one FX graph (forward, backward or inference) into something AOTAutograd can call.

The graph's ops are placed (``ortlab.placement``: what runs in PyTorch and why), the
rest is split into onnxruntime parts (``ortlab.runtime.split``), and each part is
built (``ortlab.pipeline.part``). When a part fails on ops that can run in PyTorch
(a translation that raises, a kernel onnxruntime lacks), those ops are placed in
PyTorch and the graph is split again. Each op that stays in PyTorch is recorded with
its reason and warned once; a graph that cannot run in onnxruntime at all runs in
PyTorch as a whole, recorded and warned the same way (or raises, with
``fallback="raise"``).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from collections.abc import Callable

import torch
import torch.fx

from ortlab._compat.torch import OpOverload, aot_user_outputs
from ortlab.capture.float_edges import even_splits_as_on_cpu
from ortlab.errors import DeviceError, ExportError, FallbackError, InternalError, SessionError, first_line
from ortlab.pipeline.part import GraphContext, PartBuilder, PlacementRetry
from ortlab.pipeline.random_draws import draw_random_ahead
from ortlab.placement import Placement, check_raise, initial_placement, is_random
from ortlab.report import Fallback, GraphRecord, warn_fallback
from ortlab.runtime.observe import observed_graph
from ortlab.runtime.split import boxed, copy_graph, split_graph
from ortlab.stages import StageArtifact, count_ops, label

__all__ = ["compile_graph"]

logger = logging.getLogger(__name__)

_MAX_RETRIES = 50


def compile_graph(gm: torch.fx.GraphModule, name: str, mode: str, ctx: GraphContext,
                  split_s: float = 0.0) -> tuple[Callable, GraphRecord]:
    """Compile ``gm`` for AOTAutograd: a boxed callable and the record of what was done.

    ``split_s`` is what the partitioner took to make ``gm`` (the FX stage's seconds).

    With ``ctx.observer`` set, the callable and each onnxruntime session in it tell the
    observer of every call (see Note [Observing compiled graphs]).

    Raises:
        FallbackError: when ``fallback="raise"`` and anything would run in PyTorch.
    """
    views = _output_views(gm) if name != "backward" else None
    fn, record = _compile(views.graph if views is not None else gm, name, mode, ctx, split_s, shown=gm)
    if views is not None:
        fn = _making_views(fn, views)
        record.notes.extend(views.notes(record.label))
    if ctx.observer is not None:
        fn = observed_graph(fn, record, label(ctx.capture), ctx.observer)
    return fn, record


def _compile(gm: torch.fx.GraphModule, name: str, mode: str, ctx: GraphContext,
             split_s: float, shown: torch.fx.GraphModule) -> tuple[Callable, GraphRecord]:
    """``gm`` compiled; ``shown`` is the graph AOTAutograd gave (its stage), of which ``gm`` may return
    views' bases (Note [Outputs that alias])."""
    record = GraphRecord(name=name, mode=mode, fx_ops=count_ops(shown), capture=ctx.capture, graph_module=gm)
    if ctx.stages.wants(name):
        ctx.stages.emit(StageArtifact(name, ctx.capture, mode, name, content=shown, seconds=split_s))
    if name == "backward" and ctx.device.type == "cpu":
        even_splits_as_on_cpu(gm)  # Note [An even split of the gradient as the CPU kernel writes it]
    drawn = draw_random_ahead(gm, ctx.options.fallback_ops)
    if drawn:
        what = ", ".join(f"{n} dropout mask(s)" if kind == "dropout mask" else f"{n} {kind}" for kind, n in drawn.items())
        record.notes.append(f"{record.label}: {what} drawn at the top of the graph, in eager's order, and what uses "
                            "them runs in onnxruntime (Note [Random draws ahead of the graph], "
                            "ortlab/pipeline/random_draws.py)")
    nodes = {n.name: n for n in gm.graph.nodes}
    placed = initial_placement(gm, ctx.options.fallback_ops, ctx.options.cache_dir)
    builder = PartBuilder(ctx, record, nodes)
    for _ in range(_MAX_RETRIES):
        check_raise(placed, record.label, ctx.options.fallback)
        builder.reset()
        try:
            # Random ops read eager's layouts wherever they run in PyTorch, named in fallback_ops too
            random = {name for name, p in placed.items()
                      if p.kind == "random" or (name in nodes and is_random(nodes[name]))}
            fn = split_graph(gm, placed, builder, random)
        except PlacementRetry as retry:
            new = {n: p for n, p in retry.placements.items() if n not in placed}
            if not new:
                return _whole_graph_fallback(gm, ctx, record, retry.error)
            placed.update(new)
            continue
        except (ExportError, SessionError) as e:
            return _whole_graph_fallback(gm, ctx, record, e)
        except (FallbackError, DeviceError):
            raise
        except Exception as e:  # a bug on our side or in a library: never crash training
            logger.warning("ortlab: unexpected error while compiling %s", record.label, exc_info=e)
            return _whole_graph_fallback(gm, ctx, record, InternalError(first_line(e, 200), context=record.label))
        break
    else:
        return _whole_graph_fallback(gm, ctx, record, InternalError("too many failing ops", context=record.label))
    for placement in placed.values():
        fb = _fallback(placement, record.label)
        record.fallbacks.append(fb)
        warn_fallback(fb)
    record.torch_nodes = len(placed)
    return fn, record


def _fallback(p: Placement, where: str) -> Fallback:
    return Fallback(scope="op", where=where, reason=p.reason, node=p.node, op=p.op, module=p.module,
                    source=p.source, kind=p.kind)


def _whole_graph_fallback(gm: torch.fx.GraphModule, ctx: GraphContext, record: GraphRecord,
                          error: Exception) -> tuple[Callable, GraphRecord]:
    reason = f"graph could not run in onnxruntime: {first_line(error, 600 if isinstance(error, InternalError) else 300)}"
    if ctx.options.fallback == "raise":
        raise FallbackError(f"graph {record.label} would run in PyTorch: {reason}") from error
    fb = Fallback(scope="graph", where=record.label, reason=reason)
    record.onnx_ops, record.ort_partitions, record.parts = {}, 0, []
    record.fallbacks.append(fb)
    record.torch_nodes = sum(record.fx_ops.values())
    warn_fallback(fb)
    logger.debug("graph %s falls back to PyTorch", record.label, exc_info=error)
    return boxed(gm.forward), record


# Note [Outputs that alias]
# In eager, outputs share memory with each other and with inputs: ``y, y.view(2, 2, 4),
# y.view(2, 2, 4)[0]`` are one storage, ``x[1]`` and ``w.t()`` are an input's or a
# parameter's; a write through one is seen through the others. onnxruntime returns each output
# in a buffer of its own, so ``z0.zero_()`` did not reach ``y``. AOTAutograd's
# ``ViewAndMutationMeta.output_info`` says what it repairs itself: an output aliasing an input
# (``alias_of_input``, ``is_input``), and with grad one aliasing an intermediate that is also
# an output or that it returns as an extra base (``alias_of_intermediate*``), is regenerated
# from its base after the compiled graph runs (``gen_alias_from_base``): it replays the view
# ops it recorded (``view_meta_sequence``), or, where their arguments are symbolic, views the
# base with the compiled output's own size, stride and offset (``as_strided``). Without grad,
# outputs aliasing an intermediate are ``non_alias``: AOTAutograd trusts the compiler to return
# them as views (Inductor returns views of its buffers). So the compiled graph must return its
# outputs aliased as its FX graph makes them. With a dynamic batch, onnxruntime's fresh,
# contiguous buffer for ``x.view(b, 2, 2)[:, 1]`` had AOTAutograd view ``x`` at offset 0 with
# contiguous strides: wrong values, silently.
# compile_graph does what AOTAutograd does with a base. A user's output (Note [What an
# AOTAutograd graph's outputs are]) made by view ops from a graph input or constant, or from a
# value another user output is or views, is returned by the graph that runs as that base
# instead (None for an input), and its view ops, the graph's own nodes with their symbolic
# sizes read from the graph's inputs, are replayed on the base in PyTorch: the same storage,
# offsets and strides as eager (``detach``/``alias`` are the base itself, as the exporter makes
# them). Where a view's layout is static, one ``as_strided`` of the base at eager's size,
# strides and offset makes it (the view ops replayed took twice as long: 38 against 19 us for
# the repro's two views on a loaded 2-core machine), checked each call against the base's
# strides: a base not laid out as in eager gets the view ops. Only graphs with such outputs
# pay; the others are compiled and called as before. Saved tensors keep
# onnxruntime's buffers (no user sees them), and so does a lone view of an intermediate
# (AOTAutograd hides that aliasing itself with ``_unsafe_view``). An ``as_strided`` among the
# graph's own view ops reads memory, not values: replayed on an intermediate whose eager layout
# is not the contiguous one onnxruntime returns, it would read other elements, so such an
# output stays a copy (the graph's notes say so).
_SAME_TENSOR = frozenset({torch.ops.aten.alias.default, torch.ops.aten.detach.default})
_READS_MEMORY = frozenset({torch.ops.aten.as_strided.default})
_NOT_VIEWS = frozenset({torch.ops.aten.lift_fresh.default})


def _is_view(node: object) -> bool:
    """Whether ``node`` views its first argument (an item of a view op's list counts: ``split``)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or not node.args:
        return False
    if node.target is operator.getitem:
        return _is_view(node.args[0]) and isinstance(node.args[0].meta.get("val"), (list, tuple))
    return (isinstance(node.target, OpOverload) and node.target.is_view and node.target not in _NOT_VIEWS
            and isinstance(node.args[0], torch.fx.Node))


def _base_of(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The value whose storage ``node`` views, and the view nodes from it to ``node`` in order."""
    chain = []
    while _is_view(node):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _contiguous(val: object) -> bool:
    try:
        return isinstance(val, torch.Tensor) and bool(val.is_contiguous())
    except Exception:  # an unbacked size: not decidable here
        return False


@dataclasses.dataclass
class _OutputViews:
    """How a graph's aliasing outputs are made (Note [Outputs that alias]).

    Attributes:
        graph: the graph that runs: each such output's slot returns its base (None for an input or
            constant), and the values the views read that are neither follow the graph's own outputs.
        outputs: how many outputs the graph AOTAutograd gave returns.
        inputs: the graph inputs ``make`` reads (bases, sizes).
        bases: the output slots ``make`` reads its bases from, after ``inputs``.
        positions: the outputs ``make`` returns, in its order.
        make: the view ops, replayed: ``make(*inputs, *bases, *carried) -> views``.
        kept_copies: outputs that stay copies, with why.
        strided: where every view has static sizes: per output of ``positions``, ``(input, index, size,
            stride, offset, base_stride)``: its base (``inputs[index]`` or output slot ``index``), viewed with
            ``as_strided`` at ``offset`` from the base's own where the base's strides are ``base_stride``
            (eager's layout); None otherwise.
    """

    graph: torch.fx.GraphModule
    outputs: int
    inputs: list[int]
    bases: list[int]
    positions: list[int]
    make: Callable[..., tuple]
    kept_copies: list[str]
    strided: list[tuple[bool, int, tuple, tuple, int, tuple]] | None = None

    def notes(self, where: str) -> list[str]:
        views = (f"{where}: {len(self.positions)} output(s) alias an input or another output, as in eager: made as "
                 "views of their base in PyTorch (Note [Outputs that alias], ortlab/pipeline/graph.py)")
        return [views] + [f"{where}: {why}" for why in self.kept_copies]


def _output_views(gm: torch.fx.GraphModule) -> _OutputViews | None:
    """The plan for ``gm``'s outputs that alias an input or another output, None where none do."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outputs = out.args[0]
    if not isinstance(outputs, (list, tuple)):
        return None
    user = aot_user_outputs(gm) or [True] * len(outputs)
    bases: dict[int, tuple[torch.fx.Node, list[torch.fx.Node]]] = {}
    sharing: Counter = Counter()
    for k, (o, seen) in enumerate(zip(outputs, user)):
        if seen and isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor):
            base, chain = _base_of(o)
            bases[k] = (base, chain)
            sharing[base] += 1
    kept_copies: list[str] = []
    positions = []
    for k, (base, chain) in bases.items():
        if all(n.target in _SAME_TENSOR for n in chain):
            continue  # the base itself (or nothing to make)
        outside = base.op in ("placeholder", "get_attr")
        if not outside and sharing[base] < 2:
            continue
        if not outside and any(n.target in _READS_MEMORY for n in chain) and not _contiguous(base.meta.get("val")):
            kept_copies.append(f"output {k} ({chain[-1].name}) is an as_strided view of {base.name}, whose eager "
                               "layout onnxruntime does not keep: it is returned as a copy, not aliasing")
            continue
        positions.append(k)
    if not positions:
        return None

    # What the replayed views read: their chains, the sizes they take (copied where they are
    # computed from what the views can read), inputs, constants, bases; anything else is carried.
    chains = {n for k in positions for n in bases[k][1]}
    intermediate = {bases[k][0] for k in positions if bases[k][0].op not in ("placeholder", "get_attr")}
    needed: set[torch.fx.Node] = set()
    carried: list[torch.fx.Node] = []

    def need(node: torch.fx.Node) -> None:
        if node in needed:
            return
        needed.add(node)
        if node in chains or (node.op == "call_function" and not isinstance(node.meta.get("val"), torch.Tensor)
                              and node not in intermediate):
            torch.fx.node.map_arg((node.args, node.kwargs), need)
        elif node.op not in ("placeholder", "get_attr") and node not in intermediate:
            carried.append(node)  # a tensor the views read that is neither a base nor an input

    for k in positions:
        need(outputs[k])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [i for i, p in enumerate(placeholders) if p in needed]
    base_slot = {}
    for k in positions:
        base_slot.setdefault(bases[k][0], k)
    base_order = [b for b in base_slot if b in intermediate]

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in inputs:
        env[placeholders[i]] = graph.placeholder(placeholders[i].name)
    for b in base_order:
        env[b] = graph.placeholder(b.name)
    for c in carried:
        env[c] = graph.placeholder(c.name)
    for node in gm.graph.nodes:
        if node not in needed or node in env:
            continue
        if node.target in _SAME_TENSOR and node in chains:
            env[node] = env[node.args[0]]
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[outputs[k]] for k in positions))
    make = torch.fx.GraphModule(gm, graph).forward

    # The graph that runs: each view's slot returns its base (None for an input or a constant).
    runs = copy_graph(gm)
    named = {n.name: n for n in runs.graph.nodes}
    run_out = next(n for n in reversed(runs.graph.nodes) if n.op == "output")
    slots = list(run_out.args[0])
    for k in positions:
        base = bases[k][0]
        slots[k] = named[base.name] if base in intermediate else None
    slots.extend(named[c.name] for c in carried)
    run_out.args = (type(outputs)(slots),)
    unread = {n.name for n in chains}
    for node in reversed(list(runs.graph.nodes)):  # the views no one reads now
        if node.name in unread and not node.users:
            runs.graph.erase_node(node)
    runs.recompile()
    strided = [_strided(bases[k][0], outputs[k], inputs, placeholders, k) for k in positions]
    return _OutputViews(runs, len(outputs), inputs, [base_slot[b] for b in base_order], positions, make, kept_copies,
                        strided if all(v is not None for v in strided) else None)


def _static(t: torch.Tensor) -> tuple[tuple, tuple, int] | None:
    layout = (tuple(t.shape), tuple(t.stride()), t.storage_offset())
    return layout if all(type(n) is int for n in (*layout[0], *layout[1], layout[2])) else None


def _strided(base: torch.fx.Node, view: torch.fx.Node, inputs: list[int], placeholders: list[torch.fx.Node],
             slot: int) -> tuple[bool, int, tuple, tuple, int, tuple] | None:
    """How ``view`` is made from ``base`` with one ``as_strided`` (Note [Outputs that alias]), None where its
    layout is not static or its dtype differs from the base's."""
    base_val, val = base.meta.get("val"), view.meta.get("val")
    if base.op == "get_attr" or not isinstance(base_val, torch.Tensor) or not isinstance(val, torch.Tensor) \
            or val.dtype != base_val.dtype or val.is_complex():
        return None
    have, want = _static(base_val), _static(val)
    if have is None or want is None:
        return None
    source = (True, inputs.index(placeholders.index(base))) if base.op == "placeholder" else (False, slot)
    return (*source, want[0], want[1], want[2] - have[2], have[1])


def _making_views(fn: Callable, views: _OutputViews) -> Callable:
    """``fn`` (boxed, compiled from ``views.graph``) returning the outputs of the graph AOTAutograd gave,
    its aliasing outputs made as views (Note [Outputs that alias])."""
    inputs, bases, positions, outputs, make = views.inputs, views.bases, views.positions, views.outputs, views.make
    strided = views.strided

    def run(args: list) -> list:
        kept = [args[i] for i in inputs]  # before fn releases them (boxed convention)
        out = list(fn(args))
        made = []
        if strided is not None:  # one as_strided a view, where each base is laid out as in eager
            for from_input, index, size, stride, offset, base_stride in strided:
                base = kept[index] if from_input else out[index]
                if base.stride() != base_stride:
                    break
                made.append(base.as_strided(size, stride, base.storage_offset() + offset))
        if len(made) != len(positions):
            made = make(*kept, *[out[k] for k in bases], *out[outputs:])
        del out[outputs:]
        for k, view in zip(positions, made):
            out[k] = view
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
