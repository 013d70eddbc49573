"""``SequenceRankingModule``: a sequence-aware ranking model (DIN-style target attention) as a
LightningModule. A user's history of item ids goes through a TorchRec ``EmbeddingCollection``
(one row per id, not pooled), the target item through the same item table, the one-hot
categorical features through an ``EmbeddingBagCollection``; the target attends over the history,
and the attended interest, the target, the pooled categorical embeddings and the bottom MLP's
output feed the top MLP. Tables are created on the meta device (the strategy shards them)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from lightning_sparselift.data.sequence import HISTORY_FEATURE, TARGET_FEATURE
from lightning_sparselift.models.base import RecModule


@torch.fx.wrap  # one call in fx graphs (TorchRec's train pipelines trace the model to find its sparse inputs)
def target_attention(query: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Softmax attention of each sample's ``query`` [B, D] over its own rows of the jagged
    ``history`` (values [N, D], ``lengths`` [B]): scores ``<q, h> / sqrt(D)``; a sample with an
    empty history gets zeros. Works on the jagged values directly (no padding to the longest)."""
    batch, dim = query.shape
    if lengths.shape[0] != batch:
        raise ValueError(f"{batch} queries (one target item id per sample) for {lengths.shape[0]} histories")
    sample = torch.repeat_interleave(torch.arange(batch, device=query.device), lengths.long())
    scores = (history * query[sample]).sum(dim=1) / math.sqrt(dim)
    with torch.no_grad():  # a per-sample shift for a stable softmax; the softmax does not depend on it
        peak = scores.new_full((batch,), float("-inf")).scatter_reduce(0, sample, scores, "amax")
    weights = torch.exp(scores - peak[sample])
    weights = weights / scores.new_zeros(batch).index_add(0, sample, weights)[sample]
    return history.new_zeros(batch, dim).index_add(0, sample, history * weights.unsqueeze(1))


class SequenceSparseArch(nn.Module):
    """The sparse part: ``bags`` (EmbeddingBagCollection, one table per categorical feature) and
    ``sequences`` (EmbeddingCollection, one item table read by the history and the target)."""

    def __init__(self, categorical: list[tuple[str, int]], item_rows: int, embedding_dim: int,
                 item_embedding_dim: int, history_feature: str, target_feature: str):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig

        meta = torch.device("meta")
        self.bags = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=embedding_dim, num_embeddings=rows,
                                       feature_names=[f]) for f, rows in categorical], device=meta)
        self.sequences = EmbeddingCollection(
            tables=[EmbeddingConfig(name="t_items", embedding_dim=item_embedding_dim, num_embeddings=item_rows,
                                    feature_names=[history_feature, target_feature])], device=meta)
        self.bag_features = [f for f, _ in categorical]
        self.sequence_features = [history_feature, target_feature]

    def forward(self, features: Any) -> tuple[Any, dict[str, Any]]:
        # Both collections read the batch's KJT as it is (each selects its own keys, as TorchRec's
        # sharded modules do), so the strategy finds their input in the batch and can start it early.
        return self.bags(features), self.sequences(features)


class SequenceRanker(nn.Module):
    """``model(dense, features) -> logits [B, 1]`` over a :class:`SequenceSparseArch`."""

    def __init__(self, sparse_arch: SequenceSparseArch, dense_in_features: int, embedding_dim: int,
                 item_embedding_dim: int, dense_arch_layer_sizes: list[int], over_arch_layer_sizes: list[int]):
        super().__init__()
        from torchrec.modules.mlp import MLP

        self.sparse_arch = sparse_arch
        self.bag_features = list(sparse_arch.bag_features)
        self.history_feature, self.target_feature = sparse_arch.sequence_features
        self.dense_arch = MLP(dense_in_features, list(dense_arch_layer_sizes))
        self.query = nn.Linear(item_embedding_dim, item_embedding_dim)
        width = dense_arch_layer_sizes[-1] + embedding_dim * len(sparse_arch.bag_features) + 2 * item_embedding_dim
        self.over_arch = nn.Sequential(MLP(width, list(over_arch_layer_sizes[:-1])),
                                       nn.Linear(over_arch_layer_sizes[-2], 1))

    def forward(self, dense_features: torch.Tensor, sparse_features: Any) -> torch.Tensor:
        pooled, sequences = self.sparse_arch(sparse_features)
        history, target = sequences[self.history_feature], sequences[self.target_feature]
        interest = target_attention(self.query(target.values()), history.values(), history.lengths())
        pooled = pooled.to_dict()  # by key: a sharded output is in sharding order
        parts = [self.dense_arch(dense_features)] + [pooled[f] for f in self.bag_features]
        return self.over_arch(torch.cat(parts + [interest, target.values()], dim=1))


class SequenceRankingModule(RecModule):
    """Click-through-rate model over a user's item history (target attention), the target item,
    categorical and dense features, trained with BCE on logits.

    Args:
        num_embeddings_per_feature: rows of each feature's table, in ``feature_names`` order (the
            history and target features both read the item table: their rows must agree).
        feature_names: keys of the input KJT; all but the history and target are categorical
            features with one table each, pooled (sum) by an EmbeddingBagCollection.
        dense_in_features: number of dense features.
        embedding_dim: width of the categorical tables.
        item_embedding_dim: width of the item table.
        dense_arch_layer_sizes: bottom MLP.
        over_arch_layer_sizes: top MLP (must end in 1).
        history_feature / target_feature: the keys of the item history (variable length, looked up
            unpooled by an EmbeddingCollection) and of the target item (one id per sample).
        dense_optimizer / dense_lr / lr_scheduler / lr_scheduler_steps: see
            :class:`~lightning_sparselift.models.base.RecModule`.
    """

    def __init__(
        self,
        num_embeddings_per_feature: list[int],
        feature_names: list[str],
        dense_in_features: int = 13,
        embedding_dim: int = 16,
        item_embedding_dim: int = 32,
        dense_arch_layer_sizes: list[int] = (64, 32),
        over_arch_layer_sizes: list[int] = (256, 64, 1),
        history_feature: str = HISTORY_FEATURE,
        target_feature: str = TARGET_FEATURE,
        dense_optimizer: str = "adagrad",
        dense_lr: float = 0.02,
        lr_scheduler: Optional[str] = None,
        lr_scheduler_steps: Optional[int] = None,
    ):
        super().__init__(dense_optimizer, dense_lr, lr_scheduler, lr_scheduler_steps)
        self.save_hyperparameters()
        names, rows = list(feature_names), [int(r) for r in num_embeddings_per_feature]
        if len(names) != len(rows):
            raise ValueError(f"{len(names)} feature names for {len(rows)} table sizes")
        missing = [f for f in (history_feature, target_feature) if f not in names]
        if missing:
            raise ValueError(f"feature(s) {missing} not among the features {names} (history_feature="
                             f"{history_feature!r}, target_feature={target_feature!r})")
        item_rows = rows[names.index(history_feature)]
        if rows[names.index(target_feature)] != item_rows:
            raise ValueError(f"{history_feature!r} and {target_feature!r} share the item table: their rows differ "
                             f"({item_rows} vs {rows[names.index(target_feature)]})")
        categorical = [(f, r) for f, r in zip(names, rows) if f not in (history_feature, target_feature)]
        if not categorical:
            raise ValueError("the model needs at least one categorical feature besides the history and the target")
        if list(over_arch_layer_sizes)[-1] != 1 or len(over_arch_layer_sizes) < 2:
            raise ValueError(f"the top MLP must have two or more layers ending in 1 (one logit), "
                             f"got {list(over_arch_layer_sizes)}")
        sparse = SequenceSparseArch(categorical, item_rows, embedding_dim, item_embedding_dim, history_feature,
                                    target_feature)
        self.model = SequenceRanker(sparse, dense_in_features, embedding_dim, item_embedding_dim,
                                    list(dense_arch_layer_sizes), list(over_arch_layer_sizes))
