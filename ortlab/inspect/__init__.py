"""Inspection tools: compare a step with eager PyTorch, find the ops that diverge.

Example:
    >>> from ortlab.inspect import compare
    >>> print(compare(model, x, y))      # doctest: +SKIP
"""

from ortlab.inspect.bisect import BisectResult, bisect_fallbacks
from ortlab.inspect.compare import CompareResult, compare
from ortlab.inspect.loss import default_loss
from ortlab.inspect.repro import write_repro

__all__ = ["compare", "CompareResult", "bisect_fallbacks", "BisectResult", "write_repro", "default_loss"]
