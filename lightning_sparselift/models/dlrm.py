"""``DLRMModule``: TorchRec's DLRM (dot interaction) or DLRM-DCN (DCN-v2) as a LightningModule.

Tables are created on the meta device, so a model with large tables is never materialised
unsharded: the strategy shards them and only each rank's shards are allocated.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_sparselift.models.base import RecModule

INTERACTIONS = ("dot", "dcn", "concat")


def build_embedding_bag_collection(num_embeddings_per_feature: list[int], embedding_dims: list[int],
                                   feature_names: Optional[list[str]] = None, device: str = "meta") -> nn.Module:
    """One table ``t_<feature>`` per feature (feature ``cat_i`` by default)."""
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    names = feature_names or [f"cat_{i}" for i in range(len(num_embeddings_per_feature))]
    if len(names) != len(num_embeddings_per_feature):
        raise ValueError(f"{len(names)} feature names for {len(num_embeddings_per_feature)} tables")
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=int(dim), num_embeddings=int(rows), feature_names=[f])
                for f, rows, dim in zip(names, num_embeddings_per_feature, embedding_dims)],
        device=torch.device(device),
    )


class ConcatInteraction(nn.Module):
    """Bottom MLP on the dense features, concatenated with every pooled embedding (any widths),
    then the top MLP: the usual shape of industrial models with many mixed-width features."""

    def __init__(self, embedding_bag_collection: nn.Module, dense_in_features: int,
                 dense_arch_layer_sizes: list[int], over_arch_layer_sizes: list[int]):
        super().__init__()
        from torchrec.modules.mlp import MLP

        self.sparse_arch = embedding_bag_collection
        self.feature_names = [f for cfg in embedding_bag_collection.embedding_bag_configs() for f in cfg.feature_names]
        width = sum(cfg.embedding_dim for cfg in embedding_bag_collection.embedding_bag_configs())
        self.dense_arch = MLP(dense_in_features, list(dense_arch_layer_sizes))
        self.over_arch = nn.Sequential(MLP(dense_arch_layer_sizes[-1] + width, list(over_arch_layer_sizes[:-1])),
                                       nn.Linear(over_arch_layer_sizes[-2], 1))

    def forward(self, dense_features: torch.Tensor, sparse_features: Any) -> torch.Tensor:
        pooled = self.sparse_arch(sparse_features).to_dict()  # by key: a sharded output is in sharding order
        return self.over_arch(torch.cat([self.dense_arch(dense_features)] + [pooled[f] for f in self.feature_names],
                                        dim=1))


class DLRMModule(RecModule):
    """DLRM / DCN-v2 click-through-rate model trained with BCE on logits.

    Args:
        num_embeddings_per_feature: rows of each feature's table (one table per feature).
        embedding_dim: embedding width (the bottom MLP's last layer must equal it).
        dense_in_features: number of dense features.
        dense_arch_layer_sizes: bottom MLP.
        over_arch_layer_sizes: top MLP (must end in 1).
        interaction: ``"dot"`` (DLRM), ``"dcn"`` (DLRM-DCN, DCN-v2 low-rank cross net) or
            ``"concat"`` (bottom MLP output and all pooled embeddings concatenated into the top MLP;
            the only one that allows per-feature widths).
        embedding_dims: per-feature embedding widths (``concat`` only); default ``embedding_dim``.
        dcn_num_layers / dcn_low_rank_dim: DCN cross-net shape.
        dense_optimizer / dense_lr / lr_scheduler / lr_scheduler_steps: see
            :class:`~lightning_sparselift.models.base.RecModule`.
        feature_names: feature keys of the input KJT (``cat_0..`` by default).
    """

    def __init__(
        self,
        num_embeddings_per_feature: list[int],
        embedding_dim: int = 64,
        dense_in_features: int = 13,
        dense_arch_layer_sizes: list[int] = (512, 256, 64),
        over_arch_layer_sizes: list[int] = (512, 256, 1),
        interaction: str = "dot",
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 512,
        dense_optimizer: str = "sgd",
        dense_lr: float = 0.1,
        lr_scheduler: Optional[str] = None,
        lr_scheduler_steps: Optional[int] = None,
        feature_names: Optional[list[str]] = None,
        embedding_dims: Optional[list[int]] = None,
    ):
        super().__init__(dense_optimizer, dense_lr, lr_scheduler, lr_scheduler_steps)
        self.save_hyperparameters()
        if interaction not in INTERACTIONS:
            raise ValueError(f"interaction must be one of {INTERACTIONS}, got {interaction!r}")
        dims = [int(d) for d in embedding_dims] if embedding_dims else [embedding_dim] * len(num_embeddings_per_feature)
        if len(dims) != len(num_embeddings_per_feature):
            raise ValueError(f"{len(dims)} embedding_dims for {len(num_embeddings_per_feature)} tables")
        if interaction != "concat" and set(dims) != {embedding_dim}:
            raise ValueError(f"interaction {interaction!r} needs one embedding width; use interaction='concat' "
                             f"for per-feature embedding_dims")
        if interaction != "concat" and list(dense_arch_layer_sizes)[-1] != embedding_dim:
            raise ValueError(f"the bottom MLP must end in embedding_dim={embedding_dim}, "
                             f"got {list(dense_arch_layer_sizes)}")
        if list(over_arch_layer_sizes)[-1] != 1:
            raise ValueError(f"the top MLP must end in 1 (one logit), got {list(over_arch_layer_sizes)}")
        from torchrec.models.dlrm import DLRM, DLRM_DCN

        ebc = build_embedding_bag_collection(list(num_embeddings_per_feature), dims, feature_names)
        common = dict(embedding_bag_collection=ebc, dense_in_features=dense_in_features,
                      dense_arch_layer_sizes=list(dense_arch_layer_sizes),
                      over_arch_layer_sizes=list(over_arch_layer_sizes))
        if interaction == "concat":
            self.model = ConcatInteraction(**common)
        elif interaction == "dot":
            self.model = DLRM(**common, dense_device=torch.device("cpu"))
        else:
            self.model = DLRM_DCN(**common, dense_device=torch.device("cpu"), dcn_num_layers=dcn_num_layers,
                                  dcn_low_rank_dim=dcn_low_rank_dim)
