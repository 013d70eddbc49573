"""Adam for host tables: fbgemm's table-batched embedding module with Adam's state on the host
and its lookups run by the generated C++ kernel.

fbgemm's CPU module refuses Adam (it has no CPU Adam kernel), so TorchRec cannot shard a CPU
model with ``embedding_optimizer="adam"``. :class:`HostAdamTableBatch` is fbgemm's module built
as fbgemm builds it for Adam on CUDA: both moments the tables' shape (``momentum1`` /
``momentum2``, allocated by fbgemm's own split helper, on the host), a checkpointed iteration
counter, ``optimizer`` ADAM; so TorchRec's fused optimizer names the state ``exp_avg`` /
``exp_avg_sq`` in ``state_dict`` and checkpoints, LR schedules reach it through
``set_learning_rate``, and resharding sees the usual split states. Its ``forward`` is the
generated kernel (pooling, then in backward the fused lazy-Adam update of the touched rows, the
arithmetic of fbgemm's CUDA template), compiled on first use and cached by its source's hash.
The lifted executor runs the same kernel on the same storage, so switching between TorchRec's
path and SparseLift's changes nothing.

:func:`host_adam_tables` makes TorchRec's sharders construct this class while a model is sharded
(TorchRec's fused kernel names fbgemm's class from its module; it has no hook for another)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, ComputeDevice
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen, construct_split_state,
)

from lightning_sparselift.runtime.codegen.lookup import TableBatchKernel, build_kernel
from lightning_sparselift.runtime.codegen.spec import spec_of


class HostAdamTableBatch(SplitTableBatchedEmbeddingBagsCodegen):
    """fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` with Adam on host tables (see the
    module docstring); any other optimizer or device is fbgemm's module unchanged."""

    def __init__(self, embedding_specs: list[tuple[Any, ...]], *args: Any,
                 optimizer: EmbOptimType = EmbOptimType.EXACT_SGD, **kwargs: Any) -> None:
        self.host_adam = optimizer == EmbOptimType.ADAM and all(s[3] == ComputeDevice.CPU for s in embedding_specs)
        # fbgemm allocates Adagrad's momentum1 as Adam's (one float per weight, on the tables'
        # placement); the rest of Adam's state is added below as fbgemm adds it for CUDA
        super().__init__(embedding_specs, *args,
                         optimizer=EmbOptimType.EXACT_ADAGRAD if self.host_adam else optimizer, **kwargs)
        self._kernels: dict[bool, TableBatchKernel] = {}
        if not self.host_adam:
            return
        self.optimizer = EmbOptimType.ADAM
        self._apply_split(construct_split_state(embedding_specs, rowwise=False, cacheable=False), prefix="momentum2",
                          dtype=torch.float32)
        # Adam's iteration counter is checkpointed (Adagrad's is not)
        self.register_buffer("iter", torch.zeros(1, dtype=torch.int64, device=self.current_device))

    def forward(self, indices: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor] = None,
                feature_requires_grad: Optional[Tensor] = None,
                batch_size_per_feature_per_rank: Optional[list[list[int]]] = None, **kwargs: Any) -> Tensor:
        if not self.host_adam:
            return super().forward(indices, offsets, per_sample_weights, feature_requires_grad,
                                   batch_size_per_feature_per_rank, **kwargs)
        if batch_size_per_feature_per_rank is not None:
            raise NotImplementedError("Adam on CPU tables: variable batch sizes per feature are not supported by the "
                                      "generated kernel")
        features = len(self.feature_table_map)
        batch = (offsets.numel() - 1) // features
        if batch * features + 1 != offsets.numel():
            raise ValueError(f"{offsets.numel()} offsets for {features} features: B * {features} + 1 expected")
        return self._kernel(per_sample_weights is not None).lookup(indices, offsets, per_sample_weights, batch)

    def _kernel(self, weighted: bool) -> TableBatchKernel:
        kernel = self._kernels.get(weighted)
        if kernel is None:
            spec = spec_of(self, weighted, check_ids=self.bounds_check_mode_int != BoundsCheckMode.NONE.value)
            kernel = self._kernels[weighted] = TableBatchKernel(self, spec, build_kernel(spec, "exact"))
        return kernel


@contextlib.contextmanager
def host_adam_tables() -> Iterator[None]:
    """While open, TorchRec's fused table-batched kernels construct :class:`HostAdamTableBatch`."""
    from torchrec.distributed import batched_embedding_kernel

    original = batched_embedding_kernel.SplitTableBatchedEmbeddingBagsCodegen
    batched_embedding_kernel.SplitTableBatchedEmbeddingBagsCodegen = HostAdamTableBatch
    try:
        yield
    finally:
        batched_embedding_kernel.SplitTableBatchedEmbeddingBagsCodegen = original
