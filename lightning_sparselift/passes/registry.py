"""The optimization passes the planner may use, by name. Adding a pass: its file, plus one entry here."""

from __future__ import annotations

from typing import Optional

from lightning_sparselift.passes.aggregation import CommunicationAggregation
from lightning_sparselift.passes.base import OptimizationPass
from lightning_sparselift.passes.codegen import CodeGeneration
from lightning_sparselift.passes.communication_precision import CommunicationPrecision
from lightning_sparselift.passes.latency_hiding import LatencyHiding
from lightning_sparselift.passes.subgraph_parallelism import SubgraphParallelism

PASSES: dict[str, type[OptimizationPass]] = {cls.name: cls for cls in (CommunicationAggregation, LatencyHiding, CodeGeneration,
                                                                       SubgraphParallelism, CommunicationPrecision)}


def select_passes(names: list[str], numerics: str = "exact") -> list[OptimizationPass]:
    """The passes ``names`` selects: a pass name (all its candidates) or ``pass:role`` (only that
    role's candidates, e.g. ``latency_hiding:early_start``), under the strategy's ``numerics``.
    Unknown names raise."""
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
    return [PASSES[base](only, numerics) for base, only in selected.items()]
