"""LightningModules as users write them: their own EmbeddingBagCollection and dense part, with
forwards that take the sparse features in different ways (not our DLRMModule, whose forward
takes the whole batch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn


@dataclass
class Features:
    dense: torch.Tensor
    sparse: Any


class UserModel(L.LightningModule):
    """An EBC over the data module's features, a bottom MLP, a top layer. Subclasses choose how
    ``training_step`` hands the KJT to ``forward``."""

    def __init__(self, table_sizes: list[int], feature_names: list[str], dim: int = 8, data_type: str = "FP32"):
        super().__init__()
        from torchrec import EmbeddingBagCollection
        from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig

        self.embeddings = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"table_{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f],
                                       data_type=DataType[data_type])
                    for f, rows in zip(feature_names, table_sizes)], device=torch.device("meta"))
        self.feature_names = list(feature_names)
        self.bottom = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, dim))
        self.top = nn.Linear(dim * (len(feature_names) + 1), 1)

    def score(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        pooled = self.embeddings(kjt)
        bottom = self.bottom(dense)  # between the sparse module's call and its output's first use
        return self.top(torch.cat([bottom] + [pooled[f] for f in self.feature_names], dim=1)).squeeze(1)

    def call_forward(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.call_forward(batch)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class PositionalKJT(UserModel):
    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        return self.score(dense, kjt)

    def call_forward(self, batch: Any) -> torch.Tensor:
        return self(batch.dense, batch.sparse)


class WithDropout(PositionalKJT):
    """Dropout in the bottom MLP: a training step draws random numbers."""

    def __init__(self, table_sizes: list[int], feature_names: list[str], dim: int = 8):
        super().__init__(table_sizes, feature_names, dim)
        self.bottom = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, dim))


class WithVariableBatch(PositionalKJT):
    """The first feature at half the batch (one id per pair of samples, as a user-level feature
    deduplicated over a user's samples), the others per sample: a KJT with a variable batch per
    feature (VBE), expanded back to every sample through its inverse indices."""

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        from torchrec import KeyedJaggedTensor

        batch = kjt.stride()
        per_key = kjt.to_dict()
        first, *rest = self.feature_names
        pairs = per_key[first].to_padded_dense(1)[0::2, 0]  # the even samples' (first) id, for each pair
        keys = [first, *rest]
        values = torch.cat([pairs] + [per_key[f].values() for f in rest])
        lengths = torch.cat([torch.ones_like(pairs, dtype=torch.int32)] + [per_key[f].lengths() for f in rest])
        inverse = torch.stack([torch.arange(batch) // 2] + [torch.arange(batch)] * len(rest))
        vbe = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths,
                                stride_per_key_per_rank=[[pairs.numel()]] + [[batch]] * len(rest),
                                inverse_indices=(keys, inverse))
        return self.score(dense, vbe)


class KJTInDict(UserModel):
    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        return self.score(inputs["dense"], inputs["sparse"])

    def call_forward(self, batch: Any) -> torch.Tensor:
        return self({"dense": batch.dense, "sparse": batch.sparse})


class KJTInDataclass(UserModel):
    def forward(self, features: Features) -> torch.Tensor:
        return self.score(features.dense, features.sparse)

    def call_forward(self, batch: Any) -> torch.Tensor:
        return self(Features(batch.dense, batch.sparse))


class KJTAsKeyword(UserModel):
    def forward(self, dense: torch.Tensor, *, kjt: Any) -> torch.Tensor:
        return self.score(dense, kjt)

    def call_forward(self, batch: Any) -> torch.Tensor:
        return self(batch.dense, kjt=batch.sparse)


class KeepsItsOutputs(PositionalKJT):
    """Keeps every training step's pooled values and the tensor it concatenated them into (as a
    model that logs embeddings would), and fails a step when an earlier step's kept tensors
    changed: memory a runtime handed out again while the model held it."""

    def __init__(self, table_sizes: list[int], feature_names: list[str], dim: int = 8):
        super().__init__(table_sizes, feature_names, dim)
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def score(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        pooled = self.embeddings(kjt)
        combined = torch.cat([self.bottom(dense)] + [pooled[f] for f in self.feature_names], dim=1)
        if self.training:
            for step, (held, copy) in enumerate(self.kept):
                if not torch.equal(held, copy):
                    raise AssertionError(f"the outputs kept from training step {step} changed")
            for tensor in (pooled.values(), combined):
                self.kept.append((tensor.detach(), tensor.detach().clone()))
        return self.top(combined).squeeze(1)


MODELS = {"positional": PositionalKJT, "dict": KJTInDict, "dataclass": KJTInDataclass, "keyword": KJTAsKeyword,
          "keeps_outputs": KeepsItsOutputs}


class WithSequenceFeature(L.LightningModule):
    """The first feature as a sequence through an EmbeddingCollection (its rows averaged per
    sample in the model), the others pooled by an EmbeddingBagCollection: TorchRec's two module
    kinds side by side."""

    def __init__(self, table_sizes: list[int], feature_names: list[str], dim: int = 8):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig

        first, *rest = feature_names
        self.sequence = EmbeddingCollection(
            tables=[EmbeddingConfig(name=f"seq_{first}", embedding_dim=dim, num_embeddings=table_sizes[0],
                                    feature_names=[first])], device=torch.device("meta"))
        self.embeddings = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"table_{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f])
                    for f, rows in zip(rest, table_sizes[1:])], device=torch.device("meta"))
        self.first, self.rest = first, list(rest)
        self.bottom = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, dim))
        self.top = nn.Linear(dim * (len(feature_names) + 1), 1)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        sequence_kjt, pooled_kjt = kjt.split([1, len(self.rest)])
        rows = self.sequence(sequence_kjt)[self.first]
        lengths = rows.lengths()
        samples = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        history = torch.zeros(lengths.numel(), rows.values().shape[1]).index_add_(0, samples, rows.values())
        history = history / lengths.clamp(min=1).unsqueeze(1)
        pooled = self.embeddings(pooled_kjt)
        parts = [self.bottom(dense), history] + [pooled[f] for f in self.rest]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch.dense, batch.sparse)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class WithPositionWeights(L.LightningModule):
    """The first two features through a FeatureProcessedEmbeddingBagCollection (learned position
    weights), the others through a plain EmbeddingBagCollection."""

    def __init__(self, table_sizes: list[int], feature_names: list[str], dim: int = 8):
        super().__init__()
        from torchrec import EmbeddingBagCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

        def bags(names: list[str], sizes: list[int], weighted: bool) -> EmbeddingBagCollection:
            return EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name=f"table_{f}", embedding_dim=dim, num_embeddings=rows,
                                           feature_names=[f]) for f, rows in zip(names, sizes)],
                is_weighted=weighted, device=torch.device("meta"))

        self.weighted_names, self.rest = list(feature_names[:2]), list(feature_names[2:])
        self.positioned = FeatureProcessedEmbeddingBagCollection(
            bags(self.weighted_names, table_sizes[:2], True),
            PositionWeightedModuleCollection({f: 4 for f in self.weighted_names}))
        self.embeddings = bags(self.rest, table_sizes[2:], False)
        self.bottom = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, dim))
        self.top = nn.Linear(dim * (len(feature_names) + 1), 1)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        positioned_kjt, pooled_kjt = kjt.split([2, len(self.rest)])
        weighted, pooled = self.positioned(positioned_kjt), self.embeddings(pooled_kjt)
        parts = [self.bottom(dense)] + [weighted[f] for f in self.weighted_names] + [pooled[f] for f in self.rest]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)

    training_step = WithSequenceFeature.training_step
    configure_optimizers = WithSequenceFeature.configure_optimizers


class WithEveryCollection(L.LightningModule):
    """TorchRec's three collection kinds in one model: the first feature as a sequence
    (EmbeddingCollection ``sequence``), the next two position-weighted
    (FeatureProcessedEmbeddingBagCollection ``positioned``), the rest pooled by a plain
    EmbeddingBagCollection ``embeddings``. The sequence and the bags read the batch's whole KJT
    (each selects its own keys); the position-weighted collection gets a KJT of its own, since
    TorchRec's row-wise one writes its position weights into the KJT it is given."""

    def __init__(self, table_sizes: list[int], feature_names: list[str], dim: int = 8):
        super().__init__()
        sequence = WithSequenceFeature(table_sizes[:1] + table_sizes[3:], feature_names[:1] + feature_names[3:], dim)
        positioned = WithPositionWeights(table_sizes[1:], feature_names[1:], dim)
        self.sequence, self.first = sequence.sequence, sequence.first
        self.positioned, self.weighted_names = positioned.positioned, positioned.weighted_names
        self.embeddings, self.rest = sequence.embeddings, sequence.rest
        self.bottom = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, dim))
        self.top = nn.Linear(dim * (len(feature_names) + 1), 1)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        rows = self.sequence(kjt)[self.first]
        lengths = rows.lengths()
        samples = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        history = torch.zeros(lengths.numel(), rows.values().shape[1]).index_add_(0, samples, rows.values())
        weighted, pooled = self.positioned(kjt.permute([1, 2])), self.embeddings(kjt)
        parts = [self.bottom(dense), history / lengths.clamp(min=1).unsqueeze(1)]
        parts += [weighted[f] for f in self.weighted_names] + [pooled[f] for f in self.rest]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)

    training_step = WithSequenceFeature.training_step
    configure_optimizers = WithSequenceFeature.configure_optimizers


class WithManagedCollisions(L.LightningModule):
    """The first feature's raw ids (any value below ``input_hash_size``) remapped to its table's
    rows by a managed-collision collection (``managed``, MCH with LFU eviction; pooled, or with
    ``sequence`` a managed-collision EmbeddingCollection whose rows the model averages), the
    others pooled by a plain EmbeddingBagCollection."""

    input_hash_size = 1 << 20
    sequence = False

    def __init__(self, table_sizes: list[int], feature_names: list[str], dim: int = 8):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
        from torchrec.modules.mc_embedding_modules import (
            ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection,
        )
        from torchrec.modules.mc_modules import (
            DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
        )

        meta = torch.device("meta")
        self.first, self.rest = feature_names[0], list(feature_names[1:])
        config, collection, managed = ((EmbeddingConfig, EmbeddingCollection, ManagedCollisionEmbeddingCollection)
                                       if self.sequence else (EmbeddingBagConfig, EmbeddingBagCollection,
                                                              ManagedCollisionEmbeddingBagCollection))
        tables = [config(name=f"mc_{self.first}", embedding_dim=dim, num_embeddings=table_sizes[0],
                         feature_names=[self.first])]
        managers = {tables[0].name: MCHManagedCollisionModule(
            zch_size=table_sizes[0], device=meta, eviction_interval=4, eviction_policy=DistanceLFU_EvictionPolicy(),
            input_hash_size=self.input_hash_size)}
        self.managed = managed(collection(tables=tables, device=meta),
                               ManagedCollisionCollection(managers, embedding_configs=tables),
                               return_remapped_features=False)
        self.embeddings = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"table_{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f])
                    for f, rows in zip(self.rest, table_sizes[1:])], device=meta)
        self.bottom = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, dim))
        self.top = nn.Linear(dim * (len(feature_names) + 1), 1)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        first_kjt, rest_kjt = kjt.split([1, len(self.rest)])
        # raw ids: the data's ids spread over the hash range (the module remaps them to rows)
        raw = type(first_kjt)(keys=first_kjt.keys(), values=first_kjt.values() * 7919 % self.input_hash_size,
                              lengths=first_kjt.lengths())
        managed = self.managed(raw)[0][self.first]
        if self.sequence:
            lengths = managed.lengths()
            samples = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            managed = torch.zeros(lengths.numel(), managed.values().shape[1]).index_add_(0, samples, managed.values())
        pooled = self.embeddings(rest_kjt)
        parts = [self.bottom(dense), managed] + [pooled[f] for f in self.rest]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)

    training_step = WithSequenceFeature.training_step
    configure_optimizers = WithSequenceFeature.configure_optimizers


class WithManagedSequence(WithManagedCollisions):
    sequence = True


class TwoBagCollections(UserModel):
    """The features split over two EmbeddingBagCollections, ``embeddings`` and ``second``."""

    def __init__(self, table_sizes: list[int], feature_names: list[str], dim: int = 8):
        super().__init__(table_sizes[:3], feature_names[:3], dim)
        from torchrec import EmbeddingBagCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        self.second_names = list(feature_names[3:])
        self.second = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"table_{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f])
                    for f, rows in zip(self.second_names, table_sizes[3:])], device=torch.device("meta"))
        self.top = nn.Linear(dim * (len(feature_names) + 1), 1)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        first_kjt, second_kjt = kjt.split([len(self.feature_names), len(self.second_names)])
        pooled, other = self.embeddings(first_kjt), self.second(second_kjt)
        parts = [self.bottom(dense)] + [pooled[f] for f in self.feature_names] + [other[f] for f in self.second_names]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)

    def call_forward(self, batch: Any) -> torch.Tensor:
        return self(batch.dense, batch.sparse)
