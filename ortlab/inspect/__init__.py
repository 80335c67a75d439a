"""Inspection tools: compare a step with eager PyTorch, find the ops that diverge.

Example:
    >>> from ortlab.inspect import compare
    >>> print(compare(model, x, y))      # doctest: +SKIP
"""

from ortlab.inspect.bisect import BisectResult, bisect_fallbacks, write_repro
from ortlab.inspect.compare import CompareResult, compare
from ortlab.inspect.loss import default_loss

__all__ = ["compare", "CompareResult", "bisect_fallbacks", "BisectResult", "write_repro", "default_loss"]
