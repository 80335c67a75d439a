"""Clean an exported graph with onnxscript's optimizer before onnxruntime sees it.

torchlib's translation leaves many small nodes (shape arithmetic, Constant nodes,
``SplitToSequence`` + ``SequenceAt`` for every ``split``). onnxscript's optimizer folds
constants and these patterns (the GPT's forward went from 804 to 207 nodes, its step
~3% faster). It also makes the saved ``*_onnxscript`` stage readable. A failure here is
logged and the exported graph is used as it is.
"""

from __future__ import annotations

import logging
import time

import onnxscript.optimizer

from ortlab.errors import first_line
from ortlab.onnx.export import ExportedGraph, bypass_output_identities

__all__ = ["optimize_exported"]

logger = logging.getLogger(__name__)


def optimize_exported(exported: ExportedGraph) -> float:
    """Optimize ``exported.model`` in place; returns the seconds it took."""
    start = time.perf_counter()
    names_in = [v.name for v in exported.model.graph.inputs]
    names_out = [v.name for v in exported.model.graph.outputs]
    quiet = logging.getLogger("onnx_ir")  # "Skipped deduplication of initializer ..." on every graph
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        onnxscript.optimizer.optimize_ir(exported.model)
    except Exception as e:  # the optimizer is best effort; the exported graph is correct
        logger.warning("onnxscript's optimizer failed on %s (%s); using the graph as exported",
                       exported.model.graph.name, first_line(e))
    finally:
        quiet.setLevel(level)
    bypass_output_identities(exported.model)
    if [v.name for v in exported.model.graph.inputs] != names_in or [v.name for v in exported.model.graph.outputs] != names_out:
        raise RuntimeError("onnxscript's optimizer changed the graph's inputs or outputs")
    return time.perf_counter() - start
