"""Step times with their spread, and the one rule every ortlab tool compares them by.

Shared by the recompute toggles (``ortlab.ui.toggles``) and ``compare_speed``
(``ortlab.inspect.speed``): each side is the median of several steps with its spread
(min to max), and a difference that the spreads cover is called noise.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

__all__ = ["Timing", "compare_timings", "overlap"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Step times of one configuration: median, and the spread (min to max) of the steps measured.

    Steps after a re-capture only: the capture step is warm-up and never counted.
    """

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        return min(self.samples)

    @property
    def high(self) -> float:
        return max(self.samples)

    def __str__(self) -> str:
        return f"{1000 * self.median:.1f} ms ({1000 * self.low:.1f}-{1000 * self.high:.1f}, {len(self.samples)} steps)"


def compare_timings(before: Timing, after: Timing) -> str:
    """``before -> after`` with the ratio, or "within noise" when the spreads overlap.

    Note [Noisy timings are not findings]: a single step on a shared 2-core machine varies by
    tens of percent ("0.72x", "2.26x slower" were single readings). Each side is the median of
    several steps with its spread, and a difference the spreads cover is called noise.
    """
    ratio = after.median / before.median if before.median else float("nan")
    if overlap(before, after) or not math.isfinite(ratio):
        verdict = "within noise (the two ranges of step times overlap)"
    elif ratio < 1:  # the claim is the medians' ratio, and what the spreads support at the least
        verdict = (f"{1 / ratio:.2f}x faster by the medians, at least {before.low / after.high:.2f}x "
                   "(the fastest step before against the slowest after)")
    else:
        verdict = (f"{ratio:.2f}x slower by the medians, at least {after.low / before.high:.2f}x "
                   "(the slowest step before against the fastest after)")
    return f"step {before} -> {after}: {verdict}"


def overlap(a: Timing, b: Timing) -> bool:
    """Whether the two ranges (min to max) overlap: their difference is within noise."""
    return a.low <= b.high and b.low <= a.high

