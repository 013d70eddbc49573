"""The generated kernel of a lookup region: TorchRec's grouped lookup module run by one generated
kernel per table-batched embedding module it holds, on that module's own weights and optimizer
state (so ``state_dict``, checkpoints and a switch back to the reference kernel see one storage).
Forward pools (an EmbeddingCollection's: returns each id's row); backward applies the fused
optimizer update, as fbgemm's autograd function does."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_sparselift.runtime.buffers import Buffer, Buffers
from lightning_sparselift.runtime.codegen.build import BuiltKernel, build, build_triton
from lightning_sparselift.runtime.codegen.cpu_source import cpu_source
from lightning_sparselift.runtime.codegen.spec import KernelSpec, Unsupported, spec_of
from lightning_sparselift.runtime.codegen.triton_source import triton_source

_BITS = {torch.int32: 32, torch.int64: 64}
# the generated source's functions (cpu_source): their ctypes result and argument types
_ENTRY_POINTS = {"sl_forward": (ctypes.c_int64, [ctypes.c_int64] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 5),
                 "sl_backward": (ctypes.c_int64, [ctypes.c_int64] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 7
                                 + [ctypes.c_float, ctypes.c_int64])}
ALL_BUCKETS = -1  # the entry points' bucket argument: every bucket (concurrently when several)


# what each ``numerics`` setting of the strategy lets generated kernels do
NUMERICS = ("exact", "fast")


def check_numerics(numerics: str) -> str:
    """``numerics`` if it is one of :data:`NUMERICS`, else ValueError."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    return numerics


def build_lookup(source: str, openmp: bool = False) -> BuiltKernel:
    """The built library of a generated lookup's C++ ``source`` (see :func:`~.build.build`)."""
    return build(source, _ENTRY_POINTS, "lookup", openmp)


def build_kernel(spec: KernelSpec, numerics: str) -> BuiltKernel:
    """The built kernel of ``spec``: C++ for host tables, Triton for device tables (whose
    rounding is not shown to be fbgemm's CUDA kernels': only under ``numerics="fast"``)."""
    check_numerics(numerics)
    if spec.device == "cpu":
        return build_lookup(cpu_source(spec), len(spec.buckets) > 1)
    if numerics == "exact":
        raise Unsupported("device tables: the generated Triton kernels are not shown bit-identical to fbgemm's CUDA "
                          "kernels (numerics='fast' runs them)")
    return build_triton(triton_source(spec), "lookup")


def _ptr(t: Optional[Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _bits(t: Tensor, what: str) -> int:
    try:
        return _BITS[t.dtype]
    except KeyError:
        raise TypeError(f"generated lookup: {what} of dtype {t.dtype}; int32 or int64 expected") from None


def check_result(module: "TableBatchKernel", ids: Tensor, position: int) -> None:
    """What a kernel's return ``position`` means, raised unless -1 (done)."""
    if position == -1:
        return
    if position == -2:
        raise TypeError("generated lookup: unsupported id/offset widths")
    if position == -3:
        raise IndexError(f"generated lookup: no such bucket (the kernel has {len(module.spec.buckets)})")
    raise IndexError(f"generated lookup: id {int(ids[position])} at position {position} is outside its table "
                     f"(tables {[t.rows for t in module.spec.tables]} rows)")


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, placeholder: Tensor, kernel: "TableBatchKernel", ids: Tensor, offsets: Tensor,
                weights: Optional[Tensor], batch: int) -> Tensor:
        out = kernel.output.empty((ids.numel() if kernel.spec.pooling == "none" else batch, kernel.spec.total_dim),
                                  torch.float32, ids.device)
        check_result(kernel, ids, kernel.forward(batch, ids, offsets, weights, out))
        ctx.kernel, ctx.batch = kernel, batch
        ctx.save_for_backward(ids, offsets, weights)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:
        kernel: TableBatchKernel = ctx.kernel
        ids, offsets, weights = ctx.saved_tensors
        check_result(kernel, ids, kernel.backward(ctx.batch, ids, offsets, weights, grad.contiguous()))
        return None, None, None, None, None, None


@dataclass
class TableBatchKernel:
    """The generated kernel of one fbgemm table-batched embedding module: the C++ library (host
    tables) or the Triton module (device tables) built from its spec."""

    tbe: nn.Module
    spec: KernelSpec
    built: BuiltKernel
    output: Buffer = field(default_factory=lambda: Buffer(reuse=False))  # where its forward writes

    def forward(self, batch: int, ids: Tensor, offsets: Tensor, weights: Optional[Tensor], out: Tensor,
                bucket: int = ALL_BUCKETS) -> int:
        """Pool ``batch`` bags per feature (of ``bucket``'s tables, else all) into ``out``; -1, or
        the position of an out-of-range id."""
        tbe, library = self.tbe, self.built.library
        if self.spec.device == "cuda":
            self._every_bucket_on_cuda(bucket)
            return library.forward(batch, ids, offsets, weights, tbe.weights_dev, out)
        return library.sl_forward(bucket, batch, _bits(ids, "ids"), _bits(offsets, "offsets"), ids.data_ptr(),
                                  offsets.data_ptr(), _ptr(weights), tbe.weights_host.data_ptr(), out.data_ptr())

    def backward(self, batch: int, ids: Tensor, offsets: Tensor, weights: Optional[Tensor], grad: Tensor,
                 bucket: int = ALL_BUCKETS) -> int:
        """Each touched row's summed gradient and the fused update of it and its optimizer state
        (of ``bucket``'s tables, else all)."""
        tbe, library, optimizer = self.tbe, self.built.library, self.spec.optimizer
        lr = float(tbe.learning_rate_tensor)
        if self.spec.device == "cuda":
            self._every_bucket_on_cuda(bucket)
            return library.backward(batch, ids, offsets, weights, grad, tbe.weights_dev,
                                    tbe.momentum1_dev if optimizer != "sgd" else None,
                                    tbe.momentum2_dev if optimizer == "adam" else None, lr, int(tbe.iter_cpu.item()))
        state = tbe.momentum1_host.data_ptr() if optimizer != "sgd" else None
        state2 = tbe.momentum2_host.data_ptr() if optimizer == "adam" else None
        return library.sl_backward(bucket, batch, _bits(ids, "ids"), _bits(offsets, "offsets"), ids.data_ptr(),
                                   offsets.data_ptr(), _ptr(weights), grad.data_ptr(), tbe.weights_host.data_ptr(),
                                   state, state2, ctypes.c_float(lr), int(tbe.iter_cpu.item()))

    @staticmethod
    def _every_bucket_on_cuda(bucket: int) -> None:
        if bucket != ALL_BUCKETS:  # (the subgraph pass pipelines buckets on host tables only)
            raise Unsupported("a Triton lookup runs all its buckets per call (on CUDA streams), not one")

    def __call__(self, kjt: Any) -> Tensor:
        return self.lookup(kjt.values(), kjt.offsets(), kjt.weights_or_none() if self.spec.weighted else None,
                           kjt.stride())

    def lookup(self, ids: Tensor, offsets: Tensor, weights: Optional[Tensor], batch: int) -> Tensor:
        """The lookup of ``batch`` bags per feature (fbgemm's layout: ``offsets`` feature-major),
        differentiable: its backward applies the fused update."""
        self.check_inputs(weights)
        tbe = self.tbe
        if tbe.training and torch.is_grad_enabled():
            self.count_step()
        return _Lookup.apply(tbe.placeholder_autograd_tensor, self, ids, offsets, weights, batch)

    def check_inputs(self, weights: Optional[Tensor]) -> None:
        if self.spec.weighted and weights is None:
            raise ValueError("generated lookup: the weighted module's features carry no per-sample weights")
        if weights is not None and weights.dtype != torch.float32:
            raise TypeError(f"generated lookup: per-sample weights of dtype {weights.dtype}; float32 expected")

    def count_step(self) -> None:
        """The counters fbgemm's forward keeps (its iteration counter is checkpointed)."""
        tbe = self.tbe
        tbe.step += 1
        if self.spec.optimizer in ("rowwise_adagrad", "adam"):
            if int(tbe.iter_cpu.item()) == 0:
                tbe.iter_cpu.fill_(tbe.iter.cpu().item())
            tbe.iter_cpu.add_(1)
            tbe.iter.add_(1)


def table_names(module: nn.Module) -> list[str]:
    """The tables of one of TorchRec's table-batched lookup modules, in its kernel's order."""
    return [t.name for t in module.config.embedding_tables]


def bucketed(spec: KernelSpec, names: list[str], buckets: list[list[str]]) -> KernelSpec:
    """``spec`` with its tables (named ``names``) in ``buckets`` of table names (a table with
    several shards on the rank goes where its name is; buckets without a table here are left out)."""
    bucket_of = {name: b for b, bucket in enumerate(buckets) for name in bucket}
    missing = sorted({n for n in names if n not in bucket_of})
    if missing:
        raise Unsupported(f"tables {missing} are in none of the buckets {buckets}")
    tables = [[t for t, name in enumerate(names) if bucket_of[name] == b] for b in range(len(buckets))]
    return replace(spec, buckets=tuple(tuple(b) for b in tables if b))


class GeneratedLookup:
    """A sharding group's lookup region run by generated kernels. :class:`Unsupported` (the
    reason) when one of the lookup's table-batched modules has no generated kernel. With
    ``buckets`` (table names), each kernel runs its tables in those buckets, concurrently.
    Its output is laid out as TorchRec's lookup lays it out: pooled bags side by side; an
    EmbeddingCollection's rows flat, module after module; in ``buffers`` (a lifted module's) when
    given, else in fresh tensors. ``numerics``: see :func:`build_kernel`."""

    def __init__(self, lookup: nn.Module, weighted: bool, check_ids: bool, numerics: str,
                 buckets: Optional[list[list[str]]] = None, buffers: Optional[Buffers] = None) -> None:
        from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup

        self.pooled = isinstance(lookup, GroupedPooledEmbeddingsLookup)
        if not (self.pooled or isinstance(lookup, GroupedEmbeddingsLookup)):
            raise Unsupported(f"a {type(lookup).__name__} lookup (data-parallel tables are updated through DDP and "
                              f"the dense optimizer, not a fused kernel)")
        # (a rank holding none of the group's tables runs TorchRec's lookup: it only makes the empty output)
        modules = list(lookup._emb_modules)
        self.lookup = lookup
        self.kernels = []
        # per kernel: the index of each of ``buckets`` holding some of its tables, in the kernel
        self.kernel_buckets: list[dict[int, int]] = []
        # the output's column blocks in order: (table, width) per feature of each kernel
        self.blocks: list[tuple[str, int]] = []
        for module in modules:
            tbe = module._emb_module
            spec = spec_of(tbe, weighted, check_ids)
            names = table_names(module)
            if buckets:
                spec = bucketed(spec, names, buckets)
                held = [k for k, bucket in enumerate(buckets) if set(bucket) & set(names)]
                self.kernel_buckets.append({k: i for i, k in enumerate(held)})
            self.blocks += [(names[t], dim) for t, dim, _ in spec.features]
            # (one site per table-batched module: its output has one shape whatever the buckets)
            output = buffers.at(("lookup", id(tbe))) if buffers is not None else Buffer(reuse=False)
            self.kernels.append(TableBatchKernel(tbe, spec, build_kernel(spec, numerics), output))
        self.splits = list(lookup._feature_splits)

    @property
    def cached(self) -> bool:
        return all(k.built.cached for k in self.kernels)

    @property
    def build_s(self) -> float:
        return sum(k.built.build_s for k in self.kernels)

    def features(self, kjt: Any) -> list[Any]:
        """``kjt`` split into each kernel's features."""
        return [kjt] if len(self.kernels) == 1 else kjt.split(self.splits)

    def __call__(self, lookup: nn.Module, kjt: Any) -> Tensor:
        if not self.kernels:
            return lookup(kjt)
        parts = [k(f) for k, f in zip(self.kernels, self.features(kjt))]
        if not self.pooled:
            parts = [p.view(-1) for p in parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1 if self.pooled else 0)
