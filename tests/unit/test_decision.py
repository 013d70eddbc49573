"""The decision rule on injected timings (no processes): a planning loop calibrates one candidate
whose steps are made slower or faster by a known amount, under step-to-step noise like this
machine's (~10% of a 75 ms step, heavy-tailed) with occasional steps 20x off; each seeded trial
must reach the right verdict, and a candidate with no effect must not be accepted."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from lightning_sparselift.cost.decision import (
    DecisionRule, bounding_pairs, look_alphas, look_points, paired_estimate, signed_rank_bounds,
)
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import PlanFingerprint, Planner, PlanningLoop

from graph_fixtures import load

STEP_MS, NOISE_MS, OUTLIER_RATE = 75.0, 7.5, 0.03
# measured on dlrm (2 ranks, 150 pairs): per-step noise ~6 ms, a tenth of the steps ~3x that
SLOW_STEP_RATE, SLOW_STEP_NOISE_MS = 0.1, 18.0


def _decide(effect_ms: float, seed: int, rule: DecisionRule = DecisionRule(),
            noise_ms: float = NOISE_MS) -> tuple[bool, str, int]:
    """(accepted, reason, pairs measured, outliers included) for early start calibrated on steps
    that take ``effect_ms`` more when it is applied."""
    identity = load("table_and_column_wise_2ranks")
    optimizations = ["latency_hiding:early_start"]
    fingerprint = PlanFingerprint(identity.fingerprint(), "sharding", 2, "gloo", {}, optimizations)
    loop = PlanningLoop(Planner(select_passes(optimizations), None, True, rule), fingerprint, identity, None)
    loop.propose()
    rng = random.Random(seed)
    while not loop.done:
        candidate = loop.next_graph() is not loop.incumbent
        noise = SLOW_STEP_NOISE_MS if rng.random() < SLOW_STEP_RATE else noise_ms
        ms = rng.gauss(STEP_MS + (effect_ms if candidate else 0.0), noise)
        if rng.random() < OUTLIER_RATE:
            ms *= 20  # a step that waited for something else entirely
        loop.feedback(ms, ms)
    (decision,) = loop.plan.decisions
    return decision.accepted, decision.reason, decision.pairs + decision.outliers


@pytest.mark.parametrize("effect_ms, verdicts", [(-20.0, ("faster",)), (20.0, ("slower", "negligible"))])
def test_a_candidate_with_a_real_effect_is_decided_right_in_every_seeded_trial(effect_ms, verdicts):
    outcomes = [_decide(effect_ms, seed) for seed in range(20)]
    assert [accepted for accepted, _, _ in outcomes] == [effect_ms < 0] * 20
    assert all(reason.startswith(verdicts) for _, reason, _ in outcomes), [r for _, r, _ in outcomes]
    # decided at the first look (12 pairs, from which a candidate may be accepted) or the second
    assert {pairs for _, _, pairs in outcomes} == {12, 24}, outcomes


def test_an_effect_of_six_percent_of_the_step_is_accepted_in_every_seeded_trial():
    # early start on dlrm: -4.5 ms on a 75-80 ms step with ~6 ms step noise (200 seeds: 200 accepted)
    outcomes = [_decide(-4.5, seed, noise_ms=6.0) for seed in range(20)]
    assert all(accepted for accepted, _, _ in outcomes), [r for _, r, _ in outcomes]
    # within one planning round's budget: 240 steps, 119 measured pairs after the warmup pair
    assert max(pairs for _, _, pairs in outcomes) <= 119


def test_a_candidate_without_effect_is_rejected():
    outcomes = [_decide(0.0, seed) for seed in range(20)]  # (200 seeds: 3 accepted)
    assert sum(accepted for accepted, _, _ in outcomes) <= 1
    # most of them stopped as negligible before the budget, not after spending it
    negligible = [pairs for _, reason, pairs in outcomes if reason.startswith("negligible")]
    assert sum(pairs < 119 for pairs in negligible) >= 10, [r for _, r, _ in outcomes]


def test_outliers_are_not_evidence():
    # a 20x step in the candidate's arm would make a mean-based rule reject a real improvement
    t0 = [75.0, 76.0, 74.0, 75.5, 74.5, 75.2, 74.8]
    t1 = [60.0, 1500.0, 61.0, 59.5, 60.5, 60.2, 59.8]
    estimate = paired_estimate(t0, t1, 0.95, 1)
    assert estimate.outliers == 1 and estimate.pairs == 6 and estimate.verdict == "faster"
    assert estimate.increment_ms == pytest.approx(-15.0)


def test_the_smallest_gain_is_a_fraction_of_the_step_not_of_the_region():
    # a lookup region of ~3 ms that a candidate makes 0.3 ms faster, every pair alike, in an 80 ms step
    t0 = [3.0 + 0.01 * k for k in range(10)]
    t1 = [t - 0.3 for t in t0]
    steps = [80.0 + k for k in range(10)]
    assert paired_estimate(t0, t1, 0.95, 1, 0.005).verdict == "faster"  # 0.5% of the region: 0.015 ms
    small = paired_estimate(t0, t1, 0.95, 1, 0.005, steps)  # 0.5% of the step: 0.42 ms
    assert small.verdict == "undecided" and small.threshold_ms == pytest.approx(-0.005 * 84.5)
    assert paired_estimate(t0, [t - 0.6 for t in t0], 0.95, 1, 0.005, steps).verdict == "faster"


def test_the_smallest_gain_follows_what_the_region_resolves():
    rule = DecisionRule()
    assert rule.min_gain_for("step") == rule.min_gain_for("sparse") == 0.005
    assert rule.min_gain_for("lookup") == rule.min_gain_for("lookup_wall") == 0.001
    with pytest.raises(ValueError, match="min_lookup_gain"):
        DecisionRule(min_lookup_gain=1.5)
    with pytest.raises(ValueError, match="accept_from_pairs"):
        DecisionRule(accept_from_pairs=0)


def test_the_estimate_and_bounds_are_the_signed_rank_ones():
    from scipy.stats import wilcoxon

    rng = random.Random(3)
    diffs = [rng.gauss(-1.0, 3.0) for _ in range(40)]
    estimate, low, high = signed_rank_bounds(diffs, 0.05)
    walsh = sorted((a + b) / 2 for i, a in enumerate(diffs) for b in diffs[i:])
    assert estimate == pytest.approx(statistics.median(walsh))
    # each bound is where the one-sided signed-rank test of the shifted differences turns
    assert wilcoxon([d - low for d in diffs], alternative="greater").pvalue <= 0.05
    assert wilcoxon([d - high for d in diffs], alternative="less").pvalue <= 0.05
    assert wilcoxon([d - low - 0.05 for d in diffs], alternative="greater").pvalue > 0.05
    # too few pairs to bound at the level: 2^-4 > 0.05
    assert math.isinf(signed_rank_bounds([-1.0, -2.0, -1.5, -1.2], 0.05)[1])
    assert not math.isinf(signed_rank_bounds([-1.0, -2.0, -1.5, -1.2, -1.1], 0.05)[1])


def test_the_error_rate_is_split_over_the_looks():
    t0 = [10.0, 10.2, 9.9, 10.1, 10.3, 9.8, 10.0, 10.1, 9.9, 10.2, 10.0, 10.1]
    t1 = [9.5, 9.9, 9.4, 9.8, 9.6, 9.9, 9.3, 9.7, 9.8, 9.4, 9.6, 9.5]
    one, six = paired_estimate(t0, t1, 0.95, 1), paired_estimate(t0, t1, 0.95, 6)
    assert one.increment_ms == six.increment_ms
    assert six.interval_ms[0] < one.interval_ms[0] < one.interval_ms[1] < six.interval_ms[1]
    assert math.isinf(paired_estimate([10.0], [9.0], 0.95, 1).interval_ms[0])  # one pair bounds nothing


def test_look_points_and_rule_limits():
    # the first look is the fewest pairs whose bounds exist at its share of the error rate (in
    # proportion to its pairs: the last look keeps most of it)
    assert look_points(2, 192, 0.95) == [13, 26, 52, 104, 192]
    assert look_alphas([13, 26, 52, 104, 192], 0.95) == pytest.approx([0.05 * n / 387 for n in (13, 26, 52, 104, 192)])
    assert look_points(2, 24, 0.95) == [10, 20, 24] == look_points(10, 24, 0.95)
    assert look_points(2, 5, 0.95) == [5]  # one look: all the error rate on it
    assert bounding_pairs(0.05) == 5 and bounding_pairs(0.01) == 7
    for looks, confidence in ((look_points(2, 192, 0.95), 0.95), (look_points(2, 24, 0.99), 0.99)):
        assert 2 ** -looks[0] <= look_alphas(looks, confidence)[0]
    assert look_points(2, DecisionRule().max_pairs, DecisionRule().confidence) == [12, 24, 48, 96, 128]
    with pytest.raises(ValueError, match="needs at least 5 pairs"):
        DecisionRule(confidence=0.95, max_pairs=4)
    with pytest.raises(ValueError, match="needs at least 7 pairs"):
        DecisionRule(confidence=0.99, max_pairs=6)
    with pytest.raises(ValueError, match="calibration budget"):
        DecisionRule(max_steps=-1)
    with pytest.raises(ValueError, match="confidence"):
        DecisionRule(confidence=1.0)


def test_a_rounds_budget_is_at_most_a_third_of_the_training_steps_left_unless_the_user_set_one():
    from lightning_sparselift.options import SessionOptions

    rule = DecisionRule()
    assert rule.for_run(300).max_steps == 100 and rule.for_run(3000).max_steps == rule.max_steps == 240
    assert rule.for_run(math.inf) is rule and rule.for_run(-5).max_steps == 0  # (past the expected end)
    assert rule.for_run(300).confidence == rule.confidence and rule.for_run(300).max_pairs == rule.max_pairs
    assert DecisionRule(run_share=None).for_run(300).max_steps == 240
    with pytest.raises(ValueError, match="run_share"):
        DecisionRule(run_share=0.0)

    def options(max_steps: object) -> DecisionRule:
        return SessionOptions.from_arguments(None, 0.95, 128, max_steps, 0.005, 0.001, None, None).decision_rule

    assert options(None) == DecisionRule()  # the default: 240, and a third of what is left
    assert options(500).for_run(300).max_steps == 500  # a budget the user set holds
