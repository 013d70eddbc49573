"""Tables a user built with values (on CPU, not meta): TorchRec's sharded modules would start
from their own initialization instead; the strategy copies the values into every shard, whatever
its sharding type, and warns once about the memory it took."""

from __future__ import annotations

import json

import lightning.pytorch as L
import torch

from helpers import tiny_data, trainer
from lightning_sparselift import SparseLiftStrategy
from user_models import PositionalKJT


class BuiltOnCPU(PositionalKJT):
    def __init__(self, table_sizes, feature_names):
        super().__init__(table_sizes, feature_names)
        from torchrec import EmbeddingBagCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        self.embeddings = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"table_{f}", embedding_dim=8, num_embeddings=rows, feature_names=[f])
            for f, rows in zip(feature_names, table_sizes)])
        with torch.no_grad():
            for t, table in enumerate(self.embeddings.parameters()):
                table.copy_(initial(t, *table.shape))


def initial(t: int, rows: int, dim: int) -> torch.Tensor:
    return torch.arange(rows * dim, dtype=torch.float32).view(rows, dim) / 1000 + t


class CheckShards(L.Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_start(self, trainer, pl_module):
        wrong, seen = [], 0
        for t, name in enumerate(f"table_{f}" for f in pl_module.feature_names):
            state = trainer.strategy.model.state_dict()[f"embeddings.embedding_bags.{name}.weight"]
            full = initial(t, *state.size())
            if not hasattr(state, "local_shards"):  # (data-parallel: the whole table)
                seen += 1
                wrong += [] if torch.equal(state, full) else [name]
                continue
            for shard in state.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                seen += 1
                wrong += [] if torch.equal(shard.tensor, full[r:r + h, c:c + w]) else [name]
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps({"wrong": wrong, "seen": seen}))


def test_tables_built_with_values_start_from_them_in_every_shard(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    L.seed_everything(0)
    kinds = {"table_cat_0": "data_parallel", "table_cat_1": "column_wise", "table_cat_2": "table_wise",
             "table_cat_4": "row_wise"}
    strategy = SparseLiftStrategy(start_method="fork", sharding_types=kinds)
    t = trainer(2, strategy, limit_val_batches=0, max_steps=1, callbacks=[CheckShards(tmp_path)])
    # (the warning is raised in the rank processes: its text is tested where it is made)
    t.fit(BuiltOnCPU(dm.table_sizes, dm.feature_names), dm)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["wrong"] == [] and report["seen"] >= 4, report
