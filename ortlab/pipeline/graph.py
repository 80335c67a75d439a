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

import logging
from collections.abc import Callable

import torch.fx

from ortlab.errors import DeviceError, ExportError, FallbackError, InternalError, SessionError, first_line
from ortlab.pipeline.part import GraphContext, PartBuilder, PlacementRetry
from ortlab.pipeline.random_draws import draw_random_ahead
from ortlab.placement import Placement, check_raise, initial_placement, is_random
from ortlab.report import Fallback, GraphRecord, warn_fallback
from ortlab.runtime.observe import observed_graph
from ortlab.runtime.split import boxed, split_graph
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
    fn, record = _compile(gm, name, mode, ctx, split_s)
    if ctx.observer is not None:
        fn = observed_graph(fn, record, label(ctx.capture), ctx.observer)
    return fn, record


def _compile(gm: torch.fx.GraphModule, name: str, mode: str, ctx: GraphContext,
             split_s: float) -> tuple[Callable, GraphRecord]:
    record = GraphRecord(name=name, mode=mode, fx_ops=count_ops(gm), capture=ctx.capture, graph_module=gm)
    if ctx.stages.wants(name):
        ctx.stages.emit(StageArtifact(name, ctx.capture, mode, name, content=gm, seconds=split_s))
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
