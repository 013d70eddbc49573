"""Output distribution as a module's schedule says: each output bucket's pooled blocks go back to
the samples' ranks in one all-to-all (left in flight when the lookups started early and the
bucket is waited for at the module's call), row-wise partial sums are reduce-scattered; the
autograd Functions carry the gradients' collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.ir import ModuleSchedule
from lightning_sparselift.runtime.collectives import (
    IssuePooledAllToAll, MergedPooledAllToAll, PooledReduceScatter, WaitPooledAllToAll,
)
from lightning_sparselift.runtime.input_dist import GroupRuntime
from lightning_sparselift.runtime.layout import PooledLayout


@dataclass
class _OutputBucket:
    groups: list[int]
    pooled: bool  # all-to-all of pooled blocks (else a row-wise reduce-scatter)
    in_flight: bool  # issued with an early start, waited for at the module's call
    process_group: Any


@dataclass
class Pending:
    """An output all-to-all left in flight."""

    groups: list[int]
    layout: PooledLayout
    box: dict
    received: Tensor


class OutputDistribution:
    def __init__(self, schedule: ModuleSchedule, groups: list[GroupRuntime], process_groups: dict[str, Any],
                 rank: int, clock: RegionClock) -> None:
        self.groups, self.rank, self.clock = groups, rank, clock
        self.buckets = [_OutputBucket(e.groups, e.op == "all_to_all_single", e.wait != schedule.lookup_at,
                                      process_groups[e.process_group]) for e in schedule.outputs]

    def issue(self, locals_: list[Tensor], batch_size: int, early: bool) -> tuple[list[Tensor], list[Pending]]:
        """Every group's output (data-parallel and one-rank groups as they are), and the
        all-to-alls left in flight when the lookups ran ``early``."""
        out: list[Tensor] = list(locals_)
        pending = []
        for b in self.buckets:
            if not b.pooled:
                (i,) = b.groups
                out[i] = PooledReduceScatter.apply(locals_[i], b.process_group, self.clock)
                continue
            layout = PooledLayout([self.groups[i].spec.dim_sum_per_rank for i in b.groups], batch_size,
                                  b.process_group, [self.groups[i].column_index for i in b.groups], self.rank)
            tensors = [locals_[i] for i in b.groups]
            if early and b.in_flight:
                box: dict = {}
                pending.append(Pending(b.groups, layout, box,
                                       IssuePooledAllToAll.apply(layout, box, self.clock, *tensors)))
            else:
                for i, tensor in zip(b.groups, MergedPooledAllToAll.apply(layout, self.clock, *tensors)):
                    out[i] = tensor
        return out, pending

    def wait(self, out: list[Tensor], pending: list[Pending]) -> list[Tensor]:
        for p in pending:
            for i, tensor in zip(p.groups, WaitPooledAllToAll.apply(p.received, p.layout, p.box, self.clock)):
                out[i] = tensor
        return out

    @staticmethod
    def drain(pending: list[Pending]) -> None:
        """Complete in-flight exchanges whose result will not be used."""
        for p in pending:
            p.box.pop("work").wait()

