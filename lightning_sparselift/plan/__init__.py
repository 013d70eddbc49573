"""Plan: the execution plan (plain typed data, JSON), the planner and its loop that fill it from
candidates and measurements, and the plan file."""

from lightning_sparselift.plan.loop import PlanningLoop
from lightning_sparselift.plan.planner import Planner
from lightning_sparselift.plan.types import Decision, ExecutionPlan, PlanFingerprint, PlanFileError

__all__ = ["Decision", "ExecutionPlan", "PlanFileError", "PlanFingerprint", "Planner", "PlanningLoop"]
