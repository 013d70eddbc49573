"""The layout of a (possibly merged) output all-to-all: how every rank's pooled blocks, or an
EmbeddingCollection's rows, are packed for the exchange and unpacked after it, in both directions.
The output all-to-alls (``runtime.collectives``) take either layout.

Under the communication-precision pass (``Wire.cast``, ``numerics="fast"``) the float32 values
travel as BF16: cast in the copy that packs them where a layout makes one, converted back in the
copy that unpacks them (see :class:`Wire`).

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
    buffer where the layout packs one; under a cast (:class:`Wire`) also the forward's send buffer
    and what each direction's values are unpacked into."""

    received: Buffer
    grad_received: Buffer
    grad_send: Buffer
    send: Buffer
    unpacked: Buffer
    grad_unpacked: Buffer

    @classmethod
    def of(cls, buffers: Buffers, groups: list[int]) -> "ExchangeBuffers":
        """The buffers of the bucket of ``groups``."""
        key = tuple(groups)
        return cls(*(buffers.at((role, key)) for role in ("received", "grad_received", "grad_send", "send",
                                                          "unpacked", "grad_unpacked")))


@dataclass
class Wire:
    """How a layout's values travel: float32 (nothing set), TorchRec's quantized communication
    (``codecs``: its ``QuantizedCommCodecs``), or the communication-precision pass's cast
    (``cast``: the dtype on the wire per direction, True: forward). As TorchRec's comm ops, each
    encode makes the codec's context, which the sizes of that exchange and the decode of what it
    receives then use (``contexts``, by direction: the layout of one step encodes and decodes each
    direction once); a cast's context is the dtype it cast from, which its decode restores.

    A cast is fused into the layouts' copies: a layout that copies into its send buffer writes it
    in :meth:`packing` dtype, one that copies out of what arrived converts as it copies (to
    :meth:`values`); only where a layout copies nothing does it make the one pass of the cast
    (:func:`cast`), into memory kept from step to step."""

    codecs: Optional[Any] = None
    cast: dict[bool, torch.dtype] = field(default_factory=dict)
    contexts: dict[bool, Any] = field(default_factory=dict)

    def _codec(self, forward: bool) -> Any:
        return self.codecs.forward if forward else self.codecs.backward

    def packing(self, values: Tensor, forward: bool) -> torch.dtype:
        """The dtype a layout's packing copy of ``values`` writes (float32 values only are cast)."""
        return self.cast.get(forward, values.dtype) if values.dtype == torch.float32 else values.dtype

    def encode(self, send: Tensor, forward: bool, values: Optional[torch.dtype] = None) -> Tensor:
        """``send`` as it goes on the wire (``values``: the dtype it holds values of, when a
        layout's packing already cast it)."""
        if self.codecs is None:
            if forward in self.cast:
                self.contexts[forward] = values or send.dtype
            return send.to(self.packing(send, forward))  # (a no-op after a layout's packing copy cast it)
        codec = self._codec(forward)
        ctx = self.contexts[forward] = codec.create_context()
        return codec.encode(send, ctx)

    def pack(self, send: Tensor, recv_sizes: list[int], send_sizes: list[int], forward: bool,
             values: Optional[torch.dtype] = None) -> tuple[Tensor, list[int], list[int]]:
        """An all-to-all's arguments on the wire: ``send`` encoded, the split sizes in its elements."""
        send = self.encode(send, forward, values)
        if self.codecs is None:
            return send, recv_sizes, send_sizes
        codec, ctx = self._codec(forward), self.contexts[forward]
        return send, [codec.calc_quantized_size(n, ctx) for n in recv_sizes], \
            [codec.calc_quantized_size(n, ctx) for n in send_sizes]

    def decode(self, received: Tensor, forward: bool) -> Tensor:
        """What arrived, decoded by TorchRec's codec; a cast's values are left on the wire's dtype
        for the layout's unpacking copy (see :meth:`values`)."""
        if self.codecs is None:
            return received
        return self._codec(forward).decode(received, self.contexts[forward])

    def values(self, forward: bool, received: Tensor) -> torch.dtype:
        """The dtype the values of ``received`` (decoded) are unpacked to."""
        return self.contexts.get(forward, received.dtype) if self.cast else received.dtype

    def for_step(self) -> "Wire":
        """This wire with contexts of its own (a layout's, for one step's exchanges)."""
        return Wire(self.codecs, self.cast)


def cast(tensor: Tensor, dtype: torch.dtype, buffer: Buffer) -> Tensor:
    """``tensor`` as ``dtype``: itself, or converted into ``buffer``'s memory (a fresh
    multi-megabyte tensor every step costs page faults: see :mod:`~lightning_sparselift.runtime.buffers`)."""
    if tensor.dtype == dtype:
        return tensor
    return buffer.empty(tuple(tensor.shape), dtype, tensor.device).copy_(tensor)


def _joined(pieces: list[Tensor], dtype: torch.dtype, buffer: Buffer, dim: int = 0) -> Tensor:
    """``torch.cat(pieces, dim)`` as ``dtype``, converted in the one copy (``torch.cat`` into an
    output of another dtype takes twice as long as ``copy_`` of each piece) into ``buffer``'s memory."""
    if all(p.dtype == dtype for p in pieces):
        return torch.cat(pieces, dim)
    shape = list(pieces[0].shape)
    shape[dim] = sum(p.shape[dim] for p in pieces)
    out = buffer.empty(tuple(shape), dtype, pieces[0].device)
    for piece, part in zip(pieces, out.split([p.shape[dim] for p in pieces], dim)):
        part.copy_(piece)
    return out


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
    # raw, and the consumer layout converts what arrived from the wire's dtype as it copies it (and
    # its gradient to it): both are handed on as they travel (see consumer_layout.fused_wire)
    raw_wire: bool = False

    def __post_init__(self) -> None:
        self.values: Optional[torch.dtype] = None  # what the lookups output (send_outputs)

    @property
    def world(self) -> int:
        return len(self.dims[0])

    def send_outputs(self, locals_: tuple[Tensor, ...]) -> tuple[Tensor, list[int], list[int]]:
        b, self.values = self.batch_size, locals_[0].dtype
        dtype, into = self.wire.packing(locals_[0], True), self.buffers.send
        if len(locals_) == 1 and locals_[0].is_contiguous():
            send = cast(locals_[0].view(-1), dtype, into)  # one group: its destination blocks are already consecutive rows
        else:
            send = _joined([local[r * b:(r + 1) * b].reshape(-1) for r in range(self.world) for local in locals_],
                           dtype, into)
        recv_sizes = [b * sum(d[s] for d in self.dims) for s in range(self.world)]
        return self.wire.pack(send, recv_sizes, [b * sum(d[self.rank] for d in self.dims)] * self.world, True,
                              locals_[0].dtype)

    def unpack_outputs(self, received: Tensor) -> tuple[Tensor, ...]:
        received = self.wire.decode(received, True)
        values, b = self.wire.values(True, received), self.batch_size
        if self.raw:
            return (received if self.raw_wire else cast(received, values, self.buffers.unpacked),)
        per_group: list[list[Tensor]] = [[] for _ in self.dims]
        for s, chunk in enumerate(received.split([b * sum(d[s] for d in self.dims) for s in range(self.world)])):
            for g, piece in enumerate(chunk.split([b * d[s] for d in self.dims])):
                per_group[g].append(piece.view(b, self.dims[g][s]))
        outs = []
        for pieces, index in zip(per_group, self.column_index):
            out = _joined(pieces, values, self.buffers.unpacked, dim=1)
            outs.append(out if index is None else out.index_select(1, index))
        return tuple(outs)

    def send_grads(self, grads: tuple[Tensor, ...]) -> tuple[Tensor, list[int], list[int]]:
        b = self.batch_size
        send_sizes = [b * sum(d[s] for d in self.dims) for s in range(self.world)]
        local = sum(b * d[self.rank] for d in self.dims)
        if self.raw:
            send = cast(grads[0].contiguous(), self.wire.packing(grads[0], False), self.buffers.grad_send)
            return self.wire.pack(send, [local] * self.world, send_sizes, False, self.values)
        by_source = []
        for grad, index, d in zip(grads, self.column_index, self.dims):
            if index is not None:
                unpermuted = torch.empty_like(grad)
                unpermuted[:, index] = grad
                grad = unpermuted
            by_source.append(grad.split(d, dim=1))
        send = self.buffers.grad_send.empty((sum(send_sizes),), self.wire.packing(grads[0], False), grads[0].device)
        offset = 0
        for s in range(self.world):  # each source rank's columns, copied once into their place
            for g, d in enumerate(self.dims):
                send[offset:offset + b * d[s]].view(b, d[s]).copy_(by_source[g][s])
                offset += b * d[s]
        return self.wire.pack(send, [local] * self.world, send_sizes, False, grads[0].dtype)

    def unpack_grads(self, received: Tensor) -> list[Tensor]:
        received = self.wire.decode(received, False)
        b, world = self.batch_size, self.world
        values, into = self.wire.values(False, received), self.buffers.grad_unpacked
        if len(self.dims) == 1:  # one group: the sources' blocks are already its rows, in order
            grads = [cast(received, values, into).view(world * b, self.dims[0][self.rank])]
        else:
            local_sizes = [b * d[self.rank] for d in self.dims]
            per_group: list[list[Tensor]] = [[] for _ in self.dims]
            for chunk in received.split([sum(local_sizes)] * world):
                for g, piece in enumerate(chunk.split(local_sizes)):
                    per_group[g].append(piece.view(b, self.dims[g][self.rank]))
            grads = [_joined(p, values, into) for p in per_group]
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

    def _per_destination(self, flats: list[Tensor], counts: list[list[int]], dims: list[int], forward: bool
                         ) -> Tensor:
        """Each group's flat rows (in destination order) interleaved: per destination, group after
        group, in the wire's packing dtype."""
        dtype, into = self.wire.packing(flats[0], forward), self.buffers.send if forward else self.buffers.grad_send
        if len(flats) == 1:
            return cast(flats[0], dtype, into)
        pieces = [flat.split([n * d for n in c]) for flat, c, d in zip(flats, counts, dims)]
        return _joined([p[dst] for dst in range(self.world) for p in pieces], dtype, into)

    def _per_group(self, received: Tensor, counts: list[list[int]], dims: list[list[int]], forward: bool
                   ) -> list[Tensor]:
        """What arrived (per source, group after group, decoded) as each group's flat rows in source
        order, in its values' dtype."""
        values = self.wire.values(forward, received)
        into = self.buffers.unpacked if forward else self.buffers.grad_unpacked
        if len(self.dims) == 1:
            return [cast(received, values, into)]
        chunks = received.split([sum(c[s] * d[s] for c, d in zip(counts, dims)) for s in range(self.world)])
        per_group: list[list[Tensor]] = [[] for _ in self.dims]
        for s, chunk in enumerate(chunks):
            for g, piece in enumerate(chunk.split([c[s] * d[s] for c, d in zip(counts, dims)])):
                per_group[g].append(piece)
        return [_joined(p, values, into) for p in per_group]

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
        send = self._per_destination(flats, self.received, own, True)
        send_sizes = [sum(c[dst] * d for c, d in zip(self.received, own)) for dst in range(self.world)]
        recv_sizes = [sum(c[s] * d[s] for c, d in zip(self.sent, self.dims)) for s in range(self.world)]
        return self.wire.pack(send, recv_sizes, send_sizes, True, flats[0].dtype)

    def unpack_outputs(self, received: Tensor) -> tuple[Tensor, ...]:
        flats = self._per_group(self.wire.decode(received, True), self.sent, self.dims, True)
        return tuple(flat.view(-1, d[0]) for flat, d in zip(flats, self.dims))

    def send_grads(self, grads: tuple[Tensor, ...]) -> tuple[Tensor, list[int], list[int]]:
        widths = [d[0] for d in self.dims]
        send = self._per_destination([g.contiguous().view(-1) for g in grads], self.sent, widths, False)
        own = [d[self.rank] for d in self.dims]
        send_sizes = [sum(c[dst] * w for c, w in zip(self.sent, widths)) for dst in range(self.world)]
        recv_sizes = [sum(c[s] * d for c, d in zip(self.received, own)) for s in range(self.world)]
        return self.wire.pack(send, recv_sizes, send_sizes, False, grads[0].dtype)

    def unpack_grads(self, received: Tensor) -> list[Tensor]:
        own = [[d[self.rank]] * self.world for d in self.dims]
        out = []
        for g, flat in enumerate(self._per_group(self.wire.decode(received, False), self.received, own, False)):
            if self.back[g] is not None:
                _, flat, _ = torch.ops.fbgemm.permute_2D_sparse_data(
                    self.back[g], self.permuted_lengths[g], flat, None, flat.numel())
            out.append(flat.view(-1, self.dims[g][self.rank]).div_(self.world))
        return out
