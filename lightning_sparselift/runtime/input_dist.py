"""Input distribution as a module's schedule says: its features permuted into group order and
split by group, row-wise groups bucketized, then for each input bucket one splits all-to-all
(what every rank sends every other) and its payload: TorchRec's one all-to-all per tensor, or
every tensor of the bucket's groups in one byte-packed all-to-all. The payload is issued when
:meth:`InputDistribution.start` returns; the function it returns waits and builds each group's
KJT for its lookup (with what an EmbeddingCollection's output distribution needs)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.ir import LiftedModule, ModuleSchedule, ShardingGroup
from lightning_sparselift.ir.schedule import GENERATED_KERNEL
from lightning_sparselift.ir.vocab import ROW_SHARDED
from lightning_sparselift.runtime.buffers import Buffers
from lightning_sparselift.runtime.input_layout import InputKernel
from lightning_sparselift.runtime.kernels import kernel, recat_order
from lightning_sparselift.runtime.packing import pack_by_destination, packed_sizes, unpack_by_source
from lightning_sparselift.runtime.torchrec_group import TorchRecGroup

Received = tuple[Tensor, Tensor, Optional[Tensor]]  # lengths, values, weights
Counts = tuple[list[int], list[int]]  # lengths and values per destination (or source) rank


@dataclass
class GroupRuntime:
    """Tensors precomputed from a group's plain description."""

    spec: ShardingGroup
    lookup: nn.Module  # TorchRec's lookup module of the group (owns its tables and optimizer state)
    local_keys: list[str]
    recat: Optional[Tensor]  # what arrived, [src][key] -> [key][src] (the lookups' order)
    block_sizes: Optional[Tensor]
    column_index: Optional[Tensor]
    # an EmbeddingCollection's group: the width of the rows this rank looks up (None: pooled)
    row_width: Optional[int] = None
    # ... and its rows, [key][src] -> [src][key] for the output all-to-all and back for their
    # gradients (None: not exchanged here)
    row_recat: Optional[Tensor] = None
    row_back: Optional[Tensor] = None

    @classmethod
    def build(cls, spec: ShardingGroup, lookup: nn.Module, world: int, rank: int, device: torch.device,
              pooled: bool) -> "GroupRuntime":
        keys = spec.keys_on_rank(rank) if spec.sharding_type != "data_parallel" else list(spec.features)
        recat = row_recat = row_back = None
        n = len(keys)
        if world > 1 and spec.sharding_type != "data_parallel" and keys:
            recat = recat_order(n, world, device)
            if not pooled:
                row_recat = torch.tensor([j + i * world for j in range(world) for i in range(n)], dtype=torch.int32,
                                         device=device)
                row_back = recat
        blocks = torch.tensor(spec.block_sizes, dtype=torch.int64, device=device) if spec.block_sizes else None
        columns = torch.tensor(spec.column_order, dtype=torch.long, device=device) if spec.column_order else None
        width = None
        if not pooled:
            width = spec.dim_sum_per_rank[rank] if spec.dim_sum_per_rank else spec.tables[0].dim
        return cls(spec, lookup, keys, recat, blocks, columns, width, row_recat, row_back)


@dataclass
class Distributed:
    """One group's input after its distribution, with what its output distribution needs."""

    kjt: Any  # what the group's lookup reads
    features: Any  # the group's features before distribution (this rank's samples)
    sent: list[int]  # ids this rank sent to each rank ([]: not exchanged)
    received: list[int]  # ids each rank sent here
    unbucketize: Optional[Tensor]  # EmbeddingCollection, row-wise: where each id's row goes back
    context: Any = None  # a group that keeps TorchRec's path: TorchRec's sharding context of the step


class _Bucket:
    """One input exchange: its groups, process group and payload exchange (received into the
    module's kept buffers)."""

    def __init__(self, groups: list[int], packed: bool, process_group: Any, world: int, buffers: Buffers) -> None:
        self.groups, self.packed, self.process_group, self.world = groups, packed, process_group, world
        key = tuple(groups)
        self.received = [buffers.at((f"input_{role}", key)) for role in ("lengths", "values", "weights")]
        self.payload = buffers.at(("input_payload", key))

    def exchange_splits(self, kjts: list[Any], counts: list[Counts]) -> list[list[list[int]]]:
        """Per group, per source rank: [lengths, values, (weights,) batch size] it sends here,
        all the bucket's groups in one all-to-all."""
        rows = []
        for kjt, (lengths, values) in zip(kjts, counts):
            group_rows = [lengths, values] + ([values] if kjt.weights_or_none() is not None else [])
            rows.append(torch.tensor(group_rows + [[kjt.stride()] * self.world], dtype=torch.int64).t())
        send = torch.cat(rows, dim=1).contiguous() if len(rows) > 1 else rows[0].contiguous()  # [dst, columns]
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.process_group)
        return [t.tolist() for t in received.split([r.size(1) for r in rows], dim=1)]

    def issue_payload(self, kjts: list[Any], send: list[Counts], recv: list[Counts]) -> Callable[[], list[Received]]:
        return (self._issue_packed if self.packed else self._issue_per_tensor)(kjts, send, recv)

    def _issue_per_tensor(self, kjts: list[Any], send: list[Counts], recv: list[Counts]
                          ) -> Callable[[], list[Received]]:
        """TorchRec's payload exchange: one all-to-all each for lengths, values and weights."""
        (kjt,), (out_counts,), (in_counts,) = kjts, send, recv
        tensors = [(kjt.lengths(), out_counts[0], in_counts[0]), (kjt.values(), out_counts[1], in_counts[1])]
        if kjt.weights_or_none() is not None:
            tensors.append((kjt.weights(), out_counts[1], in_counts[1]))
        outputs, works = [], []
        for (tensor, out_splits, in_splits), buffer in zip(tensors, self.received):
            out = buffer.empty((sum(in_splits),), tensor.dtype, tensor.device)
            works.append(dist.all_to_all_single(out, tensor, in_splits, out_splits, group=self.process_group,
                                                async_op=True))
            outputs.append(out)

        def wait() -> list[Received]:
            for work in works:
                work.wait()
            return [(outputs[0], outputs[1], outputs[2] if len(outputs) > 2 else None)]

        return wait

    def _issue_packed(self, kjts: list[Any], send: list[Counts], recv: list[Counts]) -> Callable[[], list[Received]]:
        """Every group's lengths, values and weights in one byte-packed all-to-all."""
        sections = []  # per group: [(tensor, send counts, recv counts)] for values, weights, lengths
        for kjt, out_counts, in_counts in zip(kjts, send, recv):
            group = [(kjt.values(), out_counts[1], in_counts[1])]
            if kjt.weights_or_none() is not None:
                group.append((kjt.weights(), out_counts[1], in_counts[1]))
            group.append((kjt.lengths(), out_counts[0], in_counts[0]))
            sections.append(group)
        flat = [sec for group in sections for sec in group]
        buffer, send_bytes = pack_by_destination([(t, c) for t, c, _ in flat], self.world)
        recv_layout = [(t.dtype, got) for t, _, got in flat]
        recv_bytes = packed_sizes(recv_layout, self.world)
        received = self.payload.empty((sum(recv_bytes),), buffer.dtype, buffer.device)
        work = dist.all_to_all_single(received, buffer, recv_bytes, send_bytes, group=self.process_group,
                                      async_op=True)

        def wait() -> list[Received]:
            work.wait()
            unpacked = unpack_by_source(received, recv_layout, recv_bytes)
            out, i = [], 0
            for group in sections:
                out.append((unpacked[i + len(group) - 1], unpacked[i], unpacked[i + 1] if len(group) == 3 else None))
                i += len(group)
            return out

        return wait


class InputDistribution:
    def __init__(self, spec: LiftedModule, schedule: ModuleSchedule, groups: list[GroupRuntime],
                 kept: dict[int, TorchRecGroup], process_groups: dict[str, Any], world: int,
                 device: torch.device, buffers: Buffers, clock: RegionClock,
                 generated: Optional[Callable[[], InputKernel]] = None) -> None:
        """``clock``: times the input side's work on the training thread (its ``input`` region);
        ``generated``: the module's input kernel, for permute, bucketize and recat regions that run it."""
        self.spec, self.groups, self.kept, self.world, self.clock = spec, groups, kept, world, clock

        def region_kernel(name: str, group: Optional[int] = None) -> Callable[..., Any]:
            chosen = schedule.region(name, group).kernel
            if chosen != GENERATED_KERNEL:
                return kernel(name, chosen)
            if generated is None:
                raise LookupError(f"the {name} region runs the generated input kernel, which the runtime was not given")
            return generated().permute if group is None else partial(getattr(generated(), name), group)

        self.order = torch.tensor(spec.feature_order, dtype=torch.int32, device=device) if spec.feature_order else None
        self.splits = [len(g.features) for g in spec.groups]
        self.permute = region_kernel("permute") if spec.feature_order else None
        self.bucketize = {i: region_kernel("bucketize", i) for i, g in enumerate(spec.groups) if g.kind in ROW_SHARDED}
        self.recat = {i: region_kernel("recat", i) for e in schedule.inputs for i in e.groups}
        self.buckets = [_Bucket(e.groups, e.packing == "bytes", process_groups[e.process_group], world, buffers)
                        for e in schedule.inputs]

    @torch.no_grad()
    def start(self, features: Any) -> Optional[Callable[[], list[Any]]]:
        """Permute, bucketize, exchange the splits and issue the payload all-to-alls (and the
        input dists of the groups that keep TorchRec's path). Returns what waits for them and
        builds the KJT each group's lookup reads; None when ranks passed different batch sizes
        (every rank knows every rank's batch size from the splits, so all return None together)."""
        with self.clock.input():
            return self._start(features)

    def _start(self, features: Any) -> Optional[Callable[[], list[Any]]]:
        permuted = self.permute(features, self.spec.feature_order, self.order) if self.permute else features
        before = list(permuted.split(self.splits))
        parts = list(before)
        unbucketize: list[Optional[Tensor]] = [None] * len(parts)
        for i, bucketize in self.bucketize.items():
            parts[i], unbucketize[i] = bucketize(parts[i], self.groups[i].block_sizes, self.world, not self.spec.pooled)
        local = [Distributed(p, b, [], [], u) for p, b, u in zip(parts, before, unbucketize)]
        kjts = [[parts[i] for i in b.groups] for b in self.buckets]
        counts = [[self._send_counts(self.groups[i], parts[i]) for i in b.groups] for b in self.buckets]
        received = [b.exchange_splits(k, c) for b, k, c in zip(self.buckets, kjts, counts)]
        batch_sizes = {row[-1] for bucket in received for table in bucket for row in table}
        if len(batch_sizes) > 1 or features.stride() == 0:
            return None
        recv = [[([row[0] for row in table], [row[1] for row in table]) for table in bucket] for bucket in received]
        waits = [b.issue_payload(k, c, r) for b, k, c, r in zip(self.buckets, kjts, counts, recv)]
        kept = {i: group.start(before[i]) for i, group in self.kept.items()}

        def complete() -> list[Distributed]:
            with torch.no_grad(), self.clock.input():
                out = list(local)
                for bucket, bucket_kjts, sent, got, wait in zip(self.buckets, kjts, counts, recv, waits):
                    for i, kjt, (_, ids_out), (_, ids_in), (lengths, values, weights) in zip(
                            bucket.groups, bucket_kjts, sent, got, wait()):
                        g = self.groups[i]
                        out[i] = Distributed(self.recat[i](g.local_keys, g.recat, lengths, values, weights,
                                                           kjt.stride(), self.world),
                                             before[i], ids_out, ids_in, unbucketize[i])
                for i, wait in kept.items():
                    kjt, context = wait()
                    out[i] = Distributed(kjt, before[i], [], [], None, context)
                return out

        return complete

    def _send_counts(self, g: GroupRuntime, kjt: Any) -> Counts:
        """Lengths and values each destination rank gets from this rank's (key-major) KJT."""
        per_rank = g.spec.features_per_rank if g.spec.sharding_type not in ROW_SHARDED else \
            [len(g.spec.features)] * self.world
        per_key = kjt.length_per_key()
        lengths, values, start = [], [], 0
        for n in per_rank:
            lengths.append(n * kjt.stride())
            values.append(sum(per_key[start:start + n]))
            start += n
        return lengths, values
