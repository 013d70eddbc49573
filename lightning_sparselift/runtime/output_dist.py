"""Output distribution as a module's schedule says: each output bucket's lookup outputs go back to
the samples' ranks in one all-to-all (pooled blocks, or an EmbeddingCollection's rows), left in
flight when the lookups started early and the bucket is waited for at the module's call; row-wise
partial sums are reduce-scattered; an EmbeddingCollection's row-wise rows are put back in the
order of the ids before bucketization; a group's pipelined buckets (``runtime.pipeline``) run their
lookups here, each bucket's all-to-all on its own process group. The autograd Functions carry the
gradients' collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.ir import ModuleSchedule
from lightning_sparselift.ir.schedule import CONSUMER_KERNEL
from lightning_sparselift.ir.vocab import POOLED_ALL_TO_ALL_OP, REDUCE_SCATTER_OP, SEQUENCE_ALL_TO_ALL_OP
from lightning_sparselift.runtime.buffers import Buffers
from lightning_sparselift.runtime.consumer_layout import fused_wire
from lightning_sparselift.runtime.collectives import (
    IssueOutputAllToAll, Layout, OutputAllToAll, PooledReduceScatter, WaitOutputAllToAll,
)
from lightning_sparselift.runtime.input_dist import Distributed, GroupRuntime
from lightning_sparselift.runtime.layout import ExchangeBuffers, PooledLayout, SequenceLayout, Wire
from lightning_sparselift.runtime.pipeline import Pipeline
from lightning_sparselift.runtime.torchrec_group import TorchRecGroup


@dataclass
class _OutputBucket:
    groups: list[int]
    all_to_all: bool  # else a row-wise reduce-scatter
    in_flight: bool  # issued with an early start, waited for at the module's call
    process_group: Any
    buffers: ExchangeBuffers
    pipeline: Optional[Pipeline] = None  # its group's lookup and all-to-all, pipelined bucket by bucket


@dataclass
class Pending:
    """An output all-to-all left in flight."""

    groups: list[int]
    layout: Layout
    box: dict
    token: Tensor  # joins the issue and the wait in autograd (what arrives is in the box)
    unbucketize: list[Optional[Tensor]]
    pipeline: Optional[Pipeline] = None  # a pipelined group's buckets' all-to-alls


@dataclass
class KeptPending:
    """The output distribution of a group that keeps TorchRec's path, in flight (TorchRec's awaitable)."""

    group: int
    awaitable: Any


class OutputDistribution:
    def __init__(self, schedule: ModuleSchedule, groups: list[GroupRuntime], kept: dict[int, TorchRecGroup],
                 process_groups: dict[str, Any], rank: int, clock: RegionClock, buffers: Buffers,
                 pipelines: dict[int, Pipeline], wires: dict[str, Wire]) -> None:
        """``pipelines``: by group, the pipelines of the groups whose exchange the schedule splits;
        ``wires``: the quantized exchanges, by TorchRec's comm op (``ir.vocab.WIRE_ROLES``)."""
        self.groups, self.kept, self.rank, self.clock, self.wires = groups, kept, rank, clock, wires
        # the consumer layout reads what the all-to-alls received as it arrived (and gives their
        # gradients back laid out as the send buffers)
        self.raw = schedule.region("output").kernel == CONSUMER_KERNEL
        self.raw_wire = self.raw and fused_wire(schedule) is not None
        self.buckets = [_OutputBucket(e.groups, e.op == "all_to_all_single", e.wait != schedule.lookup_at,
                                      process_groups[e.process_group], ExchangeBuffers.of(buffers, e.groups),
                                      pipelines.get(e.groups[0]) if e.split else None)
                        for e in schedule.outputs]
        self.pipelined = set(pipelines)

    def issue(self, locals_: list[Optional[Tensor]], inputs: list[Distributed], batch_size: int, early: bool
              ) -> tuple[list[Tensor], list[Pending | KeptPending]]:
        """Every group's output (data-parallel and one-rank groups as they are), and the
        exchanges left in flight, waited for when the model first reads the module's output (the
        executor hands it over as TorchRec does, lazily): the awaitables of the groups that keep
        TorchRec's path, and at the module call every other all-to-all but a pipelined group's (its
        buckets' exchanges run with its lookups and are waited for here); when the lookups ran
        ``early`` (at the root forward), the exchanges the schedule waits for at the module call.
        The lookups of pipelined groups (``locals_`` None) run here, with their exchanges."""
        exchanged = {i for b in self.buckets for i in b.groups}
        out = [t if i in exchanged else _unbucketize(t, d.unbucketize) for i, (t, d) in enumerate(zip(locals_, inputs))]
        pending: list[Pending | KeptPending] = []
        for i, group in self.kept.items():
            pending.append(KeptPending(i, group.issue_output(locals_[i], inputs[i].context)))
        for b in self.buckets:
            if not b.all_to_all:
                (i,) = b.groups
                out[i] = PooledReduceScatter.apply(locals_[i], b.process_group, self.clock,
                                                   self.wires[REDUCE_SCATTER_OP].for_step())
                continue
            layout = self._layout(b, inputs, batch_size)
            if b.pipeline is not None:
                (i,) = b.groups
                box = {}
                with self.clock.lookup():
                    token = b.pipeline.issue(inputs[i].kjt, layout, box)
                if token.requires_grad:
                    self.clock.lookup_backward(token)
                if early and b.in_flight:
                    pending.append(Pending(b.groups, layout, box, token, [inputs[i].unbucketize], b.pipeline))
                else:
                    self._place(out, b.groups, b.pipeline.wait(token, layout, box), [inputs[i].unbucketize])
                continue
            tensors = [locals_[i] for i in b.groups]
            unbucketize = [inputs[i].unbucketize for i in b.groups]
            if b.in_flight or not early:
                box: dict = {}
                pending.append(Pending(b.groups, layout, box, IssueOutputAllToAll.apply(layout, box, self.clock,
                                                                                        *tensors), unbucketize))
            else:
                self._place(out, b.groups, OutputAllToAll.apply(layout, self.clock, *tensors), unbucketize)
        return out, pending

    def _place(self, out: list[Optional[Tensor]], groups: list[int], received: tuple[Tensor, ...],
               unbucketize: list[Optional[Tensor]]) -> None:
        """A bucket's outputs into ``out``: per group, or (raw) the received buffer at its first group."""
        if self.raw:
            out[groups[0]], = received
            for i in groups[1:]:
                out[i] = None
            return
        for i, tensor, u in zip(groups, received, unbucketize):
            out[i] = _unbucketize(tensor, u)

    def _layout(self, b: _OutputBucket, inputs: list[Distributed], batch_size: int) -> Layout:
        groups = [self.groups[i] for i in b.groups]
        if groups[0].row_width is None:
            return PooledLayout([g.spec.dim_sum_per_rank for g in groups], batch_size, b.process_group,
                                [g.column_index for g in groups], self.rank, b.buffers, self.raw,
                                wire=self.wires[POOLED_ALL_TO_ALL_OP].for_step(), raw_wire=self.raw_wire)
        got = [inputs[i] for i in b.groups]
        return SequenceLayout([g.spec.dim_sum_per_rank for g in groups], [d.kjt.lengths() for d in got],
                              [g.row_recat for g in groups], [g.row_back for g in groups],
                              [d.sent for d in got], [d.received for d in got], b.process_group, self.rank, b.buffers,
                              self.wires[SEQUENCE_ALL_TO_ALL_OP].for_step())

    def wait(self, out: list[Tensor], pending: list[Pending | KeptPending]) -> list[Tensor]:
        for p in pending:
            if isinstance(p, KeptPending):
                out[p.group] = p.awaitable.wait()
                continue
            if p.pipeline is not None:
                with self.clock.region():
                    received = p.pipeline.wait(p.token, p.layout, p.box)
            else:
                received = WaitOutputAllToAll.apply(p.token, p.layout, p.box, self.clock)
            self._place(out, p.groups, received, p.unbucketize)
        return out

    @staticmethod
    def drain(pending: list[Pending | KeptPending]) -> None:
        """Complete in-flight exchanges whose result will not be used."""
        for p in pending:
            if isinstance(p, KeptPending):
                p.awaitable.wait()
            elif p.pipeline is not None:
                p.pipeline.drain(p.box)
            else:
                p.box.pop("work").wait()


def _unbucketize(rows: Tensor, unbucketize: Optional[Tensor]) -> Tensor:
    """An EmbeddingCollection's row-wise rows, in bucket order, back in the order of the ids
    before bucketization (TorchRec's index_select)."""
    return rows if unbucketize is None else torch.index_select(rows, 0, unbucketize)
