"""Decisions that noise cannot flip: paired step measurements of the incumbent plan (T0) and a
candidate (T1) judged with a confidence interval.

Per pair, each arm's value is the slowest rank's (a step is gated by it; every rank computes this
from the same all-gathered observations, so every rank decides the same). Outliers are recognized
per arm against its median and robust spread (a step 20x off is not evidence) and their pairs
left out. The increment is estimated by the mean paired difference; its interval's two ends are
one-sided Student t bounds at ``confidence`` each (the decision that matters is one-sided: is
the candidate faster?), their error rate split over the looks a sequential calibration takes
(Bonferroni), so adding pairs until a candidate is decided does not inflate it. A candidate is
faster when its upper bound is below minus the smallest gain worth a plan change (``min_gain``
of the incumbent's measured region: a real but negligible effect would otherwise be accepted in
some runs and not in others), slower when its lower bound is above zero, else undecided (more
pairs, or, once the budget is spent, rejected: do no harm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Literal

from scipy.stats import t as student_t

# an observation further than this many robust standard deviations from its arm's median is an outlier
OUTLIER_SIGMAS = 6.0
# the robust spread is at least this fraction of the median: with a few near-identical steps the
# median absolute deviation is ~0, and an ordinary step would count as an outlier (so only a step
# more than 30% off its arm's median can be one)
MIN_RELATIVE_SPREAD = 0.05

Verdict = Literal["faster", "slower", "undecided"]


@dataclass(frozen=True)
class DecisionRule:
    """How sure a decision must be: the interval's ``confidence`` over the whole sequential
    calibration, and the measured pairs one candidate may use before it is rejected undecided."""

    confidence: float = 0.95
    max_pairs: int = 24
    min_gain: float = 0.01  # the smallest improvement accepted, as a fraction of the incumbent's region

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1:
            raise ValueError(f"calibration confidence must be in [0.5, 1), got {self.confidence}")
        if self.max_pairs < 3:
            raise ValueError(f"calibration needs at least 3 measured pairs per candidate, got max_pairs={self.max_pairs}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"min_gain is a fraction of the measured region in [0, 1), got {self.min_gain}")


def robust_sigma(values: list[float]) -> float:
    """The standard deviation a normal sample with these values' median absolute deviation has."""
    if not values:
        return 0.0
    center = median(values)
    return 1.4826 * median(abs(v - center) for v in values)


def _outliers(t0: list[float], t1: list[float]) -> list[bool]:
    """Per pair: whether either arm's value is an outlier (its spread estimated from both arms'
    deviations from their own medians, so a candidate's real effect is not one)."""
    m0, m1 = median(t0), median(t1)
    deviations = [a - m0 for a in t0] + [b - m1 for b in t1]
    spread = max(robust_sigma(deviations), MIN_RELATIVE_SPREAD * abs(m0), 1e-9)
    return [abs(a - m0) > OUTLIER_SIGMAS * spread or abs(b - m1) > OUTLIER_SIGMAS * spread for a, b in zip(t0, t1)]


@dataclass
class PairedEstimate:
    increment_ms: float  # the mean paired difference T1 - T0 over the pairs kept
    interval_ms: tuple[float, float]  # its one-sided bounds (infinite with fewer than 2 pairs)
    noise_ms: float  # the robust standard deviation of the incumbent's steps
    pairs: int  # pairs used
    outliers: int  # pairs left out
    verdict: Verdict


def paired_estimate(t0: list[float], t1: list[float], confidence: float, looks: int,
                    min_gain: float = 0.0) -> PairedEstimate:
    """The increment of T1 over T0 from paired observations (one value per pair and arm); faster
    only beyond ``min_gain`` of the incumbent's median."""
    if len(t0) != len(t1):
        raise ValueError(f"{len(t0)} incumbent and {len(t1)} candidate observations do not pair up")
    if not 0 < confidence < 1 or looks < 1:
        raise ValueError(f"confidence must be in (0, 1) and looks >= 1, got {confidence}, {looks}")
    bad = _outliers(t0, t1) if t0 else []
    kept = [(a, b) for (a, b, out) in zip(t0, t1, bad) if not out]
    diffs = [b - a for a, b in kept]
    noise = robust_sigma([a for a, _ in kept])
    n = len(diffs)
    if n == 0:
        return PairedEstimate(math.nan, (-math.inf, math.inf), noise, 0, len(bad), "undecided")
    mean = sum(diffs) / n
    if n < 2:
        return PairedEstimate(mean, (-math.inf, math.inf), noise, n, len(bad) - n, "undecided")
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    alpha = (1 - confidence) / looks
    half = float(student_t.ppf(1 - alpha, n - 1)) * sd / math.sqrt(n)
    low, high = mean - half, mean + half
    threshold = -min_gain * median(a for a, _ in kept)
    verdict: Verdict = "faster" if high < threshold else "slower" if low > 0 else "undecided"
    return PairedEstimate(mean, (low, high), noise, n, len(bad) - n, verdict)


def look_points(min_pairs: int, max_pairs: int) -> list[int]:
    """The pair counts at which a sequential calibration decides or goes on: from the minimum
    (at least 3: fewer pairs cannot bound a t interval usefully), doubling (few looks keep each
    one's error share large), and the budget."""
    points = [max(min_pairs, 3)]
    if max_pairs <= points[0]:
        return [max(min_pairs, max_pairs)]
    while points[-1] * 2 < max_pairs:
        points.append(points[-1] * 2)
    return points + [max_pairs]
