"""``dense-only``: the scenario's dense modules with a constant stand-in for the sparse path (no
lookups, no sparse collectives): the bound no sparse-path optimization can beat."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_sparselift.bench.systems.base import BenchEnv, LoopSystem, WithLoss, build_rec_model, dense_optimizer


class ConstantSparse(nn.Module):
    """Stands in for the sparse path: a fixed tensor of the sparse output's shape."""

    def __init__(self, rec: nn.Module, batch_size: int):
        super().__init__()
        from torchrec.sparse.jagged_tensor import KeyedTensor

        configs = rec.sparse_arch.embedding_bag_configs() if hasattr(rec.sparse_arch, "embedding_bag_configs") \
            else rec.sparse_arch.embedding_bag_collection.embedding_bag_configs()
        keys = [f for c in configs for f in c.feature_names]
        dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        generator = torch.Generator().manual_seed(1)
        if hasattr(rec.sparse_arch, "embedding_bag_collection"):  # TorchRec SparseArch -> [B, F, D]
            self.output = torch.randn(batch_size, len(keys), dims[0], generator=generator)
        else:  # an EmbeddingBagCollection -> KeyedTensor
            self.output = KeyedTensor(keys=keys, length_per_key=dims,
                                      values=torch.randn(batch_size, sum(dims), generator=generator))

    def forward(self, features: Any) -> Any:
        return self.output


class ConstantSequences(nn.Module):
    """Stands in for a :class:`~lightning_sparselift.models.sequence.SequenceSparseArch`: fixed
    pooled embeddings, and for each sequence feature fixed rows in the batch's own lengths (the
    attention over the history costs what it costs on the real data)."""

    def __init__(self, sparse_arch: nn.Module, batch_size: int, max_ids: int):
        super().__init__()
        from torchrec.sparse.jagged_tensor import KeyedTensor

        generator = torch.Generator().manual_seed(1)
        bag_configs = sparse_arch.bags.embedding_bag_configs()
        dims = [c.embedding_dim for c in bag_configs for _ in c.feature_names]
        self.pooled = KeyedTensor(keys=sparse_arch.bag_features, length_per_key=dims,
                                  values=torch.randn(batch_size, sum(dims), generator=generator))
        (items,) = sparse_arch.sequences.embedding_configs()
        self.rows = torch.randn(max_ids, items.embedding_dim, generator=generator)
        self.sequence_features = list(sparse_arch.sequence_features)

    def forward(self, features: Any) -> tuple[Any, dict[str, Any]]:
        from torchrec.sparse.jagged_tensor import JaggedTensor

        jagged = features.to_dict()
        sequences = {}
        for f in self.sequence_features:
            lengths = jagged[f].lengths()
            sequences[f] = JaggedTensor(values=self.rows[: int(lengths.sum())], lengths=lengths)
        return self.pooled, sequences


def stand_in_sparse(rec: nn.Module, env: BenchEnv) -> nn.Module:
    """A constant stand-in for ``rec``'s sparse part with its output's shapes (dense-only)."""
    from lightning_sparselift.models.sequence import SequenceSparseArch

    if isinstance(rec.sparse_arch, SequenceSparseArch):
        most = max(int(env.local_batch(i).sparse.lengths().sum()) for i in range(env.pool))
        return ConstantSequences(rec.sparse_arch, env.batch_size, most)
    return ConstantSparse(rec, env.batch_size)


class DenseOnly(LoopSystem):
    name = "dense-only"

    def setup(self) -> None:
        rec = build_rec_model(self.env.scenario, self.env.seed)
        rec.sparse_arch = stand_in_sparse(rec, self.env)
        self.model = nn.parallel.DistributedDataParallel(WithLoss(rec, self.env.precision), broadcast_buffers=False)
        self.optimizer = dense_optimizer(self.env.scenario, self.model.parameters())
        self._timed_model(self.model.module, rec.sparse_arch, self.optimizer)

