"""The planning round's budget (:class:`RoundBudget`) on a JSON graph fixture, in one process: the
steps the designs still to come keep, the blocks a design may use, and which queued candidates the
model puts out of reach at the clocks measured (the loop that asks it: test_planner)."""

from __future__ import annotations

from dataclasses import replace

from lightning_sparselift.cost.decision import DecisionRule
from lightning_sparselift.cost.design import ClockNoise
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import Planner
from lightning_sparselift.plan.budget import RoundBudget

from graph_fixtures import load, step_model

RULE = DecisionRule(confidence=0.95, max_pairs=192)


def _budget(max_steps: int = 240, model: bool = False):
    identity = load("table_and_column_wise_2ranks")
    planner = Planner(select_passes(["aggregation", "latency_hiding"]), step_model(identity) if model else None,
                      True, replace(RULE, max_steps=max_steps))
    queue, _ = planner.propose(identity)
    return RoundBudget(planner, None), queue, identity


def test_the_designs_still_to_come_keep_their_fewest_steps_unless_out_of_reach():
    budget, queue, _ = _budget()
    # each of the other three starts a design of its own (aggregation's measure the sparse regions
    # alone): 1 warmup and 5 measured blocks of 2 steps, next batch's of 4 (settled)
    assert [c.role for c in queue] == ["input", "output", "early_start", "next_batch"]
    assert budget.heads(queue, [queue[0]]) == {queue[1].id: 12, queue[2].id: 12, queue[3].id: 24}
    budget.beyond = {queue[3].id}
    assert budget.heads(queue, [queue[0]]) == {queue[1].id: 12, queue[2].id: 12}


def test_a_design_takes_what_the_later_ones_leave_and_its_own_blocks_when_the_round_is_short():
    budget, queue, _ = _budget()
    # 240 steps less the 48 the later designs keep: 192 steps, 1 warmup block and 95 measured
    assert budget.blocks_left(queue, [queue[0]], spent=0) == 95
    assert budget.blocks_left(queue, [queue[0]], spent=100) == 45
    short, queue, _ = _budget(max_steps=40)
    # 40 steps cannot hold this design's 26 and the later ones' 48: it keeps its own 12 blocks
    assert short.blocks_left(queue, [queue[0]], spent=0) == short.own_blocks() == 12


def test_a_later_candidate_is_out_of_reach_only_at_a_clock_measured_too_noisy_for_its_prediction():
    budget, queue, identity = _budget(model=True)
    head, later = queue[0], queue[1:]  # (ordered by the model's predictions, -0.07 to -0.21 ms)
    regions = {budget.planner.protocol(c).region for c in later}
    # no clock measured yet: nothing to judge a prediction against, every later design keeps its steps
    assert budget.reach(later[0], 24) is None
    budget.judge_later(queue, [head], committed=26, incumbent=identity)
    assert budget.beyond == set()
    for region in regions:  # a quiet clock of a 10 ms step: every prediction is within reach
        budget.clocks[region] = ClockNoise(step_ms=10.0, spread_ms=0.001)
    budget.judge_later(queue, [head], committed=26, incumbent=identity)
    assert budget.beyond == set()
    for region in regions:  # a clock far noisier than any prediction: none is
        budget.clocks[region] = ClockNoise(step_ms=10.0, spread_ms=1000.0)
    budget.judge_later(queue, [head], committed=26, incumbent=identity)
    assert budget.beyond == {c.id for c in later}
    assert budget.reach(later[0], 24) < -100.0  # (what 24 blocks resolve at that noise)
    # too few blocks left for a bound: no judgement at all
    assert budget.reach(later[0], 1) is None
