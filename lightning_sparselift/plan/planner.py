"""The constraint-aware planner: asks each selected pass for its candidates, keeps the feasible
ones ordered by their predicted gain (the priors), and decides each from its measured increment
against the incumbent plan (or, without calibration, takes every feasible candidate)."""

from __future__ import annotations

from typing import Optional

from lightning_sparselift.cost.calibration import Measurement
from lightning_sparselift.cost.priors import Priors
from lightning_sparselift.lift import SparseGraph
from lightning_sparselift.passes import Candidate, OptimizationPass
from lightning_sparselift.plan.types import Decision, ExecutionPlan, PlanFileError


class Planner:
    def __init__(self, passes: list[OptimizationPass], priors: Optional[Priors], calibrate: bool) -> None:
        self.passes = {p.name: p for p in passes}
        self.priors = priors
        self.calibrate = calibrate

    def propose(self, graph: SparseGraph) -> tuple[list[Candidate], list[Decision]]:
        """Feasible candidates in the order to try them (largest predicted gain first), and the
        decisions for the infeasible ones."""
        feasible, rejected = [], []
        for p in self.passes.values():
            for candidate in p.candidates(graph):
                if p.only is not None and candidate.role not in p.only:
                    continue  # not selected
                if candidate.feasible:
                    feasible.append(candidate)
                else:
                    rejected.append(Decision(candidate.id, p.name, candidate.module, candidate.role, False,
                                             candidate.reasons, None, None, None, False,
                                             "infeasible: " + "; ".join(candidate.reasons)))
        feasible.sort(key=lambda c: self.predict_ms(c) if self.predict_ms(c) is not None else 0.0)
        return feasible, rejected

    def predict_ms(self, candidate: Candidate) -> Optional[float]:
        if self.priors is None:
            return None
        return self.passes[candidate.pass_name].predict_ms(candidate, self.priors)

    def decide(self, candidate: Candidate, measurement: Optional[Measurement]) -> Decision:
        predicted = self.predict_ms(candidate)
        if measurement is None:
            accepted, reason = True, "accepted without calibration (calibrate=False)"
        else:
            accepted = measurement.increment_ms < 0
            reason = (f"{'faster' if accepted else 'not faster'}: the slowest rank's best increment is "
                      f"{measurement.increment_ms:+.3f} ms")
        return Decision(candidate.id, candidate.pass_name, candidate.module, candidate.role, True, [], predicted,
                        measurement.observations_ms if measurement else None,
                        measurement.increment_ms if measurement else None, accepted, reason)

    def apply(self, graph: SparseGraph, candidate: Candidate) -> SparseGraph:
        return self.passes[candidate.pass_name].apply(graph, candidate)

    def rebuild(self, plan: ExecutionPlan, graph: SparseGraph) -> SparseGraph:
        """The graph a saved ``plan`` runs, rebuilt from this run's identity ``graph``: the plan's accepted
        candidates applied in their order, each one a feasible candidate of the selected passes. The plan's
        own graph must have the same structure (fingerprint) as the result, so a plan file cannot bring a
        module, an aggregation or a schedule that these passes would not produce on this graph. Raises
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
            theirs, ours = _passes_applied(plan.graph), _passes_applied(graph)
            raise PlanFileError("the plan's graph is not what its accepted candidates give on this run's graph: "
                                + (f"it has {theirs}; they give {ours}" if theirs != ours
                                   else "its layouts or collectives differ"))
        return graph


def _passes_applied(graph: SparseGraph) -> str:
    return "; ".join(f"{m.path} aggregated {m.aggregated} schedules {m.schedules}" for m in graph.modules)
