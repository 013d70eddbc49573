"""The fold-over design that measures several candidates in the same steps (no processes): its
schedule (complementary runs, settle steps, looks), its estimates on injected timings (each
factor's effect recovered from every block, interactions kept out of them and estimated apart),
and planning rounds that use it (several candidates decided in the steps one needed before)."""

from __future__ import annotations

import random

import pytest

from lightning_sparselift.cost.decision import DecisionRule
from lightning_sparselift.cost.design import REGIONS, Factor, FactorialDesign, fewest_steps, out_of_reach, resolvable_ms

RULE = DecisionRule(confidence=0.95, max_pairs=24)


def _values(step: float, **regions: float) -> dict[str, float]:
    return {r: regions.get(r, step) for r in REGIONS} | {"step": step}


def test_each_block_runs_an_assignment_then_its_complement_and_settles_before_each_observed_step():
    design = FactorialDesign([Factor("step", 0.005), Factor("step", 0.005)], RULE, seed=1, settle_steps=1)
    assert design.looks == [10, 20, 24]
    ran = []
    while not design.done:
        ran.append(design.next_assignment())
        design.record(_values(10.0))
    assert len(ran) == design.planned == 2 * (1 + 10) * 2 and design.next_assignment() is None
    runs = [ran[i:i + 2] for i in range(0, len(ran), 2)]
    assert all(a == b for a, b in runs)  # a settle step on the plan its observed step runs
    for first, second in zip(runs[0::2], runs[1::2]):
        assert all(x != y for x, y in zip(first[0], second[0]))  # the complement
    assert design.can_extend
    design.extend()
    assert design.planned == 2 * (1 + 20) * 2 and design.budget_steps == 2 * (1 + 24) * 2


def test_the_same_seed_draws_the_same_design_on_every_rank():
    def schedule(seed: int) -> list:
        design = FactorialDesign([Factor("step", 0.005)] * 3, RULE, seed=seed)
        out = []
        while not design.done:
            out.append(design.next_assignment())
            design.record(_values(1.0))
        return out

    assert schedule(7) == schedule(7) != schedule(8)


def _run(design: FactorialDesign, step_ms, seed: int = 0) -> list:
    rng = random.Random(seed)
    while True:
        while not design.done:
            design.record(step_ms(design.next_assignment(), rng))
        out = design.look(None)
        for j, m in enumerate(out):
            if m is not None and m.estimate.verdict != "undecided":
                design.fix(j, m.estimate.verdict == "faster")
        if all(f.fixed is not None for f in design.factors) or not design.can_extend:
            return out
        design.extend()


def test_every_factor_is_estimated_from_every_block_on_its_own_region_and_interactions_apart():
    # three candidates: -4 ms of the step, -0.3 ms of the lookup region, +2 ms of the step; and the
    # first two together 3 ms slower than their sum (an interaction)
    factors = [Factor("step", 0.005), Factor("lookup", 0.001), Factor("step", 0.005)]
    design = FactorialDesign(factors, DecisionRule(confidence=0.95, max_pairs=24, accept_from_pairs=1), seed=3)

    def step_ms(on, rng):
        step = 80.0 - 4.0 * on[0] + 2.0 * on[2] + 3.0 * (on[0] and on[1]) + rng.gauss(0.0, 0.5)
        return _values(step, lookup=5.0 - 0.3 * on[1] + rng.gauss(0.0, 0.01))

    rng = random.Random(0)
    while not design.done:
        design.record(step_ms(design.next_assignment(), rng))
    seen = [m.estimate for m in design.look(None)]
    # the first factor's effect averaged over the second on (-1 ms) and off (-4 ms); the second's
    # region does not see the interaction
    assert seen[0].increment_ms == pytest.approx(-2.5, abs=0.5)
    assert seen[1].increment_ms == pytest.approx(-0.3, abs=0.02) and seen[1].verdict == "faster"
    assert seen[2].increment_ms == pytest.approx(2.0, abs=0.5) and seen[2].verdict == "slower"
    both = design.interaction(0, 1)
    assert both.ms == pytest.approx(3.0, abs=1.0) and both.interval_ms[0] > 0


def test_without_interactions_the_estimates_are_the_effects_and_fixed_factors_stay_fixed():
    factors = [Factor("step", 0.005), Factor("step", 0.005), Factor("sparse", 0.005)]
    design = FactorialDesign(factors, DecisionRule(confidence=0.95, max_pairs=48, accept_from_pairs=1), seed=5)

    def step_ms(on, rng):
        step = 80.0 - 6.0 * on[0] - 0.2 * on[1] + rng.gauss(0.0, 1.0)
        return _values(step, sparse=10.0 + 1.0 * on[2] + rng.gauss(0.0, 0.2))

    out = _run(design, step_ms)
    assert design.factors[0].fixed is True and design.factors[2].fixed is False
    # the factor left undecided ran on its own after the others were fixed
    assert out[0] is None and out[2] is None and out[1].estimate.pairs == 48
    assert out[1].estimate.increment_ms == pytest.approx(-0.2, abs=0.75)  # 3 standard errors (1 ms step noise)
    later = [design._schedule[i][0] for i in range(len(design._schedule) - 20, len(design._schedule))]
    assert all(a[0] is True and a[2] is False for a in later)


def test_a_step_that_did_not_report_a_factors_region_is_an_error():
    design = FactorialDesign([Factor("lookup", 0.001)], RULE, seed=0, warmup_blocks=0)
    with pytest.raises(ValueError, match=r"calibration on \['lookup'\] needs that region's time"):
        design.record({"step": 1.0, "sparse": 1.0})
    with pytest.raises(ValueError, match="unknown measured region"):
        FactorialDesign([Factor("gpu", 0.001)], RULE, seed=0)
    with pytest.raises(ValueError, match="1 to 6 factors"):
        FactorialDesign([Factor("step", 0.005)] * 7, RULE, seed=0)


def test_the_fewest_steps_of_a_design():
    assert fewest_steps(DecisionRule(), 1, 0) == 2 * (1 + 5) and fewest_steps(DecisionRule(), 1, 1) == 4 * (1 + 5)


def test_a_design_never_bounds_a_factor_from_fewer_blocks_than_the_others_fitted_effects_leave():
    from lightning_sparselift.cost.design import most_factors

    # 5 blocks and 6 factors: the least-squares fit explains every difference, a zero-width interval
    design = FactorialDesign([Factor("step", 0.005)] * 6, DecisionRule(confidence=0.95, max_pairs=5), seed=2)
    rng = random.Random(1)
    while not design.done:
        on = design.next_assignment()
        design.record(_values(80.0 - 4.0 * on[0] + rng.gauss(0.0, 1.0)))
    assert all(m.estimate.verdict == "undecided" and m.estimate.interval_ms == (float("-inf"), float("inf"))
               for m in design.look(None))
    # so a round puts one candidate in a design that small, and up to six in the default one
    assert most_factors(DecisionRule(confidence=0.95, max_pairs=5), 5) == 1
    assert most_factors(DecisionRule(), 119) == 6


def test_a_look_measures_every_reported_regions_noise_for_the_rounds_later_candidates():
    # one factor on the lookup region; the step reported beside it is noisy (sigma 2 ms per step),
    # the sparse region quiet: the look keeps each clock's step and paired spread (sqrt(2) sigma)
    design, rng = FactorialDesign([Factor("lookup", 0.001)], DecisionRule(confidence=0.95, max_pairs=64), seed=5), \
        random.Random(5)
    while design.can_extend:  # (no decision taken: the last look sees all 64 blocks)
        design.extend()
    while not design.done:
        on = design.next_assignment()
        design.record(_values(80.0 + rng.gauss(0.0, 2.0), lookup=5.0 - 0.3 * on[0], sparse=10.0))
    design.look(None)
    clocks = design.clocks
    assert set(clocks) == set(REGIONS)
    assert clocks["step"].step_ms == pytest.approx(80.0, abs=1.5)
    assert clocks["step"].spread_ms == pytest.approx(2.0 * 2 ** 0.5, rel=0.25) and clocks["sparse"].spread_ms == 0.0


def test_what_a_budget_resolves_shrinks_with_its_blocks_and_grows_with_the_noise():
    rule = DecisionRule(confidence=0.95, max_pairs=128)
    assert resolvable_ms(rule, 64, -0.4, 0.0) == -0.4  # noiseless: the smallest gain itself
    few, many, noisy = (resolvable_ms(rule, 16, -0.4, 6.0), resolvable_ms(rule, 64, -0.4, 6.0),
                        resolvable_ms(rule, 64, -0.4, 12.0))
    assert noisy < few < many < -0.4
    assert many == pytest.approx(-0.4 + (noisy + 0.4) / 2)  # linear in the spread
    # the model's prediction is given PREDICTION_SLACK (3x): -1 ms reaches -2.9 ms, -0.9 ms does not
    assert not out_of_reach(-1.0, -2.9) and out_of_reach(-0.9, -2.9) and out_of_reach(0.0, -0.4)


def test_a_widened_design_plans_its_later_looks_again_within_the_error_rate_left():
    rule = DecisionRule(confidence=0.95, max_pairs=128)
    design = FactorialDesign([Factor("step", 0.005)], rule, seed=3, max_blocks=12)
    assert design.looks == [9, 12]
    first = design.alphas[0]
    while not design.done:
        design.record(_values(80.0))
    design.look(None)
    assert not design.widen(12) and design.looks == [9, 12]  # (no more than planned: nothing changes)
    # from the next look planned, doubling, then the new budget; the first look's share kept, the
    # second's split over the three in proportion to their pairs
    assert design.widen(48) and design.looks == [9, 12, 24, 48] and design.budget_steps == 2 * (1 + 48)
    assert design.alphas[0] == first and sum(design.alphas) == pytest.approx(1 - rule.confidence)
    assert design.alphas[1:] == pytest.approx([(0.05 - first) * n / 84 for n in (12, 24, 48)])
    design.extend()
    while not design.done:
        design.record(_values(80.0))
    assert design.planned == 2 * (1 + 12)
    # only before the last look planned: the looks before it keep their shares; the last one's is split
    longer = FactorialDesign([Factor("step", 0.005)], rule, seed=3, max_blocks=48)
    assert longer.looks == [11, 22, 44, 48] and not longer.can_widen and not longer.widen(100)
    shares = list(longer.alphas)
    longer.extend()
    longer.extend()
    assert longer.can_widen and longer.widen(100) and longer.looks == [11, 22, 44, 48, 96, 100]
    assert longer.alphas[:3] == shares[:3] and longer.alphas[3:] == pytest.approx([shares[3] * n / 244
                                                                                   for n in (48, 96, 100)])
    # the last look planned spent the last of the error rate: no later look can have a share
    at_last = FactorialDesign([Factor("step", 0.005)], rule, seed=3, max_blocks=12)
    at_last.extend()
    assert not at_last.widen(40) and at_last.looks == [9, 12]
    # a share too small to bound its look's blocks: not widened
    tiny = FactorialDesign([Factor("step", 0.005)], rule, seed=3, max_blocks=12)
    assert not tiny.widen(100_000) and tiny.looks == [9, 12]
