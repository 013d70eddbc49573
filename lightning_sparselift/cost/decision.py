"""Decisions that noise cannot flip: paired step measurements of the incumbent plan (T0) and a
candidate (T1) judged with a confidence interval.

Per pair, each arm's value is the slowest rank's (a step is gated by it; every rank computes this
from the same all-gathered observations, so every rank decides the same). Outliers are recognized
per arm against its median and robust spread (a step 20x off is not evidence) and their pairs
left out. The increment is the Hodges-Lehmann estimate of the paired differences (the median of
their pairwise averages) and its interval's two ends are one-sided Wilcoxon signed-rank bounds at
``confidence`` each: both hold without assuming normal steps, and on this machine's step times
(heavy-tailed: ~10% of pairs differ by more than 15 ms on an 80 ms step) they reject a candidate
without effect far more reliably than a t interval at the same power (replayed on 150 measured
pairs each of early start, next batch and an A/A trial on dlrm: 0.1-0.4% false acceptances against
0.5-2%). The error rate is split over the looks a sequential calibration takes (Bonferroni, each
look's share in proportion to its pairs, so the last look, which decides the hard cases, keeps
most of it), so adding pairs until a candidate is decided does not inflate it. A candidate is faster when its
upper bound is below minus the smallest gain worth a plan change, slower when its lower bound is
above zero, else undecided (more pairs, or, once the budget is spent, rejected: do no harm). The
smallest gain is a fraction of the incumbent's step whatever region measures the candidate (1% of
a 3 ms lookup region is no gain worth changing an 80 ms step's plan), and that fraction is set by
what the region can resolve: a real effect below it would be accepted in some runs and not in
others. Whole steps and the executor's sparse regions (wall time, ~10% noise) resolve ~0.5% of
the step within the budget; the lookup regions (their kernels' own thread CPU time, noise ~1% of
the region) resolve ~0.1%. No candidate is accepted before ``accept_from_pairs`` pairs: with
fewer, a bound rests on nearly every pair going one way, which one run of heavy-tailed steps
gives a candidate of small effect by chance. A sequential calibration also stops a candidate whose
estimate, after enough pairs, is not even half that smallest gain (``negligible``: more pairs
would spend steps on a candidate that cannot win).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from statistics import median
from typing import Literal, Optional

import numpy as np

# an observation further than this many robust standard deviations from its arm's median is an outlier
OUTLIER_SIGMAS = 6.0
# the robust spread is at least this fraction of the median: with a few near-identical steps the
# median absolute deviation is ~0, and an ordinary step would count as an outlier (so only a step
# more than 30% off its arm's median can be one)
MIN_RELATIVE_SPREAD = 0.05

# a sequential calibration stops a candidate as negligible from this many pairs on (the look at
# 80 with the default looks): from 24 (the look at 32), output layout on dlrm (~-2 ms of a 90 ms
# step, step-CPU noise ~4 ms) was stopped as negligible in 1 of 10 calibrations (+0.11 ms at 32
# pairs); on injected timings (200 seeds, 7.5 ms noise) a -3 ms effect was stopped so 26 times at
# 24 and 5 at 48, while a candidate without effect spends 115 pairs on average instead of 93
NEGLIGIBLE_FROM_PAIRS = 48

# the regions that time only one part's own compute (see CalibrationProtocol.region)
KERNEL_REGIONS = ("lookup", "lookup_wall", "input", "layout_cpu")

Verdict = Literal["faster", "slower", "undecided", "negligible", "futile"]


@dataclass(frozen=True)
class DecisionRule:
    """How sure a decision must be: the interval's ``confidence`` over the whole sequential
    calibration, and the measured pairs one candidate may use before it is rejected undecided."""

    # measured together (cost/design.py), many candidates share their steps, so a round's budget is
    # set by the hardest one. Injected timings (test_decision.py's: 6 ms step noise with heavy
    # tails; one candidate, 200 seeds): at 0.95 and 128 pairs (119 within the round's 240 steps)
    # a -4.5 ms effect was accepted 198 times, -3 ms 135 times and one without effect 4 times; at
    # 96 pairs -4.5 ms 196 times; at 0.99 / 64 pairs 31 of 40. The smallest gain below keeps a
    # candidate without effect from passing at the nominal rate
    confidence: float = 0.95
    # measured blocks (pairs) one design may use before its undecided candidates are rejected
    max_pairs: int = 128
    # the smallest improvement accepted, as a fraction of the incumbent's step, for candidates
    # measured on the whole step or the sparse regions: on dlrm (10 calibrations each) at 0.005
    # early start (-3.4 to -14 ms) was accepted 10/10 and next batch (~1 ms) 0/10; at 0.002 next
    # batch came through in 2 of 10, its effect being below what the steps resolve
    min_gain: float = 0.005
    # the same for candidates measured on one part's regions (lookups, input side): generated
    # lookups on dlrm measured -0.23 to -0.50 ms of 80-100 ms steps with intervals ~0.1 ms wide;
    # at 0.005 they were accepted in 3 of 10 calibrations, at 0.002 in 9 of 10 (the miss:
    # [-0.293, -0.170])
    min_lookup_gain: float = 0.001
    # no candidate is accepted at fewer measured pairs (its first look then only rejects)
    accept_from_pairs: int = 12
    # the calibration steps one planning round may use in all (its designs' budgets shrink to fit;
    # candidates no design could fit are not calibrated): the demo's 300 steps leave room for the
    # steady-state check after it
    max_steps: int = 240
    # and at most this share of the training steps left when the round starts, where the run's
    # length is known (None: no such limit): a plan decided late has little of the run left to win
    # back its calibration (two_tower, 300 steps: a 240-step budget went to a -0.5 ms candidate
    # on a 30 ms step that 140 steps could not resolve)
    run_share: Optional[float] = 1 / 3

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1:
            raise ValueError(f"calibration confidence must be in [0.5, 1), got {self.confidence}")
        look_points(1, self.max_pairs, self.confidence)  # raises when the budget cannot bound anything
        for name in ("min_gain", "min_lookup_gain"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} is a fraction of the incumbent's step in [0, 1), got {getattr(self, name)}")
        if self.accept_from_pairs < 1:
            raise ValueError(f"accept_from_pairs must be >= 1, got {self.accept_from_pairs}")
        if self.max_steps < 0:
            raise ValueError(f"the calibration budget must be >= 0 steps, got {self.max_steps}")
        if self.run_share is not None and not 0 < self.run_share <= 1:
            raise ValueError(f"run_share is a share of the training steps left in (0, 1] or None, got {self.run_share}")

    def for_run(self, steps_left: float) -> "DecisionRule":
        """This rule with the budget of a round that starts ``steps_left`` training steps before
        the run ends (``math.inf``: not known): at most :attr:`run_share` of them."""
        if self.run_share is None or math.isinf(steps_left):
            return self
        return replace(self, max_steps=min(self.max_steps, int(self.run_share * max(steps_left, 0))))

    def min_gain_for(self, region: str) -> float:
        """The smallest gain accepted for a candidate measured on ``region`` (see
        :class:`~lightning_sparselift.cost.calibration.CalibrationProtocol`)."""
        return self.min_lookup_gain if region in KERNEL_REGIONS else self.min_gain


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
    increment_ms: float  # the Hodges-Lehmann estimate of T1 - T0 over the pairs kept
    interval_ms: tuple[float, float]  # its one-sided bounds (infinite while too few pairs to bound it)
    noise_ms: float  # the robust standard deviation of the incumbent's steps
    pairs: int  # pairs used
    outliers: int  # pairs left out
    verdict: Verdict
    threshold_ms: float = 0.0  # minus the smallest gain accepted (the upper bound must be below it)
    resolvable_ms: Optional[float] = None  # (futile) the smallest effect the whole budget would resolve


@lru_cache(maxsize=None)
def _signed_rank_cdf(n: int) -> np.ndarray:
    """P(W+ <= w), w = 0 .. n(n+1)/2, of the signed-rank statistic of n pairs without effect
    (exact: every sign pattern equally likely)."""
    p = np.zeros(n * (n + 1) // 2 + 1)
    p[0] = 1.0
    for rank in range(1, n + 1):  # the rank's sign adds 0 or ``rank`` to W+, each with probability 1/2
        p[rank:] = (p[rank:] + p[:-rank]) / 2
        p[:rank] /= 2
    return np.cumsum(p)


def signed_rank_bounds(diffs: list[float], alpha: float) -> tuple[float, float, float]:
    """(Hodges-Lehmann estimate, lower, upper): the median of the pairwise (Walsh) averages of
    ``diffs`` and its one-sided Wilcoxon signed-rank bounds at level ``1 - alpha`` each (the
    c+1-th smallest and largest average, c the largest statistic value with P(W+ <= c) <= alpha);
    infinite when ``diffs`` are too few to bound it at that level (2^-n > alpha)."""
    d = np.asarray(diffs, dtype=np.float64)
    i, j = np.triu_indices(len(d))
    walsh = np.sort((d[i] + d[j]) / 2)
    estimate = float(np.median(walsh))
    c = int(np.searchsorted(_signed_rank_cdf(len(d)), alpha, side="right")) - 1
    if c < 0:
        return estimate, -math.inf, math.inf
    return estimate, float(walsh[c]), float(walsh[-c - 1])


def bounding_pairs(alpha: float) -> int:
    """The fewest pairs whose signed-rank bounds exist at level ``1 - alpha`` (all pairs one way
    happen with probability 2^-n without effect)."""
    return max(1, math.ceil(math.log2(1 / alpha) - 1e-12))


def paired_estimate(t0: list[float], t1: list[float], confidence: float, looks: int,
                    min_gain: float = 0.0, incumbent_steps: Optional[list[float]] = None) -> PairedEstimate:
    """The increment of T1 over T0 from paired observations (one value per pair and arm); faster
    only beyond ``min_gain`` of the incumbent's median step (``incumbent_steps``: per pair the T0
    step's wall time when the observations measure a region of it; default: they are the steps)."""
    if len(t0) != len(t1) or (incumbent_steps is not None and len(incumbent_steps) != len(t0)):
        raise ValueError(f"{len(t0)} incumbent and {len(t1)} candidate observations do not pair up")
    bad = _outliers(t0, t1) if t0 else []
    steps = incumbent_steps if incumbent_steps is not None else t0
    kept = [(a, b) for (a, b, out) in zip(t0, t1, bad) if not out]
    kept_steps = [s for s, out in zip(steps, bad) if not out]
    threshold = -min_gain * median(kept_steps) if kept else 0.0
    if not 0 < confidence < 1 or looks < 1:
        raise ValueError(f"confidence must be in (0, 1) and looks >= 1, got {confidence}, {looks}")
    return increment_estimate([b - a for a, b in kept], (1 - confidence) / looks, threshold,
                              robust_sigma([a for a, _ in kept]), sum(bad))


def increment_estimate(diffs: list[float], alpha: float, threshold_ms: float, noise_ms: float,
                       outliers: int = 0) -> PairedEstimate:
    """The increment from paired differences (outliers already left out), its bounds at level
    ``1 - alpha`` each: faster when the upper bound is below ``threshold_ms`` (minus the smallest
    gain accepted), slower when the lower bound is above zero."""
    if not diffs:
        return PairedEstimate(math.nan, (-math.inf, math.inf), noise_ms, 0, outliers, "undecided", threshold_ms)
    estimate, low, high = signed_rank_bounds(diffs, alpha)
    verdict: Verdict = "faster" if high < threshold_ms else "slower" if low > 0 else "undecided"
    return PairedEstimate(estimate, (low, high), noise_ms, len(diffs), outliers, verdict, threshold_ms)


def judged(e: PairedEstimate, pairs_at_look: int, rule: DecisionRule) -> PairedEstimate:
    """A sequential calibration's verdict at one look: no acceptance before the rule's
    ``accept_from_pairs`` (or its ``max_pairs``, if fewer: a budget set that small decides with
    it), also when a round's budget leaves a design fewer; an undecided candidate is
    ``negligible`` once its interval lies above the smallest gain (it is surely smaller than worth
    a change) or, from :data:`NEGLIGIBLE_FROM_PAIRS` pairs on, its estimate is not even half that
    gain."""
    if e.verdict == "faster" and pairs_at_look < min(rule.accept_from_pairs, rule.max_pairs):
        e = replace(e, verdict="undecided")
    if e.verdict == "undecided" and (e.interval_ms[0] > e.threshold_ms or (
            e.pairs >= NEGLIGIBLE_FROM_PAIRS and e.increment_ms > e.threshold_ms / 2)):
        e = replace(e, verdict="negligible")
    return e


def look_points(min_pairs: int, max_pairs: int, confidence: float) -> list[int]:
    """The pair counts at which a sequential calibration decides or goes on: from the fewest
    pairs that can be bounded at the first look's error rate (:func:`look_alphas`; or
    ``min_pairs``, if more), doubling (few looks keep each one's error share large), and the
    budget. Raises when ``max_pairs`` cannot be bounded at ``confidence``."""
    first = max(min_pairs, 1)
    while True:
        points = [first]
        while points[-1] * 2 < max_pairs:
            points.append(points[-1] * 2)
        if max_pairs > points[-1]:
            points.append(max_pairs)
        need = bounding_pairs(look_alphas(points, confidence)[0])
        if first >= need:
            return points
        if need > max_pairs:
            if max_pairs >= bounding_pairs(1 - confidence):
                return [max_pairs]  # one look, all the error rate on it
            raise ValueError(f"{max_pairs} measured pairs per candidate cannot decide at confidence {confidence}: "
                             f"the signed-rank bound needs at least {bounding_pairs(1 - confidence)} pairs at one "
                             f"look, more with several (raise calibration_max_pairs)")
        first = need


def look_alphas(points: list[int], confidence: float) -> list[float]:
    """Each look's share of the error rate ``1 - confidence``: in proportion to its pairs."""
    return [(1 - confidence) * n / sum(points) for n in points]
