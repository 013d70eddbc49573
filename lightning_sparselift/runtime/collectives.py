"""The output distribution's collectives as autograd Functions: each carries its backward
collective (the gradient takes the reverse path, divided by world size as TorchRec's backward
does; the layout says how a bucket's pooled blocks or rows are packed), synchronous or split into
an issue and a wait."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.runtime.buffers import Buffer
from lightning_sparselift.runtime.layout import PooledLayout, SequenceLayout, Wire

Layout = Union[PooledLayout, SequenceLayout]


def exchange(buffer: Buffer, send: Tensor, recv_sizes: list[int], send_sizes: list[int], group: Any,
             async_op: bool = False) -> tuple[Tensor, Any]:
    """One all-to-all of ``send`` into ``buffer``'s memory."""
    received = buffer.empty((sum(recv_sizes),), send.dtype, send.device)
    work = dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=group, async_op=async_op)
    return received, work


class OutputAllToAll(torch.autograd.Function):
    """The output all-to-all of a layout, synchronous in both directions."""

    @staticmethod
    def forward(ctx: Any, layout: Layout, clock: RegionClock, *locals_: Tensor) -> tuple[Tensor, ...]:
        with clock.exchange():
            sent = layout.send_outputs(locals_)
        received, _ = exchange(layout.buffers.received, *sent, layout.group)
        ctx.layout, ctx.clock = layout, clock
        with clock.exchange():
            return layout.unpack_outputs(received)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        with ctx.clock.region():
            with ctx.clock.exchange():
                sent = ctx.layout.send_grads(grads)
            received, _ = exchange(ctx.layout.buffers.grad_received, *sent, ctx.layout.group)
            with ctx.clock.exchange():
                return (None, None, *ctx.layout.unpack_grads(received))


class IssueOutputAllToAll(torch.autograd.Function):
    """Starts the output all-to-all; :class:`WaitOutputAllToAll` finishes it. In backward the
    roles swap: the wait's backward starts the gradient all-to-all and this backward waits for
    it, so whatever autograd runs in between (the backward of compute that ran between issue and
    wait in forward, e.g. the bottom MLP) overlaps the exchange. What the exchange receives stays
    in the box; the two are joined in autograd by an empty floating-point token (what arrives may
    be quantized to integers, which autograd would not connect)."""

    @staticmethod
    def forward(ctx: Any, layout: Layout, box: dict, clock: RegionClock, *locals_: Tensor) -> Tensor:
        with clock.exchange():
            sent = layout.send_outputs(locals_)
        box["received"], box["work"] = exchange(layout.buffers.received, *sent, layout.group, async_op=True)
        ctx.layout, ctx.box, ctx.clock = layout, box, clock
        return locals_[0].new_empty(0)

    @staticmethod
    def backward(ctx: Any, _unused: Tensor) -> tuple[Optional[Tensor], ...]:
        with ctx.clock.region():
            ctx.box.pop("grad_work").wait()
            with ctx.clock.exchange():
                return (None, None, None, *ctx.layout.unpack_grads(ctx.box.pop("grad_received")))


class WaitOutputAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: Tensor, layout: Layout, box: dict, clock: RegionClock) -> tuple[Tensor, ...]:
        with clock.region():
            box.pop("work").wait()
        ctx.layout, ctx.box, ctx.clock = layout, box, clock
        with clock.exchange():
            return layout.unpack_outputs(box.pop("received"))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        with ctx.clock.exchange():
            sent = ctx.layout.send_grads(grads)
        ctx.box["grad_received"], ctx.box["grad_work"] = exchange(ctx.layout.buffers.grad_received, *sent,
                                                                   ctx.layout.group, async_op=True)
        # the issue's backward reads the gradient from the box; this one only orders autograd
        return grads[0].new_empty(0), None, None, None


class PooledReduceScatter(torch.autograd.Function):
    """Row-wise output dist: partial sums of every rank's rows, reduced and scattered by sample
    block; the gradient is all-gathered and divided by world size. Under TorchRec's quantized
    communication (``wire``) the partial sums are encoded before the reduce-scatter (which then
    sums the quantized values, as TorchRec's does) and decoded after it, the gradient encoded
    before the all-gather and decoded before the division, in TorchRec's order."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any, clock: RegionClock, wire: Wire) -> Tensor:
        world = dist.get_world_size(group)
        sent = wire.encode(local, True)
        out = sent.new_empty((local.size(0) // world, local.size(1)))
        # reduce_scatter_single is what torch 2.13's deprecated reduce_scatter_tensor forwards
        # to (same backend call, gloo and NCCL): same result, no FutureWarning.
        dist.reduce_scatter_single(out, sent, group=group)
        ctx.group, ctx.world, ctx.shape, ctx.clock, ctx.wire = group, world, local.shape, clock, wire
        return wire.decode(out, True)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        with ctx.clock.region():
            sent = ctx.wire.encode(grad.contiguous(), False)
            full = sent.new_empty(ctx.shape)
            # all_gather_single: what the deprecated all_gather_into_tensor forwards to
            dist.all_gather_single(full, sent, group=ctx.group)
            return ctx.wire.decode(full, False).div_(ctx.world), None, None, None
