"""Clean an exported graph with onnxscript's optimizer before onnxruntime sees it.

torchlib's translation leaves many small nodes (shape arithmetic, Constant nodes,
``SplitToSequence`` + ``SequenceAt`` for every ``split``). onnxscript's optimizer folds
constants and these patterns (the GPT's forward went from 804 to 207 nodes, its step
~3% faster). It also makes the saved ``onnxscript`` stage readable. Its rewrite rules
change no number: their constants are matched exactly, not within onnxscript's 1e-5
(``x + 1e-8`` stays; Note [Pattern constants matched exactly] in ``ortlab._compat.onnxscript``).

The optimizer is best effort: when it raises, or changes the graph's inputs or outputs
(which the runtime feeds by position), the result says why, and the caller runs the
graph as exported instead (``ortlab.pipeline.part`` exports it again: keeping a copy
of every graph in case the optimizer fails cost ~2% of the first step). The exported
graph is correct either way; only speed is lost.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from ortlab._compat.onnxscript import optimize
from ortlab._workers import worker
from ortlab.errors import first_line
from ortlab.onnx.export import ExportedGraph, bypass_output_identities

__all__ = ["OptimizeResult", "optimize_exported"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OptimizeResult:
    """What onnxscript's optimizer did to one graph.

    Attributes:
        seconds: the time it took.
        skipped: why its result cannot be used ("" when it can): the model may then be
            half-optimized, and must be exported again.
    """

    seconds: float
    skipped: str = ""


# Note [The optimizer runs on a thread of its own]
# CPython 3.11 keeps frames in a stack of memory chunks and frees a chunk as soon as the
# frames in it return. Code that calls and returns in a loop right at a chunk boundary
# maps and unmaps a chunk on every call: onnxscript's rewriter, run from inside
# Dynamo and AOTAutograd (100+ frames deep), took 2-3.5 s on the GPT's forward instead of
# 0.4 s, with 230,000 page faults (perf: _PyThreadState_BumpFramePointerSlow), and which
# graph hit a boundary changed with any function added on the way. A thread of its own
# starts the optimizer at the same shallow depth every time: 0.4 s, whatever the caller.
# Above this many Slice nodes, SlicesSplit's pairwise search costs more than it can save.
_MANY_SLICES = 64


def _on_fresh_stack(fn, *args):  # noqa: ANN001, ANN002, ANN202
    """``fn(*args)`` on ortlab's optimizer thread (see Note [The optimizer runs on a thread of its own])."""
    return worker("optimizer").submit(fn, *args).result()


def optimize_exported(exported: ExportedGraph) -> OptimizeResult:
    """Optimize ``exported.model`` in place; ``skipped`` says why the result is unusable, if it is."""
    start = time.perf_counter()
    graph = exported.model.graph
    names_in, names_out = [v.name for v in graph.inputs], [v.name for v in graph.outputs]
    quiet = logging.getLogger("onnx_ir")  # "Skipped deduplication of initializer ..." on every graph
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    skipped = ""
    try:
        sliced = collections.Counter(node.inputs[0] for node in graph if node.op_type == "Slice" and node.inputs)
        slices = sum(sliced.values())
        if slices > _MANY_SLICES or not any(n >= 2 for n in sliced.values()):
            # see Note [onnxscript's optimizer without SlicesSplit] in ortlab._compat
            logger.debug("%s has %d Slice nodes: onnxscript's SlicesSplit rule left out", graph.name, slices)
            _on_fresh_stack(optimize, exported.model, ("SlicesSplit",))
        else:
            _on_fresh_stack(optimize, exported.model)
        bypass_output_identities(exported.model)
        graph = exported.model.graph
        if [v.name for v in graph.inputs] != names_in or [v.name for v in graph.outputs] != names_out:
            skipped = "onnxscript's optimizer changed the graph's inputs or outputs"
    except Exception as e:  # the optimizer is best effort; the exported graph is correct
        skipped = f"onnxscript's optimizer failed: {first_line(e)}"
    finally:
        quiet.setLevel(level)
    if skipped:
        logger.warning("ortlab: %s on %s; the graph runs as exported (correct, possibly slower)",
                       skipped, exported.model.graph.name)
    return OptimizeResult(time.perf_counter() - start, skipped)
