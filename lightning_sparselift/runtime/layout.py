"""The layout of a (possibly merged) pooled-output all-to-all: how every rank's pooled blocks are
packed for the exchange and unpacked after it, in both directions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor


@dataclass
class PooledLayout:
    """The layout of one (possibly merged) table/column-wise output all-to-all: every rank's
    pooled [world*B, D_local] blocks go back to the ranks that own the samples (per destination:
    its B rows of every group, group after group); the gradients take the reverse path and are
    divided by world size, as TorchRec's backward all-to-all does."""

    dims: list[list[int]]  # per group: output columns of each rank
    batch_size: int
    group: Any
    column_index: list[Optional[Tensor]]  # per group: column permutation after the exchange
    rank: int

    @property
    def world(self) -> int:
        return len(self.dims[0])

    def send_outputs(self, locals_: tuple[Tensor, ...]) -> tuple[Tensor, list[int], list[int]]:
        b = self.batch_size
        if len(locals_) == 1 and locals_[0].is_contiguous():
            send = locals_[0].view(-1)  # one group: its destination blocks are already consecutive rows
        else:
            send = torch.cat([local[r * b:(r + 1) * b].reshape(-1) for r in range(self.world) for local in locals_])
        recv_sizes = [b * sum(d[s] for d in self.dims) for s in range(self.world)]
        return send, recv_sizes, [b * sum(d[self.rank] for d in self.dims)] * self.world

    def unpack_outputs(self, received: Tensor) -> tuple[Tensor, ...]:
        b = self.batch_size
        per_group: list[list[Tensor]] = [[] for _ in self.dims]
        for s, chunk in enumerate(received.split([b * sum(d[s] for d in self.dims) for s in range(self.world)])):
            for g, piece in enumerate(chunk.split([b * d[s] for d in self.dims])):
                per_group[g].append(piece.view(b, self.dims[g][s]))
        outs = []
        for pieces, index in zip(per_group, self.column_index):
            out = torch.cat(pieces, dim=1)
            outs.append(out if index is None else out.index_select(1, index))
        return tuple(outs)

    def send_grads(self, grads: tuple[Tensor, ...]) -> tuple[Tensor, list[int], list[int]]:
        b = self.batch_size
        by_source = []
        for grad, index, d in zip(grads, self.column_index, self.dims):
            if index is not None:
                unpermuted = torch.empty_like(grad)
                unpermuted[:, index] = grad
                grad = unpermuted
            by_source.append(grad.split(d, dim=1))
        send_sizes = [b * sum(d[s] for d in self.dims) for s in range(self.world)]
        send = grads[0].new_empty(sum(send_sizes))
        offset = 0
        for s in range(self.world):  # each source rank's columns, copied once into their place
            for g, d in enumerate(self.dims):
                send[offset:offset + b * d[s]].view(b, d[s]).copy_(by_source[g][s])
                offset += b * d[s]
        local = sum(b * d[self.rank] for d in self.dims)
        return send, [local] * self.world, send_sizes

    def unpack_grads(self, received: Tensor) -> list[Tensor]:
        b, world = self.batch_size, self.world
        if len(self.dims) == 1:  # one group: the sources' blocks are already its rows, in order
            return [received.view(world * b, self.dims[0][self.rank]).div_(world)]
        local_sizes = [b * d[self.rank] for d in self.dims]
        per_group: list[list[Tensor]] = [[] for _ in self.dims]
        for chunk in received.split([sum(local_sizes)] * world):
            for g, piece in enumerate(chunk.split(local_sizes)):
                per_group[g].append(piece.view(b, self.dims[g][self.rank]))
        return [torch.cat(p).div_(world) for p in per_group]
