"""The output layout the consumer reads: a pooled module's output written once, straight from what
the output all-to-alls received, into the tensor the model concatenates it into (capture found
the concatenation: :class:`~lightning_sparselift.ir.OutputConsumer`).

TorchRec's path copies the pooled blocks twice each way: the output distribution unpacks them into
a KeyedTensor in sharding order, and the model concatenates the keys' values in its own order
(e.g. DLRM's ``SparseArch``: ``to_dict`` then ``torch.cat``); backward splits the gradient and the
output distribution packs it again. Here the output kernel allocates the concatenation's result
(``before`` + the keys' widths + ``after`` columns), writes each received block's columns into
their keys' places, and returns a KeyedTensor in the consumer's key order whose values are a view
of it. Its per-key views (``to_dict``, ``kt[key]``) know where they are, so the model's
``torch.cat`` of all of them in that order, with other operands as wide as the reserved columns,
only writes those operands into their columns and returns the whole tensor; in backward the
gradient goes from that tensor straight into the send buffers of the gradient all-to-alls. Any
other use of the values or views computes as usual (a concatenation in another order copies, as
it would anyway). Only bytes move, so results stay bit-identical.

The one difference a model could see: the concatenation's result shares memory with the
KeyedTensor's values, so changing it in place changes them (TorchRec's ``torch.cat`` copies).

Calibrated on ``layout_cpu`` (:class:`~lightning_sparselift.cost.calibration.RegionClock`): both
arms' copies on the training thread. The layout's are its kernel's (as the exchanges') and its
writing of the other operands; the reference's are the output distribution's unpacking and packing
and the model's concatenation, which :func:`timed_reference` times where the model makes it (its
forward, and its backward nodes with the split's that concatenates the keys' gradients).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.frontend.consumer import CATS, NARROWS, SPLITS, dim_argument, key_views, with_values
from lightning_sparselift.ir import LiftedModule, ModuleSchedule
from lightning_sparselift.ir.vocab import CAST_FORMATS
from lightning_sparselift.runtime.buffers import Buffer, Buffers
from lightning_sparselift.runtime.codegen.layout_kernel import LayoutKernel

def fused_wire(schedule: ModuleSchedule) -> Optional[torch.dtype]:
    """The dtype the consumer layout converts the exchanged blocks from, and their gradients to,
    as it copies them: BF16 when the communication-precision pass casts both directions of the
    pooled all-to-alls. (One direction alone is converted in the all-to-all's layout: autograd
    gives a gradient the dtype of the tensor it flows back to, so both directions share the dtype
    of what the all-to-all hands on.)"""
    return CAST_FORMATS["bf16"] if schedule.pooled_wire == "bf16" else None  # (its kernel converts BF16 only)


@dataclass
class _Source:
    """One input of the layout: an all-to-all bucket's received buffer, or a group's output."""

    group: int  # (the first group of the bucket)
    # per block of the kernel that lies in it: (its index, its offset in the tensor in rows of B elements)
    places: list[tuple[int, int]]
    units: int  # the tensor's elements, in rows of B
    grad: Buffer  # where its gradient is written (the gradient all-to-all's send buffer)
    exchanged: bool  # an all-to-all's (its values on the wire's dtype under fused_wire)


class ConsumerOutput:
    """The output kernel ``consumer`` of a module's schedule: the module's output in the
    consumer's layout (see the module docstring), written by the module's :class:`LayoutKernel`
    from where the schedule's buckets leave the blocks. Built once per installed schedule."""

    def __init__(self, spec: LiftedModule, schedule: ModuleSchedule, kernel: LayoutKernel, buffers: Buffers,
                 clock: RegionClock, on_concatenated: Callable[[], None] = lambda: None) -> None:
        """``buffers``: the module's (the layout's tensor and its gradients are kept there);
        ``clock``: times the kernel's copies as the exchanges' (what arrived unpacked, the
        gradient packed); ``on_concatenated``: called each time the model's concatenation is the
        layout's tensor."""
        self.kernel, self.clock, self.on_concatenated = kernel, clock, on_concatenated
        self.full = buffers.at(("layout",))
        self.wire = fused_wire(schedule)
        consumer = spec.consumer
        self.keys, self.dims = consumer.keys, kernel.dims
        self.before, self.after, self.width = consumer.before, consumer.after, kernel.width
        index = {(b.group, b.rank): k for k, b in enumerate(kernel.blocks)}
        a2a = {i: e.groups for e in schedule.outputs if e.op == "all_to_all_single" for i in e.groups}
        self.sources: list[_Source] = []
        for i, group in enumerate(spec.groups):
            if i not in a2a:
                self.sources.append(_Source(i, [(index[i, None], 0)] if (i, None) in index else [],
                                            sum(group.embedding_dims), buffers.at(("layout_grad", i)), False))
            elif a2a[i][0] == i:  # per source rank, group after group
                members = [spec.groups[g] for g in a2a[i]]
                places, offset = [], 0
                for rank in range(len(members[0].dim_sum_per_rank)):
                    for m in members:
                        if (m.index, rank) in index:
                            places.append((index[m.index, rank], offset))
                        offset += m.dim_sum_per_rank[rank]
                self.sources.append(_Source(i, places, offset, buffers.at(("layout_grad", i)), True))

    def __call__(self, _module: LiftedModule, outs: list[Optional[Tensor]], _features: list[Any]) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        with self.clock.exchange():
            full = _WriteLayout.apply(self, *(outs[s.group] for s in self.sources))
        values = full.narrow(1, self.before, self.width - self.before - self.after).as_subclass(ConsumerValues)
        values._layout, values._full, values._concatenated = self, full, False
        return KeyedTensor(keys=self.keys, length_per_key=self.dims, values=values, key_dim=1)

    def pointers(self, tensors: list[Tensor], batch: int) -> Any:
        """Every block's address in ``tensors`` (the sources, or their gradients)."""
        addresses = [0] * len(self.kernel.blocks)
        for tensor, source in zip(tensors, self.sources):
            for k, offset in source.places:
                addresses[k] = tensor.data_ptr() + offset * batch * tensor.element_size()
        return (ctypes.c_void_p * len(addresses))(*addresses)


class _WriteLayout(torch.autograd.Function):
    """The sources' columns into one [B, width] tensor; backward: the gradient's columns into
    tensors laid out as the sources (a received buffer's layout is the gradient all-to-all's send
    buffer)."""

    @staticmethod
    def forward(ctx: Any, layout: ConsumerOutput, *tensors: Tensor) -> Tensor:
        tensors = tuple(t.contiguous() for t in tensors)
        batch = tensors[0].numel() // layout.sources[0].units
        library, blocks = layout.kernel.built.library, layout.pointers(list(tensors), batch)
        if layout.wire is not None:  # the exchanged blocks arrive on the wire's dtype, the others float32
            full = layout.full.empty((batch, layout.width), torch.float32, tensors[0].device)
            for tensor, source in zip(tensors, layout.sources):
                if tensor.dtype != (layout.wire if source.exchanged else torch.float32):
                    raise TypeError(f"the consumer layout reads BF16 exchanges and float32 groups, got {tensor.dtype} "
                                    f"for group {source.group}")
            library.sl_layout_forward_bf16(batch, blocks, full.data_ptr())
        else:
            full = layout.full.empty((batch, layout.width), tensors[0].dtype, tensors[0].device)
            if library.sl_layout_forward(batch, full.element_size(), blocks, full.data_ptr()):
                raise TypeError(f"the consumer layout copies 2, 4 or 8-byte elements, not {full.dtype}")
        ctx.layout, ctx.batch, ctx.shapes = layout, batch, [t.shape for t in tensors]
        return full

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        layout = ctx.layout
        with layout.clock.exchange():
            if grad.stride(1) != 1:
                grad = grad.contiguous()
            grads = [source.grad.empty(tuple(shape), layout.wire if layout.wire is not None and source.exchanged
                                       else grad.dtype, grad.device)
                     for source, shape in zip(layout.sources, ctx.shapes)]
            library, blocks = layout.kernel.built.library, layout.pointers(grads, ctx.batch)
            if layout.wire is not None:
                library.sl_layout_backward_bf16(ctx.batch, grad.stride(0), grad.data_ptr(), blocks)
            else:
                library.sl_layout_backward(ctx.batch, grad.element_size(), grad.stride(0), grad.data_ptr(), blocks)
        return (None, *grads)


class _FillSlots(torch.autograd.Function):
    """The other operands of the consumer's concatenation written into their reserved columns of
    the layout's tensor (in place): the concatenation without copying the module's values."""

    @staticmethod
    def forward(ctx: Any, full: Tensor, before: int, *others: Tensor) -> Tensor:
        """``before``: how many of ``others`` come before the module's values."""
        column = 0
        ctx.places = []
        for i, other in enumerate(others):
            width = other.size(1)
            if i == before:  # past the module's values
                column = full.size(1) - sum(o.size(1) for o in others[i:])
            full[:, column:column + width].copy_(other)
            ctx.places.append((column, width))
            column += width
        ctx.mark_dirty(full)
        return full

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        # (the reserved columns' gradient reaches _WriteLayout's backward too, which reads only its own)
        return (grad, None, *(grad[:, c:c + w] for c, w in ctx.places))


class _Laid(Tensor):
    """What the consumer layout hands the model: splits and narrows of the values give per-key
    views that know their key, a concatenation of all of them in order is the layout's tensor;
    every other operation computes as on a plain tensor (and returns plain tensors)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if any(not issubclass(t, _Laid) for t in types):
            # another type with its own protocol first (e.g. TorchRec's LazyAwaitable, which waits
            # for a module's output when an operation reads it); it calls back with plain operands
            return NotImplemented
        kwargs = kwargs or {}
        if func in CATS:
            laid = _concatenate(args, kwargs)
            if laid is not None:  # (decided before computing: the copy saved is the point)
                return laid
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        values = args[0] if args else None
        if isinstance(values, ConsumerValues) and func in SPLITS + NARROWS:
            return _key_views(values, func, args, kwargs, result)
        return result


class ConsumerValues(_Laid):
    """A KeyedTensor's values in the consumer's layout (a view of the layout's tensor ``_full``)."""

    _layout: ConsumerOutput
    _full: Tensor
    _concatenated: bool  # the layout's tensor was handed out as a concatenation (once only)


class _KeyView(_Laid):
    """One key's values (a view of :class:`ConsumerValues`), knowing which key it is."""

    _values: ConsumerValues
    _key: int


def _key_views(values: ConsumerValues, func: Any, args: tuple, kwargs: dict, result: Any) -> Any:
    """Tag the views that are exactly one key's columns."""
    out = []
    for piece, key in key_views(func, args, kwargs, result, values._layout.dims):
        if key >= 0:
            piece = piece.as_subclass(_KeyView)
            piece._values, piece._key = values, key
        out.append(piece)
    return out[0] if func in NARROWS else type(result)(out)


def _concatenate(args: tuple, kwargs: dict) -> Optional[Tensor]:
    """When the operands of a ``torch.cat`` are every key's view in the layout's order along the
    key dim, with other operands filling exactly the reserved columns: the layout's tensor with
    those operands written in; else None (the concatenation is computed as usual)."""
    tensors = list(kwargs.get("tensors", args[0] if args else []))
    views = [i for i, t in enumerate(tensors) if isinstance(t, _KeyView)]
    if not views or dim_argument(args, kwargs, 1) != 1 or kwargs.get("out") is not None:
        return None
    values = tensors[views[0]]._values
    layout = values._layout
    first = views[0]
    run = tensors[first:first + len(layout.dims)]
    if (values._concatenated or not all(isinstance(t, _KeyView) and t._values is values for t in run)
            or [t._key for t in run] != list(range(len(layout.dims)))):
        return None
    before, after = tensors[:first], tensors[first + len(layout.dims):]
    others = before + after
    if (any(not isinstance(t, Tensor) or t.dim() != 2 or t.size(0) != values.size(0) or t.dtype != values.dtype
            for t in others)
            or sum(t.size(1) for t in before) != layout.before or sum(t.size(1) for t in after) != layout.after):
        return None
    # a second concatenation must not write other operands over the first one's result
    values._concatenated = True
    layout.on_concatenated()
    if not others:
        return values._full
    with torch._C.DisableTorchFunctionSubclass(), layout.clock.concatenation():
        return _FillSlots.apply(values._full, len(before), *others)


def timed_reference(kt: Any, clock: RegionClock) -> Any:
    """The reference output ``kt`` (a KeyedTensor) whose values time the model's concatenation of
    their per-key views on ``clock`` (forward and backward); everything computes as it would."""
    values = kt.values().as_subclass(_Timed)
    values._clock = clock
    return with_values(kt, values)


class _Timed(Tensor):
    """A reference output's values, and the per-key views split or narrowed from them: a
    concatenation that reads one is timed; every operation returns plain tensors but those views."""

    _clock: RegionClock

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if any(not issubclass(t, _Timed) for t in types):
            return NotImplemented  # another type's protocol first (e.g. TorchRec's LazyAwaitable: it waits)
        kwargs = kwargs or {}
        operands = kwargs.get("tensors", args[0] if args else []) if func in CATS else []
        clock = next((t._clock for t in operands if isinstance(t, _Timed)), None)
        if clock is not None:
            with clock.concatenation(), torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **kwargs)
            clock.concatenation_backward(result)
            return result
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func in SPLITS + NARROWS and isinstance(args[0], _Timed):
            pieces = [result] if func in NARROWS else list(result)
            for i, piece in enumerate(pieces):
                pieces[i] = piece.as_subclass(_Timed)
                pieces[i]._clock = args[0]._clock
            return pieces[0] if func in NARROWS else type(result)(pieces)
        return result
