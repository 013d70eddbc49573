"""Pipelined buckets: a pooled group's lookups run bucket after bucket, and each bucket's output
all-to-all goes out on a process group of its own as soon as its lookups are done, so it is in
flight while the next bucket computes (collectives on one process group run one after the other;
on separate ones they run side by side). Backward issues every bucket's gradient all-to-all, then
runs each bucket's fused update as soon as its gradient has arrived, while the later buckets'
are still in flight.

What the buckets' all-to-alls receive is put together into the buffer the group's one all-to-all
would have received (per source rank, its columns in its order), and the gradient each rank
sends is taken apart from the buffer the one all-to-all would have sent: copies only, so the
module's output (and the consumer layout reading it), the tables and the optimizer state are
bit-identical to one all-to-all's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparselift.ir.graph import ShardingGroup
from lightning_sparselift.runtime.buffers import Buffer, Buffers
from lightning_sparselift.runtime.codegen import GeneratedLookup, Unsupported
from lightning_sparselift.runtime.codegen.lookup import check_result
from lightning_sparselift.runtime.layout import PooledLayout


Runs = list[tuple[int, int]]  # column ranges (first column, width), in order


def column_runs(columns: list[int]) -> Runs:
    """Ascending ``columns`` as ranges: each is copied as one strided block (a gather of single
    columns costs several times the bandwidth of the columns it moves)."""
    runs: Runs = []
    for c in columns:
        if runs and runs[-1][0] + runs[-1][1] == c:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((c, 1))
    return runs


def gather(source: Tensor, runs: Runs, into: Tensor) -> None:
    """``source``'s columns ``runs``, in order, into ``into`` ([rows, width of the runs])."""
    at = 0
    for first, width in runs:
        into[:, at:at + width].copy_(source[:, first:first + width])
        at += width


def scatter(piece: Tensor, runs: Runs, into: Tensor) -> None:
    """``piece``'s columns, in order, into ``into``'s columns ``runs``."""
    at = 0
    for first, width in runs:
        into[:, first:first + width].copy_(piece[:, at:at + width])
        at += width


@dataclass
class _KernelPart:
    """One table-batched kernel's share of a bucket: its own bucket index and the columns of its
    output that hold the bucket's tables."""

    kernel: int
    bucket: int
    runs: Runs

    @property
    def width(self) -> int:
        return sum(w for _, w in self.runs)


class Pipeline:
    """Group ``group``'s lookup (``lookup``: its generated kernels, built for ``buckets``) and
    output all-to-all, pipelined bucket by bucket on ``process_groups`` (one per bucket), its
    per-bucket copies in ``buffers``. :class:`Unsupported` when this rank cannot run it."""

    def __init__(self, lookup: GeneratedLookup, group: ShardingGroup, buckets: list[list[str]],
                 process_groups: list[Any], rank: int, buffers: Buffers) -> None:
        if not lookup.kernels:
            raise Unsupported(f"g{group.index}: rank {rank} holds none of the group's tables (TorchRec's lookup makes "
                              f"its empty output, which has no fused update to pipeline)")
        if not group.output_blocks or [(b.table, b.width) for b in group.output_blocks[rank]] != lookup.blocks:
            raise Unsupported(f"g{group.index}: the lookup's output columns {lookup.blocks} are not the ones the graph "
                              f"recorded for rank {rank} ({group.output_blocks[rank] if group.output_blocks else []})")
        self.lookup, self.process_groups, self.rank = lookup, process_groups, rank
        self.group, self.buffers = group.index, buffers
        columns = group.bucket_columns(buckets)
        self.runs = [[column_runs(c) for c in per_rank] for per_rank in columns]  # [bucket][rank]
        self.widths = [[len(c) for c in per_rank] for per_rank in columns]
        # each kernel's columns: where its output starts in the group's
        starts, at = [], 0
        for k in lookup.kernels:
            starts.append(at)
            at += k.spec.total_dim
        self.parts: list[list[_KernelPart]] = []
        for b, per_rank in enumerate(columns):
            mine = per_rank[rank]
            parts = []
            for j, (k, start) in enumerate(zip(lookup.kernels, starts)):
                own = [c - start for c in mine if start <= c < start + k.spec.total_dim]
                if own:
                    parts.append(_KernelPart(j, lookup.kernel_buckets[j][b], column_runs(own)))
            self.parts.append(parts)

    def buffer(self, role: str, index: int) -> Buffer:
        """The memory of ``role``'s ``index``-th tensor (a bucket's or a kernel's), kept from step to
        step like the one all-to-all's buffers (see :mod:`~lightning_sparselift.runtime.buffers`)."""
        return self.buffers.at(("pipeline", self.group, role, index))

    def issue(self, kjt: Any, layout: PooledLayout, box: dict) -> Tensor:
        """Run the lookups bucket by bucket, each bucket's all-to-all issued after its lookups
        (left in flight in ``box``); the token :meth:`wait` takes."""
        kernels = self.lookup.kernels
        inputs = []
        for k, f in zip(kernels, self.lookup.features(kjt)):
            weights = f.weights_or_none() if k.spec.weighted else None
            k.check_inputs(weights)
            inputs.append((f.values(), f.offsets(), weights))
        if torch.is_grad_enabled() and any(k.tbe.training for k in kernels):
            for k in kernels:
                k.count_step()
        return _IssueBuckets.apply(self, layout, box, kjt.stride(), inputs,
                                   *[k.tbe.placeholder_autograd_tensor for k in kernels])

    @staticmethod
    def wait(token: Tensor, layout: PooledLayout, box: dict) -> tuple[Tensor, ...]:
        """The group's output once every bucket's all-to-all arrived, as ``layout``'s one
        all-to-all unpacks it."""
        return _WaitBuckets.apply(token, layout, box)

    @staticmethod
    def drain(box: dict) -> None:
        """Complete the buckets' all-to-alls in flight without using them."""
        for work in box.pop("works"):
            work.wait()


class _IssueBuckets(torch.autograd.Function):
    """Forward: each bucket's lookups, then its all-to-all issued. Backward: each bucket's
    gradient awaited (:class:`_WaitBuckets` issued them), then its fused update."""

    @staticmethod
    def forward(ctx: Any, pipeline: Pipeline, layout: PooledLayout, box: dict, batch: int, inputs: list,
                *_placeholders: Tensor) -> Tensor:
        kernels, b, world, rank = pipeline.lookup.kernels, layout.batch_size, layout.world, pipeline.rank
        outs = [k.output.empty((batch, k.spec.total_dim), torch.float32, inputs[0][0].device) for k in kernels]
        box["works"], box["received"], box["sent"] = [], [], []
        for bucket, parts in enumerate(pipeline.parts):
            for p in parts:
                ids, offsets, weights = inputs[p.kernel]
                kernel = kernels[p.kernel]
                check_result(kernel, ids, kernel.forward(batch, ids, offsets, weights, outs[p.kernel], p.bucket))
            widths = pipeline.widths[bucket]
            send = pipeline.buffer("send", bucket).empty((batch, widths[rank]), torch.float32, outs[0].device)
            at = 0
            for p in parts:
                gather(outs[p.kernel], p.runs, send[:, at:at + p.width])
                at += p.width
            into = pipeline.buffer("received", bucket).empty((b * sum(widths),), torch.float32, outs[0].device)
            box["works"].append(dist.all_to_all_single(into, send.reshape(-1), [b * w for w in widths],
                                                       [b * widths[rank]] * world,
                                                       group=pipeline.process_groups[bucket], async_op=True))
            box["received"].append(into)
            box["sent"].append(send)  # (held until its all-to-all is done)
        ctx.pipeline, ctx.layout, ctx.box, ctx.batch, ctx.inputs = pipeline, layout, box, batch, inputs
        box["pipeline"] = pipeline
        return outs[0].new_empty(0)

    @staticmethod
    def backward(ctx: Any, _token: Tensor) -> tuple[Optional[Tensor], ...]:
        pipeline, layout, batch, box = ctx.pipeline, ctx.layout, ctx.batch, ctx.box
        kernels, b, world, rank = pipeline.lookup.kernels, layout.batch_size, layout.world, pipeline.rank
        works, received = box.pop("grad_works"), box.pop("grad_received")
        box.pop("grad_sent")
        grads = [pipeline.buffer("grad", j).empty((batch, k.spec.total_dim), torch.float32, received[0].device)
                 for j, k in enumerate(kernels)]
        for bucket, (work, parts) in enumerate(zip(works, pipeline.parts)):
            work.wait()  # the later buckets' gradients are still on their way
            piece = received[bucket].view(world * b, pipeline.widths[bucket][rank]).div_(world)
            at = 0
            for p in parts:
                scatter(piece[:, at:at + p.width], p.runs, grads[p.kernel])
                at += p.width
                ids, offsets, weights = ctx.inputs[p.kernel]
                kernel = kernels[p.kernel]
                check_result(kernel, ids, kernel.backward(batch, ids, offsets, weights, grads[p.kernel], p.bucket))
        return (None, None, None, None, None, *[None] * len(kernels))


class _WaitBuckets(torch.autograd.Function):
    """Forward: every bucket's all-to-all awaited, what arrived put together. Backward: the
    gradient taken apart per bucket and every bucket's all-to-all issued."""

    @staticmethod
    def forward(ctx: Any, token: Tensor, layout: PooledLayout, box: dict) -> tuple[Tensor, ...]:
        pipeline = box.pop("pipeline")
        for work in box.pop("works"):
            work.wait()
        box.pop("sent")
        b, dims = layout.batch_size, layout.dims[0]
        full = layout.buffers.received.empty((b * sum(dims),), torch.float32, token.device)
        blocks = [block.view(b, d) for block, d in zip(full.split([b * d for d in dims]), dims)]
        for bucket, into in enumerate(box.pop("received")):
            widths = pipeline.widths[bucket]
            for source, piece in enumerate(into.split([b * w for w in widths])):
                scatter(piece.view(b, widths[source]), pipeline.runs[bucket][source], blocks[source])
        ctx.pipeline, ctx.layout, ctx.box = pipeline, layout, box
        return layout.unpack_outputs(full)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        pipeline, layout, box = ctx.pipeline, ctx.layout, ctx.box
        b, world, rank = layout.batch_size, layout.world, pipeline.rank
        send, _, send_sizes = layout.send_grads(grads)  # per owning rank its [b, D] block, as one all-to-all sends
        blocks = [block.view(b, d) for block, d in zip(send.split(send_sizes), layout.dims[0])]
        box["grad_works"], box["grad_received"], box["grad_sent"] = [], [], []
        for bucket in range(len(pipeline.parts)):
            widths = pipeline.widths[bucket]
            out = pipeline.buffer("grad_send", bucket).empty((b * sum(widths),), torch.float32, send.device)
            for s, piece in enumerate(out.split([b * w for w in widths])):
                gather(blocks[s], pipeline.runs[bucket][s], piece.view(b, widths[s]))
            into = pipeline.buffer("grad_received", bucket).empty((world * b * widths[rank],), torch.float32,
                                                                  send.device)
            box["grad_works"].append(dist.all_to_all_single(into, out, [b * widths[rank]] * world,
                                                            [b * w for w in widths],
                                                            group=pipeline.process_groups[bucket], async_op=True))
            box["grad_received"].append(into)
            box["grad_sent"].append(out)
        return send.new_empty(0), None, None
