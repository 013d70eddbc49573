"""The layout of a (possibly merged) output all-to-all: how every rank's pooled blocks, or an
EmbeddingCollection's rows, are packed for the exchange and unpacked after it, in both directions.
The output all-to-alls (``runtime.collectives``) take either layout.

Under TorchRec's quantized communication (``codecs``: the sharded module's
``QuantizedCommCodecs`` for that exchange) what is packed is encoded with TorchRec's own codec
before it leaves and decoded as it arrives, before it is unpacked (and before the gradient's
division by world size), as TorchRec's comm ops do. FP16 and BF16 act value by value; INT8
quantizes rows of 32 values of the buffer, which is TorchRec's own as long as an exchange is not
merged with another (the lift and the aggregation pass see to it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_sparselift.runtime.buffers import Buffer, Buffers


@dataclass
class ExchangeBuffers:
    """An output bucket's buffers, kept from step to step (see :mod:`~lightning_sparselift.runtime.buffers`):
    what its all-to-all receives, what the gradient all-to-all receives, and the gradient's send
    buffer where the layout packs one."""

    received: Buffer
    grad_received: Buffer
    grad_send: Buffer

    @classmethod
    def of(cls, buffers: Buffers, groups: list[int]) -> "ExchangeBuffers":
        """The buffers of the bucket of ``groups``."""
        key = tuple(groups)
        return cls(*(buffers.at((role, key)) for role in ("received", "grad_received", "grad_send")))


@dataclass
class Wire:
    """A layout's quantized exchange (TorchRec's ``QuantizedCommCodecs``; None: float32 both
    ways). As TorchRec's comm ops, each encode makes the codec's context, which the sizes of that
    exchange and the decode of what it receives then use (``contexts``, by direction: the layout
    of one step encodes and decodes each direction once)."""

    codecs: Optional[Any] = None
    contexts: dict[bool, Any] = field(default_factory=dict)

    def _codec(self, forward: bool) -> Any:
        return self.codecs.forward if forward else self.codecs.backward

    def encode(self, send: Tensor, forward: bool) -> Tensor:
        if self.codecs is None:
            return send
        codec = self._codec(forward)
        ctx = self.contexts[forward] = codec.create_context()
        return codec.encode(send, ctx)

    def pack(self, send: Tensor, recv_sizes: list[int], send_sizes: list[int], forward: bool
             ) -> tuple[Tensor, list[int], list[int]]:
        """An all-to-all's arguments on the wire: ``send`` encoded, the split sizes in its elements."""
        if self.codecs is None:
            return send, recv_sizes, send_sizes
        send = self.encode(send, forward)
        codec, ctx = self._codec(forward), self.contexts[forward]
        return send, [codec.calc_quantized_size(n, ctx) for n in recv_sizes], \
            [codec.calc_quantized_size(n, ctx) for n in send_sizes]

    def decode(self, received: Tensor, forward: bool) -> Tensor:
        if self.codecs is None:
            return received
        return self._codec(forward).decode(received, self.contexts[forward])

    def for_step(self) -> "Wire":
        """This wire with contexts of its own (a layout's, for one step's exchanges)."""
        return Wire(self.codecs)


@dataclass
class PooledLayout:
    """The layout of one (possibly merged) table/column-wise output all-to-all: every rank's
    pooled [world*B, D_local] blocks go back to the ranks that own the samples (per destination:
    its B rows of every group, group after group); the gradients take the reverse path and are
    divided by world size, as TorchRec's backward all-to-all does (``divide_grads``; the
    reference DLRM's does not). ``raw``: what arrived is handed on as it is (the consumer layout
    unpacks it) and the gradient comes laid out as the send buffer."""

    dims: list[list[int]]  # per group: output columns of each rank
    batch_size: int
    group: Any
    column_index: list[Optional[Tensor]]  # per group: column permutation after the exchange
    rank: int
    buffers: ExchangeBuffers
    raw: bool = False
    divide_grads: bool = True
    wire: Wire = field(default_factory=Wire)

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
        return self.wire.pack(send, recv_sizes, [b * sum(d[self.rank] for d in self.dims)] * self.world, True)

    def unpack_outputs(self, received: Tensor) -> tuple[Tensor, ...]:
        received = self.wire.decode(received, True)
        if self.raw:
            return (received,)
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
        send_sizes = [b * sum(d[s] for d in self.dims) for s in range(self.world)]
        local = sum(b * d[self.rank] for d in self.dims)
        if self.raw:
            return self.wire.pack(grads[0].contiguous(), [local] * self.world, send_sizes, False)
        by_source = []
        for grad, index, d in zip(grads, self.column_index, self.dims):
            if index is not None:
                unpermuted = torch.empty_like(grad)
                unpermuted[:, index] = grad
                grad = unpermuted
            by_source.append(grad.split(d, dim=1))
        send = self.buffers.grad_send.empty((sum(send_sizes),), grads[0].dtype, grads[0].device)
        offset = 0
        for s in range(self.world):  # each source rank's columns, copied once into their place
            for g, d in enumerate(self.dims):
                send[offset:offset + b * d[s]].view(b, d[s]).copy_(by_source[g][s])
                offset += b * d[s]
        return self.wire.pack(send, [local] * self.world, send_sizes, False)

    def unpack_grads(self, received: Tensor) -> list[Tensor]:
        received = self.wire.decode(received, False)
        b, world = self.batch_size, self.world
        if len(self.dims) == 1:  # one group: the sources' blocks are already its rows, in order
            grads = [received.view(world * b, self.dims[0][self.rank])]
        else:
            local_sizes = [b * d[self.rank] for d in self.dims]
            per_group: list[list[Tensor]] = [[] for _ in self.dims]
            for chunk in received.split([sum(local_sizes)] * world):
                for g, piece in enumerate(chunk.split(local_sizes)):
                    per_group[g].append(piece.view(b, self.dims[g][self.rank]))
            grads = [torch.cat(p) for p in per_group]
        return [g.div_(world) for g in grads] if self.divide_grads else grads


@dataclass
class SequenceLayout:
    """The layout of one (possibly merged) output all-to-all of an EmbeddingCollection's rows.
    Each rank looked up a row per id it received, in the order the input distribution leaves them
    ([key][src][sample]); TorchRec's permute puts them in [src][key][sample] order so that each
    source's rows go back to it in the order it sent the ids (per destination, group after group).
    The gradients take the reverse path and are divided by world size, as TorchRec's backward
    all-to-all does; rows are only copied, never summed."""

    dims: list[list[int]]  # per group: the width of each rank's rows
    lengths: list[Tensor]  # per group: the lengths of the ids this rank received, [key][src][sample]
    recat: list[Optional[Tensor]]  # per group: [key][src] -> [src][key] (None: this rank holds none of its keys)
    back: list[Optional[Tensor]]  # per group: the inverse permutation, for the gradients
    sent: list[list[int]]  # per group: ids this rank sent to each rank (the rows it gets back)
    received: list[list[int]]  # per group: ids each rank sent here (the rows this rank returns)
    group: Any
    rank: int
    buffers: ExchangeBuffers
    wire: Wire = field(default_factory=Wire)

    def __post_init__(self) -> None:
        self.permuted_lengths: list[Optional[Tensor]] = [None] * len(self.dims)

    @property
    def world(self) -> int:
        return len(self.dims[0])

    def _per_destination(self, flats: list[Tensor], counts: list[list[int]], dims: list[int]) -> Tensor:
        """Each group's flat rows (in destination order) interleaved: per destination, group after group."""
        if len(flats) == 1:
            return flats[0]
        pieces = [flat.split([n * d for n in c]) for flat, c, d in zip(flats, counts, dims)]
        return torch.cat([p[dst] for dst in range(self.world) for p in pieces])

    def _per_group(self, received: Tensor, counts: list[list[int]], dims: list[list[int]]) -> list[Tensor]:
        """What arrived (per source, group after group) as each group's flat rows in source order."""
        if len(self.dims) == 1:
            return [received]
        chunks = received.split([sum(c[s] * d[s] for c, d in zip(counts, dims)) for s in range(self.world)])
        per_group: list[list[Tensor]] = [[] for _ in self.dims]
        for s, chunk in enumerate(chunks):
            for g, piece in enumerate(chunk.split([c[s] * d[s] for c, d in zip(counts, dims)])):
                per_group[g].append(piece)
        return [torch.cat(p) for p in per_group]

    def send_outputs(self, locals_: tuple[Tensor, ...]) -> tuple[Tensor, list[int], list[int]]:
        flats = []
        for g, rows in enumerate(locals_):
            flat = rows.reshape(-1)
            if self.recat[g] is not None:
                lengths = self.lengths[g] * self.dims[g][self.rank]
                self.permuted_lengths[g], flat, _ = torch.ops.fbgemm.permute_2D_sparse_data(
                    self.recat[g], lengths.view(self.recat[g].numel(), -1), flat, None, flat.numel())
            flats.append(flat)
        own = [d[self.rank] for d in self.dims]
        send = self._per_destination(flats, self.received, own)
        send_sizes = [sum(c[dst] * d for c, d in zip(self.received, own)) for dst in range(self.world)]
        recv_sizes = [sum(c[s] * d[s] for c, d in zip(self.sent, self.dims)) for s in range(self.world)]
        return self.wire.pack(send, recv_sizes, send_sizes, True)

    def unpack_outputs(self, received: Tensor) -> tuple[Tensor, ...]:
        flats = self._per_group(self.wire.decode(received, True), self.sent, self.dims)
        return tuple(flat.view(-1, d[0]) for flat, d in zip(flats, self.dims))

    def send_grads(self, grads: tuple[Tensor, ...]) -> tuple[Tensor, list[int], list[int]]:
        widths = [d[0] for d in self.dims]
        send = self._per_destination([g.contiguous().view(-1) for g in grads], self.sent, widths)
        own = [d[self.rank] for d in self.dims]
        send_sizes = [sum(c[dst] * w for c, w in zip(self.sent, widths)) for dst in range(self.world)]
        recv_sizes = [sum(c[s] * d for c, d in zip(self.received, own)) for s in range(self.world)]
        return self.wire.pack(send, recv_sizes, send_sizes, False)

    def unpack_grads(self, received: Tensor) -> list[Tensor]:
        own = [[d[self.rank]] * self.world for d in self.dims]
        out = []
        for g, flat in enumerate(self._per_group(self.wire.decode(received, False), self.received, own)):
            if self.back[g] is not None:
                _, flat, _ = torch.ops.fbgemm.permute_2D_sparse_data(
                    self.back[g], self.permuted_lengths[g], flat, None, flat.numel())
            out.append(flat.view(-1, self.dims[g][self.rank]).div_(self.world))
        return out
