"""The constraint-aware planner, in the style of TorchRec's proposer (``propose`` -> measure ->
``feedback(plan, perf)``; its loop on real training steps: :mod:`.loop`).

:class:`Planner` asks each selected pass for its candidates, keeps the feasible ones ordered by
their predicted gain (the step-time model), and decides each from its measured increment against the
incumbent plan (or, without calibration, takes every feasible candidate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from lightning_sparselift.cost.calibration import CalibrationProtocol, Measurement
from lightning_sparselift.cost.decision import DecisionRule
from lightning_sparselift.cost.design import PREDICTION_SLACK
from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.passes import Candidate, InfeasibleCandidate, OptimizationPass
from lightning_sparselift.plan.types import Decision, ExecutionPlan, PlanFileError

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph


class Planner:
    def __init__(self, passes: list[OptimizationPass], model: Optional[StepModel], calibrate: bool,
                 rule: DecisionRule = DecisionRule()) -> None:
        self.passes = {p.name: p for p in passes}
        self.model = model
        self.calibrate = calibrate
        self.rule = rule
        self.predicted: dict[str, float] = {}  # per candidate: the model's increment on the graph it applies to last

    def protocol(self, candidate: Candidate) -> CalibrationProtocol:
        """How ``candidate`` is measured (its pass's protocol for its role)."""
        return self.passes[candidate.pass_name].protocol_for(candidate.role)

    def propose(self, graph: SparseGraph) -> tuple[list[Candidate], list[Decision]]:
        """Feasible candidates in the order to try them (a pass after the passes it runs after;
        then the largest predicted gain first; a sweep's next rung right after the one it follows),
        and the decisions for the infeasible ones. Each feasible one is predicted on ``graph``."""
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
        applied = []
        for c in feasible:
            try:
                applied.append((c, self.apply(graph, c)))
            except InfeasibleCandidate:
                pass  # (a sweep's later rung applies to its predecessor's graph only: predicted when measured)
        if self.model is not None:  # (``graph`` simulated once for all of them)
            for (c, _), increment in zip(applied, self.model.increments_ms(graph, [a for _, a in applied])):
                self.predicted[c.id] = increment
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

    def joins(self, head: Candidate, c: Candidate) -> bool:
        """Whether ``c`` can be a factor of the design that ``head`` starts. A candidate measured on
        the executor's sparse regions is measured alone: the other candidates' schedules change what
        those regions hold (on dlrm, merged input collectives measured -3.3 ms there beside an early
        start, whose lookups run inside them; about nil alone)."""
        protocols = (self.protocol(head), self.protocol(c))
        return (c is not head and head.follows is None and c.follows is None
                and self.stage(head.pass_name) == self.stage(c.pass_name)
                and protocols[0].settle_steps == protocols[1].settle_steps
                and "sparse" not in (protocols[0].region, protocols[1].region))

    def agree(self, group: Any, candidates: list[Candidate]) -> list[Candidate]:
        """Rank 0's predictions, and its order of ``candidates``, on every rank (a collective over
        ``group``). A prediction is floating-point arithmetic each rank does itself; should two
        ranks' last bits differ, near-equal candidates would be ordered (and their designs seeded)
        differently and the ranks would run different graphs in the same step."""
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return candidates
        payload = [self.predicted, [c.id for c in candidates]]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        self.predicted = payload[0]
        by_id = {c.id: c for c in candidates}
        return [by_id[i] for i in payload[1]]

    def predict(self, candidate: Candidate, before: SparseGraph, after: SparseGraph) -> Optional[float]:
        """The model's step increment of ``candidate`` applied to ``before`` (giving ``after``),
        kept as its prediction."""
        if self.model is None:
            return None
        self.predicted[candidate.id] = self.model.increment_ms(before, after)
        return self.predicted[candidate.id]

    def predict_ms(self, candidate: Candidate) -> Optional[float]:
        """The candidate's last prediction (None: no model, or never predicted)."""
        return self.predicted.get(candidate.id)

    def decide(self, candidate: Candidate, measurement: Optional[Measurement]) -> Decision:
        """Accepted when the measurement's upper bound lies below minus the smallest gain worth a
        change (or without calibration)."""
        predicted = self.predict_ms(candidate)
        if measurement is None:
            return Decision(candidate.id, candidate.pass_name, candidate.module, candidate.role, True, [], predicted,
                            None, None, True, "accepted without calibration (calibrate=False)")
        e = measurement.estimate
        evidence = self.evidence(measurement)
        short = (f"its interval lies above the smallest gain accepted ({e.threshold_ms:+.3f} ms)"
                 if e.interval_ms[0] > e.threshold_ms else
                 f"the estimate is not half the smallest gain accepted ({e.threshold_ms:+.3f} ms), so more pairs "
                 f"would not make it win")
        reason = {"faster": f"faster: {evidence}", "slower": f"slower: {evidence}",
                  "negligible": f"negligible: {evidence}; {short}; rejected",
                  "futile": f"futile: {evidence}; neither it nor {PREDICTION_SLACK:g}x the prediction "
                            f"({predicted:+.3f} ms) reaches {e.resolvable_ms:+.3f} ms, the smallest effect the "
                            f"design's budget would resolve; rejected"
                  if e.resolvable_ms is not None and predicted is not None else "",
                  "undecided": f"undecided after the pair budget: {evidence}; rejected (do no harm)"}[e.verdict]
        return self._measured(candidate, measurement, e.verdict == "faster", reason)

    def undecided(self, candidate: Candidate, why: str, measured: Optional[Measurement] = None) -> Decision:
        """The decision for a feasible candidate the loop stopped before deciding: not accepted,
        with what was ``measured`` of it so far, if anything."""
        if measured is not None:
            return self._measured(candidate, measured, False,
                                  f"not calibrated: {why}; measured so far: {self.evidence(measured)}")
        return Decision(candidate.id, candidate.pass_name, candidate.module, candidate.role, True, [],
                        self.predict_ms(candidate), None, None, False, f"not calibrated: {why}")

    def evidence(self, measurement: Measurement) -> str:
        """What ``measurement`` says of a candidate, in a line."""
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

    def choose_by_model(self, graph: SparseGraph, step_ms: float) -> tuple[SparseGraph, list[Decision]]:
        """Every candidate decided by the step-time model alone, where nothing can be measured (the
        simulator's world sizes): in :meth:`propose`'s order, each applied to the plan so far and
        accepted when its predicted gain is at least the smallest one a measured decision accepts
        (``rule.min_gain`` of ``step_ms``); a sweep's rungs as the loop tries them."""
        if self.model is None:
            raise ValueError("choosing by the model needs a step-time model")
        ordered, decisions = self.propose(graph)
        accepted: dict[str, bool] = {}
        threshold = -self.rule.min_gain * step_ms
        for c in ordered:
            skip = (f"the sweep stopped: {c.follows} was not accepted"
                    if c.follows is not None and c.when == "accepted" and not accepted.get(c.follows) else
                    f"the sweep went the other way: {c.unless} was accepted"
                    if c.unless is not None and accepted.get(c.unless) else "")
            if skip:
                decisions.append(Decision(c.id, c.pass_name, c.module, c.role, True, [], None, None, None, False,
                                          f"not tried: {skip}"))
                continue
            try:
                after = self.apply(graph, c)
            except InfeasibleCandidate as error:
                decisions.append(Decision(c.id, c.pass_name, c.module, c.role, False, [str(error)], None, None, None,
                                          False, f"infeasible on the plan so far: {error}"))
                continue
            gain = self.predict(c, graph, after)
            accepted[c.id] = gain <= threshold
            verdict = "accepted" if accepted[c.id] else "rejected"
            decisions.append(Decision(c.id, c.pass_name, c.module, c.role, True, [], gain, None, None, accepted[c.id],
                                      f"{verdict} by the model: predicted {gain:+.3f} ms against the smallest gain "
                                      f"accepted ({threshold:+.3f} ms)"))
            if accepted[c.id]:
                graph = after
        return graph, decisions

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
