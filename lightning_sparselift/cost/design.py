"""Several candidates measured in the same training steps: a randomized two-level fold-over design.

A block is two runs of ``1 + settle_steps`` steps each, the last step of each run observed. The
first run applies a half of the design's factors (candidates, each on or off; drawn from a
balanced orthogonal array in a seeded random order, the same on every rank), the second run the
complement. For each
measured region (a factor's protocol's ``region``), the difference of the block's two observed
steps is the sum of the factors' effects, each signed by its assignment (+1: on in the second run,
-1: on in the first), plus noise; drift slower than a block cancels in it. A factor's effect is
its change averaged over the other factors being on and off: what two factors do together beyond
their own effects (their interaction) enters the difference only through those averages (the
fold-over property), and is estimated apart, from the block sums.

Each factor's increment is estimated from every block: the other factors' least-squares effects
are taken out of the block's difference, and what remains, signed, is this factor's paired
increment, judged as one candidate's pairs are (its signed-rank interval at the design's looks,
:func:`~lightning_sparselift.cost.decision.judged`). A decided factor is fixed for the blocks that
follow (on when accepted); its estimate still corrects the others'. So a design decides k
candidates in the steps its hardest one needs, not in k times that. The block sums (the two steps
added) carry the interactions: :meth:`FactorialDesign.interaction` estimates one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from statistics import NormalDist, median
from typing import Any, Optional

import numpy as np
import torch

from lightning_sparselift.cost.calibration import Measurement, PairedRuns, gather_ranks
from lightning_sparselift.cost.decision import (
    MIN_RELATIVE_SPREAD, OUTLIER_SIGMAS, DecisionRule, PairedEstimate, bounding_pairs, increment_estimate, judged, look_alphas, look_points, robust_sigma,
)

# what a step reports (RegionClock.end_step's names, without "_ms"); a factor's region is one of them
REGIONS = ("step", "sparse", "lookup", "lookup_wall", "step_cpu", "input", "exchange_cpu", "layout_cpu")
# the most factors one design varies: every subset of them is a graph the runtime may install
MAX_FACTORS = 6
# Sylvester's Hadamard matrix of order 8: its columns 1-7 are balanced and pairwise orthogonal
_HADAMARD_8 = np.kron(np.kron([[1, 1], [1, -1]], [[1, 1], [1, -1]]), [[1, 1], [1, -1]]).tolist()
# the power the futility rule asks of the whole budget (nine times in ten: z of 0.9)
_POWER_Z = 1.2816
# how far the futility rule lets the model's prediction be off: the step-time model's kernel terms
# are bytes over bandwidth, 2-10x small for the input kernel and the lookups of an EmbeddingCollection
# (the earlier priors' output layout, 2-3x small on dlrm, was stopped at 1x: -1.32 ms predicted,
# -1.9 ms measured, the budget resolving -1.57 ms)
PREDICTION_SLACK = 3.0


@dataclass
class Factor:
    """One candidate in a design: the region it is measured on, the smallest gain accepted (a
    fraction of the step) and, once decided, whether it stays on."""

    region: str
    min_gain: float
    predicted_ms: Optional[float] = None  # the model's increment, if it has one
    fixed: Optional[bool] = None  # None while varied


@dataclass(frozen=True)
class ClockNoise:
    """What a design's last look measured of one region's clock: the step (the scale of the
    smallest gain) and the spread of a block's paired difference once the factors' effects are out."""

    step_ms: float
    spread_ms: float


@dataclass(frozen=True)
class Interaction:
    """The step-time change of two factors together beyond the sum of their own effects."""

    ms: float
    interval_ms: tuple[float, float]
    blocks: int


class FactorialDesign(PairedRuns):
    """The blocks of one design, step by step: :meth:`next_assignment` says which factors the next
    step applies, :meth:`record` takes its measurement; once :attr:`done`, the caller takes a
    :meth:`look`, :meth:`fix` es the factors it decided and, while some are undecided and the
    budget allows, :meth:`extend` s the design to its next look."""

    def __init__(self, factors: list[Factor], rule: DecisionRule, seed: int, warmup_blocks: int = 1,
                 settle_steps: int = 0, max_blocks: Optional[int] = None) -> None:
        """``max_blocks``: the measured blocks it may use (default: the rule's ``max_pairs``)."""
        if not 1 <= len(factors) <= MAX_FACTORS:
            raise ValueError(f"a design varies 1 to {MAX_FACTORS} factors, got {len(factors)}")
        unknown = sorted({f.region for f in factors} - set(REGIONS))
        if unknown:
            raise ValueError(f"unknown measured region(s) {unknown}; known: {list(REGIONS)}")
        super().__init__(settle_steps)
        self.factors, self.rule = factors, rule
        self.warmup_blocks = warmup_blocks
        self.looks = look_points(2, rule.max_pairs if max_blocks is None else max_blocks, rule.confidence)
        self.alphas = look_alphas(self.looks, rule.confidence)
        self._look = 0
        self._rng = random.Random(seed)
        self._observed: list[list[float]] = []  # per observed step: REGIONS' values (nan: not reported)
        self._blocks = 0
        self._ranks: Optional[list[np.ndarray]] = None  # the last look's observations, per rank
        self.clocks: dict[str, ClockNoise] = {}  # per region every step reported: its noise at the last look
        self._cycle: list[tuple[bool, ...]] = []  # the first runs' assignments still to draw
        self._add_blocks(warmup_blocks + self.looks[0])

    # ------------------------------------------------------------------ steps
    def _add_blocks(self, blocks: int) -> None:
        for _ in range(blocks):
            if not self._cycle:
                self._cycle = self._orthogonal_cycle()
            drawn = self._cycle.pop()
            first = tuple(f.fixed if f.fixed is not None else on for f, on in zip(self.factors, drawn))
            self._add_pair(first, tuple(f.fixed if f.fixed is not None else not on
                                        for f, on in zip(self.factors, first)))
        self._blocks += blocks

    def _orthogonal_cycle(self) -> list[tuple[bool, ...]]:
        """Eight blocks' first-run assignments in which every two factors are balanced against
        each other (columns of an order-8 Hadamard matrix: their signs are orthogonal, so the
        least-squares effects are as well separated as they can be), in a random order and with a
        random sign per factor (independent draws came out nearly collinear in short designs)."""
        rows = list(range(8))
        self._rng.shuffle(rows)
        flips = [self._rng.random() < 0.5 for _ in self.factors]
        return [tuple((_HADAMARD_8[r][j + 1] > 0) != flip for j, flip in enumerate(flips)) for r in rows]

    def next_assignment(self) -> Optional[tuple[bool, ...]]:
        """Per factor, whether the next step applies it; None once the scheduled steps ran."""
        upcoming = self._upcoming()
        return None if upcoming is None else upcoming[0]

    def record(self, values: dict[str, Optional[float]]) -> None:
        """The step just run: every region it reports (see :data:`REGIONS`)."""
        if self._schedule[self._steps][1]:
            missing = sorted({f.region for f in self.factors if values.get(f.region) is None})
            if missing:
                raise ValueError(f"calibration on {missing} needs that region's time, which this step did not report")
            self._observed.append([math.nan if values.get(r) is None else float(values[r]) for r in REGIONS])
        self._steps += 1

    @property
    def budget_steps(self) -> int:
        """Steps the design takes at most."""
        return design_steps(self.looks[-1], self.warmup_blocks, self.settle_steps)

    @property
    def can_extend(self) -> bool:
        return self._look + 1 < len(self.looks)

    def extend(self) -> None:
        """Schedule the blocks up to the next look."""
        self._look += 1
        self._add_blocks(self.looks[self._look] - self.looks[self._look - 1])

    @property
    def can_widen(self) -> bool:
        """Whether :meth:`widen` may change the looks: the next look is the last planned."""
        return self._look + 2 == len(self.looks)

    def widen(self, max_blocks: int) -> bool:
        """Let the design go on to ``max_blocks`` measured blocks (at a look after which only the
        last planned one is left, :attr:`can_widen`; False, with nothing changed, elsewhere, when
        that is no more than planned, or when a later look could not be bounded): the last look is
        planned again as looks from its blocks doubling to the new budget, which share its error
        rate in proportion to their pairs. The looks before keep their shares, so a design that
        decides before its last planned look decides as it would have; the shares still sum to the
        rule's, so the error rate over the whole calibration stays within it. (Widened at its first
        look, a design's later looks split ~0.045 of 0.05 over twice as many pairs: on dlrm early
        start then waited for 48 pairs where 12-24 had decided it.)"""
        if max_blocks <= self.looks[-1] or not self.can_widen:
            return False
        taken = self.looks[:-1]
        later, point = [], self.looks[-1]
        while point < max_blocks:
            later.append(point)
            point *= 2
        later.append(max_blocks)
        left = (1 - self.rule.confidence) - sum(self.alphas[:len(taken)])
        alphas = [left * n / sum(later) for n in later]
        if any(bounding_pairs(a) > n for a, n in zip(alphas, later)):
            return False
        self.looks, self.alphas = taken + later, self.alphas[:len(taken)] + alphas
        return True

    def fix(self, index: int, on: bool) -> None:
        """Factor ``index`` is decided: every block scheduled from now on applies it (``on``) or not."""
        self.factors[index].fixed = on

    # ------------------------------------------------------------------ estimates
    def _signs(self) -> np.ndarray:
        """Per measured block and factor: +1 applied in the second run only, -1 in the first only, 0 both alike."""
        observed = [a for a, seen in self._schedule[:self._steps] if seen]
        pairs = [(observed[2 * b], observed[2 * b + 1]) for b in range(self.warmup_blocks, len(observed) // 2)]
        return np.array([[int(s) - int(f) for f, s in zip(first, second)] for first, second in pairs],
                        dtype=np.float64).reshape(len(pairs), len(self.factors))

    def _runs(self, observed: np.ndarray, blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """``observed`` (per observed step) in the measured blocks' first runs, and in their second."""
        start, end = 2 * self.warmup_blocks, 2 * (self.warmup_blocks + blocks)
        return observed[start:end:2], observed[start + 1:end:2]

    def look(self, group: Any, room: Optional[int] = None) -> list[Optional[Measurement]]:
        """Every rank's observations (a collective over ``group``; each step's slowest rank per
        region), then per factor still varied its measurement at this look (None for the fixed
        ones): the other factors' effects taken out of each block's difference, the remainder
        judged as paired increments. ``room``: the measured blocks the design may still be
        widened to (:meth:`widen`), if more than planned: futility is judged against them."""
        if self._ranks is None or len(self._ranks[0]) != len(self._observed):  # (a look again: gathered already)
            local = torch.tensor(self._observed, dtype=torch.float64).reshape(-1, len(REGIONS))
            self._ranks = [g.numpy() for g in gather_ranks(local, group)]
        ranks = self._ranks
        slowest = np.stack(ranks).max(axis=0)
        signs = self._signs()
        first, second = self._runs(slowest, len(signs))
        blocks = len(signs)
        step = median(np.concatenate([first[:, 0], second[:, 0]]).tolist()) if blocks else 0.0
        # the varied factors' regions, and every other region each step reported (its noise, for the loop)
        varied_regions = {f.region for f in self.factors if f.fixed is None}
        fits = {r: _fit(second[:, i] - first[:, i], signs, float(np.median(np.abs(slowest[:, i]))))
                for i, r in enumerate(REGIONS) if r in varied_regions or np.isfinite(slowest[:, i]).all()}
        self.clocks = {r: ClockNoise(step, math.sqrt(2) * noise) for r, (_, _, noise) in fits.items()}
        out: list[Optional[Measurement]] = []
        for j, factor in enumerate(self.factors):
            if factor.fixed is not None:
                out.append(None)
                continue
            r = REGIONS.index(factor.region)
            effects, kept, noise = fits[factor.region]
            varied = signs[:, j] != 0
            others = np.delete(np.arange(len(self.factors)), j)
            diffs = second[:, r] - first[:, r] - signs[:, others] @ effects[others]
            partial = (signs[:, j] * diffs)[varied & kept]
            # (the others' effects were fitted on these blocks: their residuals are that much smaller)
            free = len(partial) - int(np.any(signs[:, others] != 0, axis=0).sum())
            if free > 1:
                center = float(np.median(partial))
                partial = center + (partial - center) * math.sqrt(len(partial) / free)
            estimate = increment_estimate(partial.tolist(), self.alphas[self._look], -factor.min_gain * step, noise,
                                          int((varied & ~kept).sum()))
            if free < bounding_pairs(self.alphas[self._look]):  # (too few blocks beyond the effects fitted)
                estimate = replace(estimate, interval_ms=(-math.inf, math.inf), verdict="undecided")
            estimate = judged(estimate, self.looks[self._look], self.rule)
            if estimate.verdict == "undecided" and self.can_extend:
                estimate = self._futile(estimate, factor.predicted_ms, robust_sigma(partial.tolist()),
                                        max(self.looks[-1], room or 0))
            off_on = [[[float(arm[b, r]) for arm in ((ran_first, ran_second) if signs[b, j] > 0 else
                                                     (ran_second, ran_first))] for b in np.flatnonzero(varied)]
                      for ran_first, ran_second in (self._runs(obs, blocks) for obs in ranks)]
            out.append(Measurement(off_on, estimate))
        return out

    def _futile(self, e: PairedEstimate, predicted_ms: Optional[float], spread_ms: float,
                budget_blocks: int) -> PairedEstimate:
        """``futile`` when neither the estimate nor the model's prediction (even
        :data:`PREDICTION_SLACK` times larger) reaches the smallest effect a budget of
        ``budget_blocks`` would accept nine times in ten (the standard error at the budget from the spread of this
        factor's paired increments, ``spread_ms``): a candidate the model expects little of,
        measured as little, gets no more steps. Without a prediction the
        measurement alone never stops a candidate here (an early estimate of a real effect is
        often small)."""
        if predicted_ms is None or not e.pairs:
            return e
        resolvable = resolvable_ms(self.rule, budget_blocks, e.threshold_ms, spread_ms)
        if out_of_reach(predicted_ms, resolvable) and e.increment_ms > resolvable:
            return replace(e, verdict="futile", resolvable_ms=resolvable)
        return e

    def interaction(self, j: int, k: int) -> Optional[Interaction]:
        """Factors ``j`` and ``k`` together on the step clock, from the last look's blocks in
        which both were varied (None with fewer than 8): the block sums where they ran together
        or both not, against those where one ran without the other; the interval at the rule's
        confidence (one-sided each, normal)."""
        if self._ranks is None:
            return None
        signs = self._signs()
        first, second = self._runs(np.stack(self._ranks).max(axis=0), len(signs))
        sums = first[:, 0] + second[:, 0]
        both = (signs[:, j] != 0) & (signs[:, k] != 0)
        together = (signs[:, j] * signs[:, k])[both]
        sums = sums[both]
        same, apart = sums[together > 0], sums[together < 0]
        if len(same) < 4 or len(apart) < 4:
            return None
        # a block's sum holds every interaction i once per run (x_j x_k + (1 - x_j)(1 - x_k)): where
        # the two ran together it is i more than where they ran apart
        ms = float(np.median(same) - np.median(apart))
        spread = math.sqrt(robust_sigma(same.tolist()) ** 2 / len(same) + robust_sigma(apart.tolist()) ** 2 / len(apart))
        z = NormalDist().inv_cdf(self.rule.confidence)
        return Interaction(ms, (ms - z * spread, ms + z * spread), int(both.sum()))


def _fit(diffs: np.ndarray, signs: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray, float]:
    """(every factor's least-squares effect on these block differences, the blocks kept, the
    per-step noise): blocks whose residual lies beyond :data:`OUTLIER_SIGMAS` robust standard
    deviations (at least :data:`MIN_RELATIVE_SPREAD` of the region's ``scale``) are left out and
    the fit repeated."""
    kept = np.ones(len(diffs), dtype=bool)
    effects = np.zeros(signs.shape[1])
    for _ in range(2):
        varied = np.any(signs[kept] != 0, axis=0)
        effects = np.zeros(signs.shape[1])
        if kept.any() and varied.any():
            effects[varied] = np.linalg.lstsq(signs[kept][:, varied], diffs[kept], rcond=None)[0]
        residuals = diffs - signs @ effects
        spread = max(robust_sigma(residuals[kept].tolist()), MIN_RELATIVE_SPREAD * scale, 1e-9)
        kept = np.abs(residuals) <= OUTLIER_SIGMAS * spread
    return effects, kept, robust_sigma((diffs - signs @ effects)[kept].tolist()) / math.sqrt(2)


def resolvable_ms(rule: DecisionRule, max_blocks: int, threshold_ms: float, spread_ms: float) -> float:
    """The smallest effect a design of ``max_blocks`` blocks accepts nine times in ten (the
    standard error at its last look from ``spread_ms``, a block's paired spread; beyond
    ``threshold_ms``, minus the smallest gain accepted)."""
    looks = look_points(2, max_blocks, rule.confidence)
    z_end = NormalDist().inv_cdf(1 - look_alphas(looks, rule.confidence)[-1])
    return threshold_ms - (z_end + _POWER_Z) * spread_ms / math.sqrt(looks[-1])


def out_of_reach(predicted_ms: float, resolvable: float) -> bool:
    """Whether the model's prediction, even :data:`PREDICTION_SLACK` times larger, stays short of
    ``resolvable`` (:func:`resolvable_ms`)."""
    return PREDICTION_SLACK * predicted_ms > resolvable


def design_steps(blocks: int, warmup_blocks: int, settle_steps: int) -> int:
    """The steps of a design that measures ``blocks`` blocks after its warmup (two arms a block,
    each after its settle steps)."""
    return 2 * (warmup_blocks + blocks) * (1 + settle_steps)


def fewest_steps(rule: DecisionRule, warmup_blocks: int, settle_steps: int) -> int:
    """The steps of the smallest design that can decide anything: its warmup and one look at the
    fewest blocks whose bounds exist at the rule's confidence."""
    return design_steps(bounding_pairs(1 - rule.confidence), warmup_blocks, settle_steps)


def most_factors(rule: DecisionRule, max_blocks: int) -> int:
    """The most factors a design of ``max_blocks`` can decide: its last look must leave, beyond the
    other factors' fitted effects, as many blocks as the signed-rank bounds need at its share of
    the error rate (at most :data:`MAX_FACTORS`)."""
    looks = look_points(2, max_blocks, rule.confidence)
    return max(1, min(MAX_FACTORS, looks[-1] - bounding_pairs(look_alphas(looks, rule.confidence)[-1]) + 1))
