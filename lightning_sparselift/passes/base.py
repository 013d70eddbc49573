"""What every optimization pass is: it proposes :class:`Candidate` changes of a lifted graph with
their feasibility and cost inputs, says how it is calibrated, and rewrites the schedule of one
module to apply it (what that does to the step, the step-time model of
:mod:`lightning_sparselift.cost.step_model` predicts from the rewritten schedule).

:meth:`OptimizationPass.apply` is the shared prologue and epilogue (as torch.fx's
``PassBase``: requires -> call -> ensures): it requires a feasible candidate, copies the graph
(the input is never modified), lets the pass :meth:`~OptimizationPass.rewrite` the module's
schedule, ensures the result is a schedule the runtime can execute, and stamps the provenance.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.ir import LiftedModule, ScheduleError, SparseGraph, check_schedule
from lightning_sparselift.ir.schedule import Region


class InfeasibleCandidate(ValueError):
    """A candidate applied to a graph on which it is not feasible."""


@dataclass
class Candidate:
    """One change a pass proposes. ``feasible`` is False with ``reasons`` when a check fails."""

    pass_name: str
    name: str  # unique within the pass, e.g. "input@model.sparse_arch.embedding_bag_collection"
    module: str
    role: str  # the kind of change (one of the pass's ``roles``)
    feasible: bool
    reasons: list[str] = field(default_factory=list)
    cost_inputs: dict[str, float] = field(default_factory=dict)
    # the candidate (id) this one is decided after: the rungs of a sweep. ``when`` "accepted": it
    # must have been accepted for this one to be tried (4 buckets only after 2 improved on 1);
    # "decided": whatever its verdict, once it and the rungs that follow it when accepted are done
    # (a sweep turning the other way). ``unless``: a candidate whose acceptance means this one is
    # not tried (the sweep improved in the other direction)
    follows: Optional[str] = None
    when: str = "accepted"
    unless: Optional[str] = None

    @property
    def id(self) -> str:
        return f"{self.pass_name}:{self.name}"


class OptimizationPass(ABC):
    name: str
    roles: tuple[str, ...]  # the kinds of candidate it proposes (``Candidate.role``)
    protocol: CalibrationProtocol
    # passes whose candidates are decided before this pass's (when selected): this one builds on
    # what they change (e.g. buckets of a generated kernel after the kernel itself)
    runs_after: tuple[str, ...] = ()
    # its candidates run generated lookup kernels: the session builds them from the lift on
    uses_generated_kernels: bool = False

    def __init__(self, only: Optional[set[str]] = None, numerics: str = "exact") -> None:
        self.only = only  # the roles the planner may use (None: all)
        self.numerics = numerics  # the strategy's: "fast" allows candidates that are not bit-identical

    def candidates(self, graph: SparseGraph) -> list[Candidate]:
        """Everything this pass could change in ``graph``, feasible or not (with the reasons)."""
        out = []
        for module in graph.modules:
            for role in self.roles:
                reasons, cost_inputs = self.check(graph, module, role)
                out.append(Candidate(self.name, f"{role}@{module.path}", module.path, role, not reasons, reasons,
                                     cost_inputs))
        return out

    def kernels_to_build(self, graph: SparseGraph) -> dict[str, list[Region]]:
        """By module: the generated lookup regions its feasible-but-for-them candidates would run
        that ``graph`` has no kernel for yet, beyond the ones built from the lift on (a group's
        one-bucket kernel). The session builds them off the training thread and records them in
        the graph, after which those candidates are feasible."""
        return {}

    def protocol_for(self, role: str) -> CalibrationProtocol:
        """How a candidate of ``role`` is calibrated (the pass's protocol unless a role needs another)."""
        return self.protocol

    @abstractmethod
    def check(self, graph: SparseGraph, module: LiftedModule, role: str) -> tuple[list[str], dict[str, float]]:
        """Why ``role`` cannot apply to ``module`` ([] when it can), and its cost inputs."""

    @abstractmethod
    def rewrite(self, graph: SparseGraph, module: LiftedModule, candidate: Candidate) -> str:
        """Change ``module.schedule`` (in ``graph``, a copy) as ``candidate`` says; returns what
        was done, for the provenance."""

    def apply(self, graph: SparseGraph, candidate: Candidate) -> SparseGraph:
        """A new graph with ``candidate`` applied."""
        reasons = self.check(graph, graph.module(candidate.module), candidate.role)[0] if candidate.feasible \
            else candidate.reasons
        if reasons:  # (also on this graph: a candidate proposed on another one may no longer apply)
            raise InfeasibleCandidate(f"{candidate.id} is not feasible: {reasons}")
        out = graph.copy()
        module = out.module(candidate.module)
        note = self.rewrite(out, module, candidate)
        problems = check_schedule(module.schedule, module.kinds, out.world_size, module.pooled)
        if problems:
            raise ScheduleError(f"{candidate.id} gives a schedule the runtime cannot execute: {'; '.join(problems)}")
        out.provenance.append(f"{self.name}: {note}")
        return out
