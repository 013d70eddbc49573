"""One planning round on real training steps (:class:`PlanningLoop`): it owns the
:class:`~lightning_sparselift.plan.types.ExecutionPlan` being built, says which graph the next
training step runs (the incumbent with the factors the design in progress applies), takes each
step's measurement, and decides candidates at the design's looks. Whoever runs the steps (the
session) installs the graphs; the loop never touches the runtime::

    loop = PlanningLoop(planner, fingerprint, identity, group)
    loop.propose()
    while not loop.done:
        executor.use(loop.next_graph())
        step_ms, sparse_ms = run_one_training_step()
        loop.feedback(step_ms, sparse_ms)
    executor.use(loop.plan.graph)
"""

from __future__ import annotations

import time
import zlib
from statistics import median
from typing import TYPE_CHECKING, Any, Optional

from lightning_sparselift.cost.calibration import Measurement
from lightning_sparselift.cost.decision import bounding_pairs
from lightning_sparselift.cost.design import PREDICTION_SLACK, Factor, FactorialDesign, most_factors, out_of_reach
from lightning_sparselift.passes import Candidate, InfeasibleCandidate
from lightning_sparselift.plan.budget import RoundBudget
from lightning_sparselift.plan.planner import Planner
from lightning_sparselift.plan.types import FUTILE_BEFORE_MEASURING, Decision, ExecutionPlan, PlanFingerprint

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph


class PlanningLoop:
    """One planning round from ``identity`` (the lifted graph before any pass): propose, then
    calibrate the feasible candidates on real training steps, several at once: the candidates at
    the head of the queue that can be measured together (the same stage and settle steps, not a
    sweep's later rung, every combination of them feasible; at most
    :data:`~lightning_sparselift.cost.design.MAX_FACTORS`) are the factors of one
    :class:`~lightning_sparselift.cost.design.FactorialDesign` on top of the incumbent (the
    identity graph with the candidates accepted so far). Every rank runs the same loop on the same
    steps with the same seeded design; the measurements are reduced across ``group``, so every
    decision is the same everywhere."""

    def __init__(self, planner: Planner, fingerprint: PlanFingerprint, identity: SparseGraph, group: Any,
                 events: Optional[list[str]] = None) -> None:
        self.planner = planner
        self.group = group
        self.plan = ExecutionPlan(fingerprint, identity)  # its graph is the incumbent once done
        self.incumbent = identity
        self.events = events if events is not None else []  # what happened, for the caller to report
        self.done = False
        # candidates may still come (:meth:`admit`): until they do, the loop waits on the incumbent
        # (no design starts: one would spend the round's budget without them)
        self.expecting = False
        self._queue: list[Candidate] = []  # feasible candidates not decided yet, the design's among them
        self._round: list[Candidate] = []  # the factors of the design in progress
        self._design: Optional[FactorialDesign] = None
        self._graphs: dict[tuple[bool, ...], SparseGraph] = {}  # per assignment of the design's factors
        self._measured: dict[str, Measurement] = {}  # per factor of the design: its last look's measurement
        self._calibration_start = 0.0
        self._ran: list[tuple[SparseGraph, float]] = []  # per calibration step: the graph it ran, its wall ms
        self._accepted: dict[str, bool] = {}  # per candidate decided or passed over: whether it was accepted
        self.budget = RoundBudget(planner, group)

    def propose(self, since: Optional[float] = None) -> None:
        """Propose the candidates (without calibration: apply every feasible one but a sweep's turn,
        which only a measurement makes, and the loop is done). ``since``: when planning this round
        began (``time.perf_counter()``), if before the call (the plan's ``planning_s`` counts from it)."""
        start = time.perf_counter() if since is None else since
        feasible, rejected = self.planner.propose(self.incumbent)
        feasible = self.planner.agree(self.group, feasible)
        self.plan.decisions.extend(rejected)
        if not self.planner.calibrate:
            for candidate in feasible:
                if candidate.when != "accepted":
                    self.plan.decisions.append(self.planner.undecided(candidate, "a sweep turns on measurements only "
                                                                                 "(calibrate=False)"))
                    continue
                applied = None if self._passed_over(candidate) else self._apply(candidate)
                if applied is not None:
                    self._accepted[candidate.id] = True
                    self.incumbent = applied
                    self.plan.decisions.append(self.planner.decide(candidate, None))
            feasible = []
        self._queue = feasible
        self.plan.planning_s += time.perf_counter() - start
        self._calibration_start = time.perf_counter()
        self._next_round()

    @property
    def waiting(self) -> bool:
        """Whether the loop waits for candidates (:attr:`expecting`) on the incumbent, no design running."""
        return self._design is None and not self.done

    @property
    def graphs(self) -> list[SparseGraph]:
        """The incumbent and the graphs of the design in progress (one of which becomes the
        incumbent): what records a fact of the machine in the graph (e.g. kernels built) marks."""
        return [self.incumbent, *self._graphs.values()]

    @property
    def trials(self) -> list[Candidate]:
        """The candidates the design in progress varies."""
        return list(self._round)

    def measures(self, region: str) -> bool:
        """Whether the design in progress still varies a factor measured on ``region``."""
        return self._design is not None and any(f.region == region and f.fixed is None for f in self._design.factors)

    def next_graph(self) -> SparseGraph:
        """The graph the next training step runs: the incumbent with the factors the design applies
        in that step (the incumbent while the loop waits for candidates)."""
        return self.incumbent if self._design is None else self._graphs[self._design.next_assignment()]

    def admit(self, more: bool = False) -> None:
        """Propose again on the incumbent (the graph now holds what new candidates need, e.g. built
        kernels): feasible candidates not proposed feasible before join the queue (their earlier
        infeasible decisions dropped), those still infeasible keep the new proposal's reasons; the
        loop waits for more (:attr:`expecting`) when ``more`` says they are coming."""
        known = {c.id for c in self._queue} | set(self._accepted)
        feasible, rejected = self.planner.propose(self.incumbent)
        feasible = self.planner.agree(self.group, feasible)
        new = [c for c in feasible if c.id not in known]
        admitted = {c.id for c in new}
        # (the candidates still infeasible get this proposal's reasons: e.g. no longer "none was built")
        again = {d.candidate: d for d in rejected}
        self.plan.decisions = [again.get(d.candidate, d) if not d.feasible else d for d in self.plan.decisions
                               if d.candidate not in admitted]
        self._queue += new
        if new:
            self.events.append(f"admitted {len(new)} candidate(s) now feasible: {', '.join(sorted(admitted))}")
        self.expecting = more
        if self._design is None and not self.done:
            self._next_round()

    def proceed(self, why: str) -> None:
        """Stop waiting for the candidates :attr:`expecting` announced (``why``, for the events):
        the queued ones are calibrated; :meth:`admit` still adds the others while the round lasts."""
        if not self.expecting:
            return
        self.expecting = False
        self.events.append(why)
        if self._design is None and not self.done:
            self._next_round()

    def feedback(self, step_ms: float, sparse_ms: float, lookup_ms: Optional[float] = None,
                 lookup_wall_ms: Optional[float] = None, step_cpu_ms: Optional[float] = None,
                 input_ms: Optional[float] = None, exchange_cpu_ms: Optional[float] = None,
                 layout_cpu_ms: Optional[float] = None) -> None:
        """The measurement of the step that ran :meth:`next_graph`: its whole wall time, the
        executor's measured regions, its lookup regions (on the lookup clock, and in wall time),
        the whole step on the training thread's clock, the input side on the lookup clock, the
        exchanges' CPU time and the output layouts' (each factor's protocol says which one
        counts). At each of the design's looks (a collective over ``group``) decides the factors
        whose verdict is in."""
        design = self._design
        if design is None:
            return  # (waiting for candidates on the incumbent: not a calibration step)
        self._ran.append((self.next_graph(), step_ms))
        design.record({"step": step_ms, "sparse": sparse_ms, "lookup": lookup_ms, "lookup_wall": lookup_wall_ms,
                       "step_cpu": step_cpu_ms, "input": input_ms, "exchange_cpu": exchange_cpu_ms,
                       "layout_cpu": layout_cpu_ms})
        self.plan.calibration_steps += 1
        if not design.done:
            return
        measurements = design.look(self.group)
        self.budget.clocks.update(design.clocks)
        if not self.expecting and any(m is not None and m.estimate.verdict in ("undecided", "futile")
                                      for m in measurements):
            room = self.budget.room(self._queue, self._round, design, self.plan.calibration_steps,
                                    self.incumbent)
            if room > design.looks[-1]:
                if design.widen(room):
                    self.events.append(f"{', '.join(c.id for c in self._round)}: the design may go on to {room} "
                                       f"measured blocks (up to {design.budget_steps} steps), the later candidates "
                                       f"being out of reach")
                measurements = design.look(self.group, room)  # (futility judged against the room it has)
        for j, measurement in enumerate(measurements):
            if measurement is None:
                continue
            self._measured[self._round[j].id] = measurement
            if measurement.estimate.verdict != "undecided" or not design.can_extend:
                self._decide(j, measurement)
        if all(f.fixed is not None for f in design.factors):
            self._end_round()
        else:
            design.extend()  # every rank judged the same observations: every rank extends

    @property
    def progress(self) -> Optional[tuple[int, int]]:
        """(steps calibrated, steps planned) while calibrating: the design's scheduled steps and the
        fewest of each design still to come."""
        if self.done:
            return None
        remaining = sum(self.budget.heads(self._queue, self._round).values())
        if self._design is not None:
            remaining += self._design.planned - self._design.recorded
        return self.plan.calibration_steps, self.plan.calibration_steps + remaining

    def describe(self) -> list[str]:
        """Where the round stands, a line each: the steps calibrated, the candidates decided so
        far, and the design in progress with what its last look measured of each factor."""
        steps, planned = self.progress or (self.plan.calibration_steps, self.plan.calibration_steps)
        lines = [f"calibrating: {steps} step(s) so far, about {planned} planned"
                 + ("; waiting for the generated kernels' builds" if self.waiting and self.expecting else "")]
        lines += [f"  {'ACCEPT' if d.accepted else 'reject'}     {d.candidate}: {d.reason}"
                  for d in self.plan.decisions if d.measured_ms is not None]
        for c in self._round:
            measured = self._measured.get(c.id)
            lines.append(f"  measuring  {c.id}: " + (self.planner.evidence(measured) if measured is not None
                                                     else "no look yet"))
        return lines

    def abandon(self, why: str) -> None:
        """Stop before every candidate is decided: the incumbent with the factors accepted so far is
        the plan, the candidates left are recorded as not calibrated (``why``), with what was
        measured of them so far."""
        if self._design is not None:
            self.incumbent = self._graphs[tuple(f.fixed is True for f in self._design.factors)]
            left = [c for c, f in zip(self._round, self._design.factors) if f.fixed is None]
            self._queue = left + [c for c in self._queue if c not in self._round]
        self.plan.decisions.extend(self.planner.undecided(c, why, self._measured.get(c.id)) for c in self._queue)
        self._queue, self._round, self._design, self._graphs = [], [], None, {}
        self.plan.graph = self.incumbent
        self._record_model()
        self.done = True

    def _record_model(self) -> None:
        """The model's inputs and its predictions of the identity plan and the plan, in the plan."""
        if self.planner.model is not None:
            self.plan.step_model = self.planner.model.record(self.plan.graph)

    def _next_round(self) -> None:
        """Start the next design: the queue's first candidate, and those after it that can join it
        in every combination."""
        while self._queue and (self._passed_over(self._queue[0]) or self._unreachable(self._queue[0])):
            self._queue.pop(0)  # (a sweep's rung not tried, infeasible on the incumbent or out of reach: recorded)
        if not self._queue or self.expecting:
            self._round, self._design, self._graphs = [], None, {}
            if not self.expecting:
                self._finish()
            return
        head = self._queue[0]
        protocol = self.planner.protocol(head)
        rule = self.planner.rule
        spent = self.plan.calibration_steps
        self.budget.judge_later(self._queue, [head], spent + self.budget.own_steps(protocol), self.incumbent)
        blocks = self.budget.blocks_left(self._queue, [head], spent)
        if blocks < bounding_pairs(1 - rule.confidence):
            why = f"the round's calibration budget ({rule.max_steps} steps) is spent"
            queue, self._queue = self._queue, []
            for c in queue:  # (those futile at any budget are decided as such)
                if not (self._passed_over(c) or self._unreachable(c, budget_spent=True)):
                    self.plan.decisions.append(self.planner.undecided(c, why))
            self._finish()
            return
        members, graphs = [head], {(False,): self.incumbent, (True,): self._apply(head)}
        self.planner.predict(head, self.incumbent, graphs[(True,)])
        for c in self._queue[1:]:
            if len(members) == most_factors(rule, blocks):
                break
            if self.planner.joins(head, c) and not self._passed_over(c, record=False):
                combined = self._combine(graphs, c)
                if combined is not None:
                    members.append(c)
                    graphs = combined
                    self.planner.predict(c, self.incumbent, graphs[(False,) * (len(members) - 1) + (True,)])
        self.planner.agree(self.group, [])  # (the predictions just made: the factors' futility reads them)
        # (the designs still to come, now these are in this one)
        blocks = self.budget.blocks_left(self._queue, members, spent)
        self._round, self._graphs, self._measured = members, graphs, {}
        self._design = FactorialDesign([Factor(self.planner.protocol(c).region,
                                               rule.min_gain_for(self.planner.protocol(c).region),
                                               self.planner.predict_ms(c)) for c in members],
                                       rule, zlib.crc32(",".join(c.id for c in members).encode()),
                                       protocol.warmup_pairs, protocol.settle_steps, blocks)
        steps = f"{self._design.planned} steps, up to {self._design.budget_steps}"
        for c in members:
            predicted = self.planner.predict_ms(c)
            together = f"; with {len(members) - 1} other candidate(s) in the same steps" if len(members) > 1 else ""
            self.events.append(f"calibrating {c.id} ({steps}"
                               + (f"; predicted {predicted:+.3f} ms" if predicted is not None else "") + together + ")")

    def _combine(self, graphs: dict[tuple[bool, ...], SparseGraph],
                 candidate: Candidate) -> Optional[dict[tuple[bool, ...], SparseGraph]]:
        """Every combination of the design's factors, with and without ``candidate``; None when one
        of them is infeasible."""
        out = {}
        for key, graph in graphs.items():
            try:
                out[key + (True,)] = self.planner.apply(graph, candidate)
            except InfeasibleCandidate:
                return None
            out[key + (False,)] = graph
        return out

    def _passed_over(self, candidate: Candidate, record: bool = True) -> bool:
        """Whether a sweep's rung is not tried (recorded as such unless ``record`` is False): the
        rung it follows was not accepted, or the sweep improved in the other direction."""
        why = None
        if candidate.follows is not None and candidate.when == "accepted" and not self._accepted.get(candidate.follows):
            why = f"the sweep stopped: {candidate.follows} was not accepted"
        elif candidate.unless is not None and self._accepted.get(candidate.unless):
            why = f"the sweep went the other way: {candidate.unless} was accepted"
        if why is None:
            return False
        if record:
            self._accepted[candidate.id] = False
            self.plan.decisions.append(self.planner.undecided(candidate, why))
        return True

    def _unreachable(self, candidate: Candidate, budget_spent: bool = False) -> bool:
        """Whether ``candidate`` is infeasible on the incumbent, or futile before any step is spent
        on it (recorded either way): the round's earlier designs measured its region's noise, and
        at that noise the budget left would not resolve even :data:`PREDICTION_SLACK` times the
        model's prediction on the incumbent (:meth:`.RoundBudget.reach`). That is the design's own
        futility rule judged on the prediction alone, so only where the model's terms hold within
        the slack: whole steps and the sparse regions (collectives, overlap, copies), where a futile
        first look costs 20-50 steps (dlrm: next batch, merged input, two buckets, predicted -0.9
        to 0 ms on a 77 ms step). Before its clock is measured a candidate is measured whatever the
        prediction; once the round's budget is spent (``budget_spent``) a prediction of no gain,
        out of reach at any noise, is decided futile rather than left "not calibrated" (the
        held-out two-tower's pipelined buckets, predicted +0.5 to +5.5 ms)."""
        applied = self._apply(candidate)
        if applied is None:
            return True
        if not self.budget.judged(candidate):
            return False
        blocks = self.budget.blocks_left(self._queue, [candidate], self.plan.calibration_steps)
        reach = self.budget.reach(candidate, blocks)
        if reach is None and not budget_spent:
            return False
        self.planner.predict(candidate, self.incumbent, applied)
        self.planner.agree(self.group, [])  # (every rank judges rank 0's prediction)
        predicted = self.planner.predict_ms(candidate)
        # (with the budget spent, no reach: a prediction of no gain is out of reach at any noise)
        if predicted is None or not (out_of_reach(predicted, reach) if reach is not None else predicted >= 0):
            return False
        protocol = self.planner.protocol(candidate)
        self._accepted[candidate.id] = False
        reason = f"{FUTILE_BEFORE_MEASURING}: the model predicts {predicted:+.3f} ms; " + (
            f"{PREDICTION_SLACK:g}x that does not reach the {reach:+.3f} ms that {blocks} pairs resolve at the "
            f"{protocol.region} clock's noise this round ({self.budget.clocks[protocol.region].spread_ms:.3f} ms per "
            f"pair)" if reach is not None else "no gain to resolve at any noise")
        self.plan.decisions.append(Decision(candidate.id, candidate.pass_name, candidate.module, candidate.role, True,
                                            [], predicted, None, None, False, reason))
        self.events.append(f"{candidate.id}: rejected, {reason}")
        return True

    def _apply(self, candidate: Candidate) -> Optional[SparseGraph]:
        """The incumbent with ``candidate`` applied; None, with the decision recorded, when the
        candidates accepted since it was proposed made it infeasible."""
        try:
            return self.planner.apply(self.incumbent, candidate)
        except InfeasibleCandidate as error:
            self._accepted[candidate.id] = False
            self.plan.decisions.append(Decision(candidate.id, candidate.pass_name, candidate.module, candidate.role,
                                                False, [str(error)], self.planner.predict_ms(candidate), None, None,
                                                False, f"infeasible after the candidates accepted before it: {error}"))
            return None

    def _decide(self, j: int, measurement: Measurement) -> None:
        """The design's factor ``j`` is decided: recorded, and fixed for the blocks that follow."""
        candidate = self._round[j]
        decision = self.planner.decide(candidate, measurement)
        self.plan.decisions.append(decision)
        self._accepted[candidate.id] = decision.accepted
        self._design.fix(j, decision.accepted)
        self._queue.remove(candidate)
        self.events.append(f"{candidate.id}: {'accepted' if decision.accepted else 'rejected'}, {decision.reason}")

    def _end_round(self) -> None:
        """Every factor is decided: the incumbent takes the accepted ones. Two accepted ones whose
        interaction (from the block sums) lies surely above zero are reported, not acted on: the
        block sums are not paired, so drift slower than a block (a busy machine) enters them; the
        steady-state check measures the plan as a whole."""
        design = self._design
        accepted = [j for j, f in enumerate(design.factors) if f.fixed]
        for j in accepted:
            for k in (k for k in accepted if k > j):
                both = design.interaction(j, k)
                if both is not None and both.interval_ms[0] > 0:
                    self.events.append(f"{self._round[j].id} and {self._round[k].id} together: {both.ms:+.3f} ms "
                                       f"beyond their own effects ({self.planner.rule.confidence:.0%} bounds "
                                       f"[{both.interval_ms[0]:+.3f}, {both.interval_ms[1]:+.3f}] over {both.blocks} "
                                       f"blocks); the steady-state check measures the plan as a whole")
        self.incumbent = self._graphs[tuple(bool(f.fixed) for f in design.factors)]
        self._round, self._design, self._graphs, self._measured = [], None, {}, {}
        self._next_round()

    def _finish(self) -> None:
        plan = self.plan
        plan.calibration_s = time.perf_counter() - self._calibration_start if plan.calibration_steps else 0.0
        plan.graph = self.incumbent
        self._record_model()
        installed = [ms for graph, ms in self._ran if graph is self.incumbent]
        if installed:  # (the last candidate's arms always include the plan installed)
            plan.calibration_excess_s = (sum(ms for _, ms in self._ran) - len(self._ran) * median(installed)) / 1e3
        self.done = True
