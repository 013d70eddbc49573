"""The decision rule on injected timings (no processes): a planning loop calibrates one candidate
whose steps are made slower or faster by a known amount, under step-to-step noise like this
machine's (~10% of a 75 ms step) with occasional steps 20x off; each seeded trial must reach the
right verdict, and a candidate with no effect must not be accepted."""

from __future__ import annotations

import math
import random

import pytest

from lightning_sparselift.cost.decision import DecisionRule, look_points, paired_estimate
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import PlanFingerprint, Planner, PlanningLoop

from graph_fixtures import load

STEP_MS, NOISE_MS, OUTLIER_RATE = 75.0, 7.5, 0.03


def _decide(effect_ms: float, seed: int, rule: DecisionRule = DecisionRule()) -> tuple[bool, str, int]:
    """(accepted, reason, pairs) for early start calibrated on steps that take ``effect_ms`` more
    when it is applied."""
    identity = load("table_and_column_wise_2ranks")
    optimizations = ["latency_hiding:early_start"]
    fingerprint = PlanFingerprint(identity.fingerprint(), "sharding", 2, "gloo", {}, optimizations)
    loop = PlanningLoop(Planner(select_passes(optimizations), None, True, rule), fingerprint, identity, None)
    loop.propose()
    rng = random.Random(seed)
    while not loop.done:
        candidate = loop.next_graph() is loop.trial
        ms = rng.gauss(STEP_MS + (effect_ms if candidate else 0.0), NOISE_MS)
        if rng.random() < OUTLIER_RATE:
            ms *= 20  # a step that waited for something else entirely
        loop.feedback(ms, ms)
    (decision,) = loop.plan.decisions
    return decision.accepted, decision.reason, decision.pairs


@pytest.mark.parametrize("effect_ms, verdict", [(-20.0, "faster"), (20.0, "slower")])
def test_a_candidate_with_a_real_effect_is_decided_right_in_every_seeded_trial(effect_ms, verdict):
    outcomes = [_decide(effect_ms, seed) for seed in range(20)]
    assert [accepted for accepted, _, _ in outcomes] == [effect_ms < 0] * 20
    assert all(reason.startswith(verdict) for _, reason, _ in outcomes), [r for _, r, _ in outcomes]


def test_a_candidate_without_effect_is_rejected():
    outcomes = [_decide(0.0, seed) for seed in range(20)]
    assert sum(accepted for accepted, _, _ in outcomes) <= 1
    # most of them used the whole budget and were rejected as undecided ("do no harm")
    assert sum(reason.startswith("undecided") and pairs >= 11 for _, reason, pairs in outcomes) >= 15


def test_outliers_are_not_evidence():
    # a 20x step in the candidate's arm would make a mean-based rule reject a real improvement
    t0 = [75.0, 76.0, 74.0, 75.5, 74.5]
    t1 = [60.0, 1500.0, 61.0, 59.5, 60.5]
    estimate = paired_estimate(t0, t1, 0.95, 1)
    assert estimate.outliers == 1 and estimate.pairs == 4 and estimate.verdict == "faster"
    assert estimate.increment_ms == pytest.approx(-14.5)


def test_the_error_rate_is_split_over_the_looks():
    t0, t1 = [10.0, 10.2, 9.9, 10.1], [9.5, 9.9, 9.4, 9.8]
    one, six = paired_estimate(t0, t1, 0.95, 1), paired_estimate(t0, t1, 0.95, 6)
    assert one.increment_ms == six.increment_ms
    assert six.interval_ms[0] < one.interval_ms[0] < one.interval_ms[1] < six.interval_ms[1]
    assert math.isinf(paired_estimate([10.0], [9.0], 0.95, 1).interval_ms[0])  # one pair bounds nothing


def test_look_points_and_rule_limits():
    assert look_points(2, 24) == [3, 6, 12, 24]
    assert look_points(2, 12) == [3, 6, 12]
    assert look_points(4, 9) == [4, 8, 9]
    assert look_points(2, 3) == [3]
    with pytest.raises(ValueError, match="at least 3 measured pairs"):
        DecisionRule(max_pairs=2)
    with pytest.raises(ValueError, match="confidence"):
        DecisionRule(confidence=1.0)
