"""The intermediate representation: the lifted graph, the schedule each module runs, the words
they share, their JSON form and fingerprint, and their explanation."""

from lightning_sparselift.ir.graph import LiftedModule, OutputConsumer, ShardingGroup, SparseGraph, TableShard
from lightning_sparselift.ir.schedule import (
    InputExchange, ModuleSchedule, OutputExchange, Region, ScheduleError, check_schedule, identity_schedule,
)
from lightning_sparselift.ir.steps import CollectiveNode, ComputeNode, member_bytes

__all__ = ["CollectiveNode", "ComputeNode", "InputExchange", "LiftedModule", "ModuleSchedule", "OutputConsumer",
           "OutputExchange", "Region", "ScheduleError", "ShardingGroup", "SparseGraph", "TableShard", "check_schedule",
           "identity_schedule", "member_bytes"]
