"""The constraint-aware planner and its loop on real training steps, in the style of TorchRec's
proposer (``propose`` -> measure -> ``feedback(plan, perf)``).

:class:`Planner` asks each selected pass for its candidates, keeps the feasible ones ordered by
their predicted gain (the priors), and decides each from its measured increment against the
incumbent plan (or, without calibration, takes every feasible candidate).

:class:`PlanningLoop` is one planning round: it owns the :class:`ExecutionPlan` being built,
says which graph the next training step runs (the candidate's trial or the incumbent, as the
candidate's pass's calibration protocol schedules them), takes each step's measurement, and
decides a candidate once its protocol is done. Whoever runs the steps (the session) installs the
graphs; the loop never touches the runtime::

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

from lightning_sparselift.cost.calibration import CalibrationProtocol, Measurement
from lightning_sparselift.cost.decision import DecisionRule, bounding_pairs
from lightning_sparselift.cost.design import MAX_FACTORS, Factor, FactorialDesign, fewest_steps
from lightning_sparselift.cost.priors import Priors
from lightning_sparselift.passes import Candidate, InfeasibleCandidate, OptimizationPass
from lightning_sparselift.plan.types import Decision, ExecutionPlan, PlanFileError, PlanFingerprint

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph


class Planner:
    def __init__(self, passes: list[OptimizationPass], priors: Optional[Priors], calibrate: bool,
                 rule: DecisionRule = DecisionRule()) -> None:
        self.passes = {p.name: p for p in passes}
        self.priors = priors
        self.calibrate = calibrate
        self.rule = rule

    def protocol(self, candidate: Candidate) -> CalibrationProtocol:
        """How ``candidate`` is measured (its pass's protocol for its role)."""
        return self.passes[candidate.pass_name].protocol_for(candidate.role)

    def propose(self, graph: SparseGraph) -> tuple[list[Candidate], list[Decision]]:
        """Feasible candidates in the order to try them (a pass after the passes it runs after;
        then the largest predicted gain first; a sweep's next rung right after the one it follows),
        and the decisions for the infeasible ones."""
        feasible, rejected, selected = [], [], set()
        for p in self.passes.values():
            for candidate in p.candidates(graph):
                if p.only is not None and candidate.role not in p.only:
                    continue  # not selected
                selected.add(candidate.id)
                if candidate.feasible:
                    feasible.append(candidate)
                else:
                    rejected.append(Decision(candidate.id, p.name, candidate.module, candidate.role, False,
                                             candidate.reasons, None, None, None, False,
                                             "infeasible: " + "; ".join(candidate.reasons)))
        feasible.sort(key=lambda c: (self.stage(c.pass_name),
                                     self.predict_ms(c) if self.predict_ms(c) is not None else 0.0))
        for c in feasible:
            if c.follows not in selected:  # (a rung selected without the one before it stands alone)
                c.follows, c.when, c.unless = None, "accepted", None
        ids = {c.id for c in feasible}
        orphans = [c for c in feasible if c.follows is not None and c.follows not in ids]
        while orphans:  # (a rung whose predecessor is not tried, then the rungs after it)
            for c in orphans:
                feasible.remove(c)
                ids.discard(c.id)
                why = f"it follows {c.follows}, which is infeasible"
                rejected.append(Decision(c.id, c.pass_name, c.module, c.role, False, [why], None, None, None, False,
                                         f"infeasible: {why}"))
            orphans = [c for c in feasible if c.follows is not None and c.follows not in ids]
        followers: dict[str, list[Candidate]] = {}
        for c in feasible:  # (the rungs taken when it was accepted first, then the turn)
            if c.follows is not None:
                followers.setdefault(c.follows, []).append(c)
        for after in followers.values():
            after.sort(key=lambda c: c.when != "accepted")
        ordered: list[Candidate] = []

        def place(c: Candidate) -> None:
            ordered.append(c)
            for f in followers.get(c.id, []):
                place(f)

        for c in feasible:
            if c.follows is None:  # (the others are placed right after the candidate they follow)
                place(c)
        return ordered, rejected

    def stage(self, name: str) -> int:
        """0 for a pass that runs after no selected pass, else one more than those it runs after."""
        after = [a for a in self.passes[name].runs_after if a in self.passes]
        return 1 + max(self.stage(a) for a in after) if after else 0

    def predict_ms(self, candidate: Candidate) -> Optional[float]:
        if self.priors is None:
            return None
        return self.passes[candidate.pass_name].predict_ms(candidate, self.priors)

    def decide(self, candidate: Candidate, measurement: Optional[Measurement]) -> Decision:
        """Accepted when the measurement's upper bound lies below minus the smallest gain worth a
        change (or without calibration)."""
        predicted = self.predict_ms(candidate)
        if measurement is None:
            return Decision(candidate.id, candidate.pass_name, candidate.module, candidate.role, True, [], predicted,
                            None, None, True, "accepted without calibration (calibrate=False)")
        e = measurement.estimate
        evidence = self._evidence(measurement)
        short = (f"its interval lies above the smallest gain accepted ({e.threshold_ms:+.3f} ms)"
                 if e.interval_ms[0] > e.threshold_ms else
                 f"the estimate is not half the smallest gain accepted ({e.threshold_ms:+.3f} ms), so more pairs "
                 f"would not make it win")
        reason = {"faster": f"faster: {evidence}", "slower": f"slower: {evidence}",
                  "negligible": f"negligible: {evidence}; {short}; rejected",
                  "futile": f"futile: {evidence}; neither it nor the prediction ({predicted:+.3f} ms) reaches "
                            f"{e.resolvable_ms:+.3f} ms, the smallest effect the design's budget would resolve; "
                            f"rejected" if e.resolvable_ms is not None and predicted is not None else "",
                  "undecided": f"undecided after the pair budget: {evidence}; rejected (do no harm)"}[e.verdict]
        return self._measured(candidate, measurement, e.verdict == "faster", reason)

    def undecided(self, candidate: Candidate, why: str, measured: Optional[Measurement] = None) -> Decision:
        """The decision for a feasible candidate the loop stopped before deciding: not accepted,
        with what was ``measured`` of it so far, if anything."""
        if measured is not None:
            return self._measured(candidate, measured, False,
                                  f"not calibrated: {why}; measured so far: {self._evidence(measured)}")
        return Decision(candidate.id, candidate.pass_name, candidate.module, candidate.role, True, [],
                        self.predict_ms(candidate), None, None, False, f"not calibrated: {why}")

    def _evidence(self, measurement: Measurement) -> str:
        e = measurement.estimate
        low, high = e.interval_ms
        return (f"{e.increment_ms:+.3f} ms, {self.rule.confidence:.0%} bounds [{low:+.3f}, {high:+.3f}] over "
                f"{e.pairs} pairs (noise {e.noise_ms:.3f} ms" + (f", {e.outliers} outlier pair(s) left out)"
                                                                if e.outliers else ")"))

    def _measured(self, candidate: Candidate, measurement: Measurement, accepted: bool, reason: str) -> Decision:
        e = measurement.estimate
        return Decision(candidate.id, candidate.pass_name, candidate.module, candidate.role, True, [],
                        self.predict_ms(candidate), measurement.observations_ms, e.increment_ms, accepted, reason,
                        list(e.interval_ms), self.rule.confidence, e.noise_ms, e.pairs, e.outliers)

    def apply(self, graph: SparseGraph, candidate: Candidate) -> SparseGraph:
        return self.passes[candidate.pass_name].apply(graph, candidate)

    def rebuild(self, plan: ExecutionPlan, graph: SparseGraph) -> SparseGraph:
        """The graph a saved ``plan`` runs, rebuilt from this run's identity ``graph``: the plan's accepted
        candidates applied in their order, each one a feasible candidate of the selected passes. The plan's
        own graph must have the same structure (fingerprint) as the result, so a plan file cannot bring a
        module or a pass's rewrite that these passes would not produce on this graph. Raises
        :class:`PlanFileError` naming the difference."""
        feasible, _ = self.propose(graph)
        unapplied = {c.id: c for c in feasible}
        for decision in plan.accepted:
            candidate = unapplied.pop(decision.candidate, None)
            if candidate is None:
                raise PlanFileError(f"the plan accepts {decision.candidate}, which is not a feasible candidate of the "
                                    f"selected optimizations on this run's graph (or is accepted twice)")
            graph = self.apply(graph, candidate)
        if plan.graph.fingerprint() != graph.fingerprint():
            raise PlanFileError("the plan's graph is not what its accepted candidates give on this run's graph: "
                                + _difference(plan.graph, graph))
        return graph


def _difference(theirs: SparseGraph, ours: SparseGraph) -> str:
    """What differs between a plan file's graph and the one its decisions give: the modules, else
    the passes applied (their provenance), else the structure below them."""
    their_modules, our_modules = [m.path for m in theirs.modules], [m.path for m in ours.modules]
    if their_modules != our_modules:
        return f"it has modules {their_modules}; this run's graph has {our_modules}"
    if theirs.provenance != ours.provenance:
        return f"it has the passes applied {theirs.provenance}; they give {ours.provenance}"
    return "its layouts or collectives differ"


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
        priors = planner.priors.to_dict() if planner.priors is not None else None
        self.plan = ExecutionPlan(fingerprint, identity, priors=priors)  # its graph is the incumbent once done
        self.incumbent = identity
        self.events = events if events is not None else []  # what happened, for the caller to report
        self.done = False
        # candidates may still come (:meth:`admit`): with nothing left to calibrate, the loop waits on
        # the incumbent instead of finishing
        self.expecting = False
        self._queue: list[Candidate] = []  # feasible candidates not decided yet, the design's among them
        self._round: list[Candidate] = []  # the factors of the design in progress
        self._design: Optional[FactorialDesign] = None
        self._graphs: dict[tuple[bool, ...], SparseGraph] = {}  # per assignment of the design's factors
        self._measured: dict[str, Measurement] = {}  # per factor of the design: its last look's measurement
        self._calibration_start = 0.0
        self._ran: list[tuple[SparseGraph, float]] = []  # per calibration step: the graph it ran, its wall ms
        self._accepted: dict[str, bool] = {}  # per candidate decided or passed over: whether it was accepted

    def propose(self, since: Optional[float] = None) -> None:
        """Propose the candidates (without calibration: apply every feasible one but a sweep's turn,
        which only a measurement makes, and the loop is done). ``since``: when planning this round
        began (``time.perf_counter()``), if before the call (the plan's ``planning_s`` counts from it)."""
        start = time.perf_counter() if since is None else since
        feasible, rejected = self.planner.propose(self.incumbent)
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
    def trials(self) -> list[Candidate]:
        """The candidates the design in progress varies."""
        return list(self._round)

    def next_graph(self) -> SparseGraph:
        """The graph the next training step runs: the incumbent with the factors the design applies
        in that step (the incumbent while the loop waits for candidates)."""
        return self.incumbent if self._design is None else self._graphs[self._design.next_assignment()]

    def admit(self) -> None:
        """Propose again on the incumbent (the graph now holds what new candidates need, e.g. built
        kernels): feasible candidates not proposed feasible before join the queue (their earlier
        infeasible decisions dropped); the loop no longer waits for more."""
        known = {c.id for c in self._queue} | set(self._accepted)
        feasible, _ = self.planner.propose(self.incumbent)
        new = [c for c in feasible if c.id not in known]
        admitted = {c.id for c in new}
        self.plan.decisions = [d for d in self.plan.decisions if d.candidate not in admitted]
        self._queue += new
        if new:
            self.events.append(f"admitted {len(new)} candidate(s) now feasible: {', '.join(sorted(admitted))}")
        self.expecting = False
        if self._design is None and not self.done:
            self._next_round()

    def feedback(self, step_ms: float, sparse_ms: float, lookup_ms: Optional[float] = None,
                 lookup_wall_ms: Optional[float] = None, step_cpu_ms: Optional[float] = None,
                 input_ms: Optional[float] = None) -> None:
        """The measurement of the step that ran :meth:`next_graph`: its whole wall time, the
        executor's measured regions, its lookup regions (on the lookup clock, and in wall time),
        the whole step on the training thread's clock and the input side on the lookup clock (each
        factor's protocol says which one counts). At each of the design's looks (a collective over
        ``group``) decides the factors whose verdict is in."""
        design = self._design
        if design is None:
            return  # (waiting for candidates on the incumbent: not a calibration step)
        self._ran.append((self.next_graph(), step_ms))
        design.record({"step": step_ms, "sparse": sparse_ms, "lookup": lookup_ms, "lookup_wall": lookup_wall_ms,
                       "step_cpu": step_cpu_ms, "input": input_ms})
        self.plan.calibration_steps += 1
        if not design.done:
            return
        for j, measurement in enumerate(design.look(self.group)):
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
        remaining = sum(self._heads(self._round).values())
        if self._design is not None:
            remaining += self._design.planned - self._design.recorded
        return self.plan.calibration_steps, self.plan.calibration_steps + remaining

    def _heads(self, members: list[Candidate]) -> dict[str, int]:
        """The queued candidates (but ``members``) that will start a design of their own, with that
        design's fewest steps (:func:`~lightning_sparselift.cost.design.fewest_steps`)."""
        heads: dict[str, int] = {}
        starters: list[Candidate] = []
        for c in self._queue:
            if c not in members and not any(self._joins(h, c) for h in starters):
                starters.append(c)
                protocol = self.planner.protocol(c)
                heads[c.id] = fewest_steps(self.planner.rule, protocol.warmup_pairs, protocol.settle_steps)
        return heads

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
        self.done = True

    def _joins(self, head: Candidate, c: Candidate) -> bool:
        """Whether ``c`` can be a factor of the design that ``head`` starts."""
        return (c is not head and head.follows is None and c.follows is None
                and self.planner.stage(head.pass_name) == self.planner.stage(c.pass_name)
                and self.planner.protocol(head).settle_steps == self.planner.protocol(c).settle_steps)

    def _next_round(self) -> None:
        """Start the next design: the queue's first candidate, and those after it that can join it
        in every combination."""
        while self._queue and self._passed_over(self._queue[0]):
            self._queue.pop(0)
        while self._queue and self._apply(self._queue[0]) is None:
            self._queue.pop(0)  # (infeasible on the incumbent: recorded)
            while self._queue and self._passed_over(self._queue[0]):
                self._queue.pop(0)
        if not self._queue:
            self._round, self._design, self._graphs = [], None, {}
            if not self.expecting:
                self._finish()
            return
        head = self._queue[0]
        members, graphs = [head], {(False,): self.incumbent, (True,): self._apply(head)}
        for c in self._queue[1:]:
            if len(members) == MAX_FACTORS:
                break
            if self._joins(head, c) and not self._passed_over(c, record=False):
                combined = self._combine(graphs, c)
                if combined is not None:
                    members.append(c)
                    graphs = combined
        protocol = self.planner.protocol(head)
        rule = self.planner.rule
        left = rule.max_steps - self.plan.calibration_steps - sum(self._heads(members).values())
        blocks = min(rule.max_pairs, left // (2 * (1 + protocol.settle_steps)) - protocol.warmup_pairs)
        if blocks < bounding_pairs(1 - rule.confidence):
            why = f"the calibration budget ({rule.max_steps} steps, calibration_max_steps) is spent"
            self.plan.decisions.extend(self.planner.undecided(c, why) for c in self._queue)
            self._queue = []
            self._finish()
            return
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
        installed = [ms for graph, ms in self._ran if graph is self.incumbent]
        if installed:  # (the last candidate's arms always include the plan installed)
            plan.calibration_excess_s = (sum(ms for _, ms in self._ran) - len(self._ran) * median(installed)) / 1e3
        self.done = True
