"""Optimization passes over the lifted graph, and their registry.

A pass proposes :class:`Candidate` changes of a :class:`~lightning_sparselift.lift.SparseGraph`,
checks each one's feasibility, predicts its increment from the priors, says how it is calibrated,
and applies it: ``apply`` is a function from graph to graph (the input is not modified) that
stamps the result with its provenance. Adding a pass is one file plus an entry in ``PASSES``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.cost.priors import Priors
from lightning_sparselift.lift import SparseGraph


@dataclass
class Candidate:
    """One change a pass proposes. ``feasible`` is False with ``reasons`` when a check fails."""

    pass_name: str
    name: str  # unique within the pass, e.g. "input@model.sparse_arch.embedding_bag_collection"
    module: str
    role: str
    feasible: bool
    reasons: list[str] = field(default_factory=list)
    cost_inputs: dict[str, float] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.pass_name}:{self.name}"


class OptimizationPass(ABC):
    name: str
    roles: tuple[str, ...]  # the kinds of candidate it proposes (``Candidate.role``)
    protocol: CalibrationProtocol

    def __init__(self, only: Optional[set[str]] = None) -> None:
        self.only = only  # the roles the planner may use (None: all)

    @abstractmethod
    def candidates(self, graph: SparseGraph) -> list[Candidate]:
        """Everything this pass could change in ``graph``, feasible or not (with the reason)."""

    @abstractmethod
    def predict_ms(self, candidate: Candidate, priors: Priors) -> float:
        """The prior's estimate of the step-time increment (negative: faster)."""

    @abstractmethod
    def apply(self, graph: SparseGraph, candidate: Candidate) -> SparseGraph:
        """A new graph with ``candidate`` applied (requires: ``candidate.feasible``)."""


# the registry (imported after the base class, which the passes subclass)
from lightning_sparselift.passes.aggregation import CommunicationAggregation  # noqa: E402
from lightning_sparselift.passes.latency_hiding import LatencyHiding  # noqa: E402

PASSES: dict[str, type[OptimizationPass]] = {cls.name: cls for cls in (CommunicationAggregation, LatencyHiding)}


def select_passes(names: list[str]) -> list[OptimizationPass]:
    """The passes ``names`` selects: a pass name (all its candidates) or ``pass:role`` (only that
    role's candidates, e.g. ``latency_hiding:early_start``). Unknown names raise."""
    selected: dict[str, Optional[set[str]]] = {}
    for name in names:
        base, _, role = name.partition(":")
        if base not in PASSES:
            raise ValueError(f"unknown optimization {name!r}; available: {sorted(PASSES)}")
        if role and role not in PASSES[base].roles:
            raise ValueError(f"unknown optimization {name!r}: {base} proposes {list(PASSES[base].roles)}")
        if not role or (base in selected and selected[base] is None):
            selected[base] = None
        else:
            selected.setdefault(base, set()).add(role)
    return [PASSES[base](only) for base, only in selected.items()]
