"""Optimization passes over the lifted graph: each one rewrites module schedules
(:mod:`~lightning_sparselift.passes.base`), one file per pass, listed in the registry."""

from lightning_sparselift.passes.base import Candidate, InfeasibleCandidate, OptimizationPass
from lightning_sparselift.passes.registry import PASSES, select_passes

__all__ = ["Candidate", "InfeasibleCandidate", "OptimizationPass", "PASSES", "select_passes"]
