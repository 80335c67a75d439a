"""Predicate-driven reduction: the smallest subset of candidates for which a test still passes.

The shape of Polygraphy's ``debug reduce``: try the hints alone, bisect (keep whichever
half still passes), then remove items one at a time (linear), so the result is
1-minimal: dropping any item of it makes the predicate fail. Nothing here knows about
models or ops; :func:`ortlab.inspect.bisect.bisect_fallbacks` is the search that uses it
with "these ops in PyTorch make the step match" as the predicate.

Example:
    >>> minimize(list(range(8)), lambda s: 3 in s and 5 in s)[0]
    [3, 5]
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from ortlab.errors import OrtlabError

__all__ = ["Trial", "minimize"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One evaluation of the predicate: the ops in PyTorch and whether the step then matched."""

    ops: tuple[str, ...]
    passed: bool
    seconds: float


def minimize(
    items: Sequence[T],
    predicate: Callable[[list[T]], bool],
    *,
    hints: Sequence[T] = (),
    max_trials: int = 64,
) -> tuple[list[T], list[Trial]]:
    """A 1-minimal subset of ``items`` for which ``predicate`` holds.

    Assumes ``predicate(items)`` holds and ``predicate([])`` does not (the caller checks
    both). Each hint is tried alone first; then bisection keeps a half that passes
    while one does; then a linear pass drops every item the predicate does not need.
    Results are memoized by subset.

    Raises:
        OrtlabError: after ``max_trials`` evaluations.

    Example:
        >>> minimize(list(range(8)), lambda s: 5 in s)[0]
        [5]
    """
    memo: dict[frozenset, bool] = {}
    trials: list[Trial] = []

    def test(subset: list[T]) -> bool:
        key = frozenset(subset)
        if key not in memo:
            if len(trials) >= max_trials:
                raise OrtlabError(
                    f"the reduction gave up after {max_trials} trials (last: {subset}); "
                    "pass fewer candidates or a larger max_trials."
                )
            start = time.perf_counter()
            memo[key] = bool(predicate(list(subset)))
            trials.append(Trial(tuple(map(str, subset)), memo[key], time.perf_counter() - start))
            logger.info("trial %s: %s", list(subset), "passes" if memo[key] else "fails")
        return memo[key]

    current = list(items)
    for hint in hints:
        if hint in current and test([hint]):
            return [hint], trials
    while len(current) > 1:  # bisect
        half = len(current) // 2
        if test(current[:half]):
            current = current[:half]
        elif test(current[half:]):
            current = current[half:]
        else:
            break
    for item in list(current):  # linear
        rest = [x for x in current if x != item]
        if rest and test(rest):
            current = rest
    return current, trials
