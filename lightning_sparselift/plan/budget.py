"""The planning round's calibration budget (:class:`RoundBudget`): the rule's ``max_steps`` shared
between the design in progress and the designs still to come. The loop (:mod:`.loop`) asks it how
many measured blocks a design may use, when it starts and at a look that leaves a factor undecided;
the budget judges the queued candidates the step-time model puts out of reach at the clocks
measured so far, and reserves steps only for the others."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.cost.decision import KERNEL_REGIONS, bounding_pairs
from lightning_sparselift.cost.design import (
    ClockNoise, FactorialDesign, design_steps, fewest_steps, out_of_reach, resolvable_ms,
)
from lightning_sparselift.passes import Candidate, InfeasibleCandidate
from lightning_sparselift.plan.planner import Planner

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph


class RoundBudget:
    """The round's steps, judged on the queue (the feasible candidates not decided yet, in order)
    and the steps ``spent`` so far, both the loop's. Predictions are agreed across ``group``, so
    every rank reserves the same steps."""

    def __init__(self, planner: Planner, group: Any) -> None:
        self.planner = planner
        self.group = group
        self.clocks: dict[str, ClockNoise] = {}  # per region: its noise at the round's latest look
        self.beyond: set[str] = set()  # queued candidates no later design could resolve (judge_later)

    def own_blocks(self) -> int:
        """The measured blocks a design keeps however short the round's budget: those in which it
        can accept a candidate (and never fewer than a bound needs)."""
        rule = self.planner.rule
        return max(rule.accept_from_pairs, bounding_pairs(1 - rule.confidence))

    def own_steps(self, protocol: CalibrationProtocol) -> int:
        """The steps of :meth:`own_blocks` for a design of ``protocol``."""
        return design_steps(self.own_blocks(), protocol.warmup_pairs, protocol.settle_steps)

    def blocks_in(self, protocol: CalibrationProtocol, steps: int) -> int:
        """The measured blocks a design of ``protocol`` fits in ``steps`` (after its warmup; at most
        the rule's ``max_pairs``)."""
        return min(self.planner.rule.max_pairs, steps // (2 * (1 + protocol.settle_steps)) - protocol.warmup_pairs)

    def heads(self, queue: list[Candidate], members: list[Candidate], own: bool = False) -> dict[str, int]:
        """The queued candidates (but ``members``, and those :attr:`beyond` reach) that will start
        a design of their own, with that design's fewest steps
        (:func:`~lightning_sparselift.cost.design.fewest_steps`; with ``own``, a design on a
        kernel clock the steps of its :meth:`own_blocks`, which it keeps when its turn comes)."""
        heads: dict[str, int] = {}
        starters: list[Candidate] = []
        for c in queue:
            if c not in members and c.id not in self.beyond and not any(self.planner.joins(h, c) for h in starters):
                starters.append(c)
                protocol = self.planner.protocol(c)
                heads[c.id] = (self.own_steps(protocol) if own and protocol.region in KERNEL_REGIONS
                               else fewest_steps(self.planner.rule, protocol.warmup_pairs, protocol.settle_steps))
        return heads

    def blocks_left(self, queue: list[Candidate], members: list[Candidate], spent: int) -> int:
        """The measured blocks a design of ``members`` may use: the round's budget left after the
        fewest steps of the designs still to come (:meth:`heads`), at most the rule's
        ``max_pairs``. Where the budget cannot hold them all (a short run's), this design, the
        queue's most promising, keeps :meth:`own_blocks` and the later ones get what remains when
        their turn comes."""
        protocol = self.planner.protocol(members[0])
        left = self.planner.rule.max_steps - spent
        left -= min(sum(self.heads(queue, members).values()), max(left - self.own_steps(protocol), 0))
        return self.blocks_in(protocol, left)

    def room(self, queue: list[Candidate], members: list[Candidate], design: FactorialDesign, spent: int,
             incumbent: SparseGraph) -> int:
        """The measured blocks the design of ``members`` may use, at a look that left a factor
        undecided or futile: the round's budget less what the later designs keep, judged at the
        clocks this look measured. Those out of reach (:meth:`judge_later`) keep nothing; a kernel
        clock's design keeps :meth:`own_blocks` (kernel candidates are never judged out of reach,
        and on the held-out two-tower the output layouts, last in the queue, found too few steps
        once a design before them took its own); the others their fewest (reserving their own left
        dlrm's demo no room: next batch's alone is 52 of its 99 steps). The design is widened to
        them before its last planned look
        (:meth:`~lightning_sparselift.cost.design.FactorialDesign.widen`: the demo's first design,
        early start with the kernels, had 26 of 99 steps while 73 stayed reserved for next batch,
        merged input and two pipelined buckets, all then futile before measuring), and its
        futility is judged against them at every look."""
        self.judge_later(queue, members, spent + design.budget_steps - design.recorded, incumbent)
        left = self.planner.rule.max_steps - spent - sum(self.heads(queue, members, own=True).values())
        return self.blocks_in(self.planner.protocol(members[0]), left + design.recorded)

    def judge_later(self, queue: list[Candidate], members: list[Candidate], committed: int,
                    incumbent: SparseGraph) -> None:
        """Which queued candidates but ``members`` would be out of reach (:meth:`reach`) even with
        every step of the round's budget left after ``committed`` (the steps spent and those the
        design of ``members`` may still use), at the clocks measured so far: no steps are reserved
        for them (:attr:`beyond`). Each is still judged, and recorded, when its turn comes, on the
        incumbent of then."""
        left = self.planner.rule.max_steps - committed
        reaches: list[tuple[Candidate, float]] = []
        for c in queue:
            if c in members:
                continue
            reach = self.reach(c, self.blocks_in(self.planner.protocol(c), left))
            if reach is None:
                continue
            try:
                self.planner.predict(c, incumbent, self.planner.apply(incumbent, c))
            except InfeasibleCandidate:
                continue  # (recorded as such at its turn)
            reaches.append((c, reach))
        if reaches:
            self.planner.agree(self.group, [])  # (every rank judges rank 0's predictions)
        self.beyond = {c.id for c, reach in reaches if self.planner.predict_ms(c) is not None
                       and out_of_reach(self.planner.predict_ms(c), reach)}

    def reach(self, candidate: Candidate, blocks: int) -> Optional[float]:
        """The smallest effect ``blocks`` blocks resolve for ``candidate`` at its region's noise
        this round; None where the model's prediction cannot be judged against it: the region not
        measured yet, a kernel clock (:data:`~lightning_sparselift.cost.decision.KERNEL_REGIONS`:
        the model's kernel terms are 2-10x small there, and those quiet clocks decide at a first
        look), no model, or too few blocks for a bound."""
        protocol, rule = self.planner.protocol(candidate), self.planner.rule
        clock = self.clocks.get(protocol.region)
        if clock is None or not self.judged(candidate) or blocks < bounding_pairs(1 - rule.confidence):
            return None
        return resolvable_ms(rule, blocks, -rule.min_gain_for(protocol.region) * clock.step_ms, clock.spread_ms)

    def judged(self, candidate: Candidate) -> bool:
        """Whether the model's prediction of ``candidate`` is judged before measuring: a model, and
        a region whose terms hold within the slack (not a kernel clock, see :meth:`reach`)."""
        return self.planner.model is not None and self.planner.protocol(candidate).region not in KERNEL_REGIONS
