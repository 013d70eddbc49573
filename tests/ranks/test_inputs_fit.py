"""Bad input under Trainer.fit gets a clear error, before any collective can hang on it; the
lookups skip fbgemm's own id check only where the input checks ran (the checks themselves:
tests/unit/test_inputs.py)."""

import json
import os

import lightning.pytorch as L
import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port, tiny_data, tiny_model, trainer
from lightning_sparselift import RecBatch, SparseLiftStrategy


class CorruptFirstBatch(L.Callback):
    def __init__(self, corrupt):
        self.corrupt = corrupt

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.corrupt(batch)


def _out_of_range(batch: RecBatch):
    values = batch.sparse.values()
    values[0] = 10_000_000


def test_out_of_range_ids_fail_in_training(data_cache):
    dm = tiny_data(data_cache)
    t = trainer(2, callbacks=[CorruptFirstBatch(_out_of_range)], limit_val_batches=0)
    with pytest.raises(Exception, match="outside its table's range"):
        t.fit(tiny_model(dm), dm)


def test_a_weighted_collection_fed_no_weights_is_an_input_error(data_cache):
    """Not a lifting fallback on which TorchRec's path trains the collection unweighted."""
    dm = tiny_data(data_cache)  # (its KJTs carry no weights)
    model = tiny_model(dm)
    model.model.sparse_arch.embedding_bag_collection._is_weighted = True  # as EmbeddingBagCollection(is_weighted=True)
    with pytest.raises(Exception, match=r"the module is weighted .* has no weights"):
        trainer(2, limit_val_batches=0).fit(model, dm)


def test_kjt_keys_differ_from_model_features(data_cache):
    dm = tiny_data(data_cache)
    # the data has features cat_0..cat_5, the model is built for other names
    model = tiny_model(dm, feature_names=[f"f{i}" for i in range(6)])
    with pytest.raises(Exception, match="keys do not match the model's features"):
        trainer(2, limit_val_batches=0).fit(model, dm)


@pytest.mark.parametrize("sharding, match", [({"t_cat_0": "diagonal"}, "unknown sharding type 'diagonal'"),
                                             ({"t_nope": "table_wise"}, r"table\(s\) \['t_nope'\]"),
                                             ({"t_cat_0": "table_column_wise", "t_cat_1": "row_wise"},
                                              "table_column_wise cannot be combined with row-wise tables on CPU")])
def test_bad_sharding_types(sharding, match, data_cache):
    dm = tiny_data(data_cache)
    t = trainer(1, SparseLiftStrategy(start_method="fork", sharding_types=sharding))
    with pytest.raises(Exception, match=match):
        t.fit(tiny_model(dm), dm)


def test_model_without_embedding_bags(data_cache):
    class Dense(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(13, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch.dense).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(Exception, match="found no torchrec EmbeddingBagCollection or EmbeddingCollection"):
        trainer(1).fit(Dense(), tiny_data(data_cache))


def _bounds_check_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from lightning_sparselift.embedding_optimizer import EmbeddingOptimizer
    from lightning_sparselift.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        modes = {}
        for checked in (True, False):
            model = nn.Module()
            model.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=t, embedding_dim=4, num_embeddings=10,
                                                                   feature_names=[t]) for t in ("a", "b")],
                                               device=torch.device("meta"))
            model.dense = nn.Linear(2, 2)
            sharded = shard_model(model, 1, torch.device("cpu"), {"a": "table_wise", "b": "row_wise"},
                                  EmbeddingOptimizer("sgd"), dist.group.WORLD, dist.group.WORLD if checked else None)
            # (TorchRec keeps a sharded collection's lookups in a plain list)
            tbes = [emb._emb_module for m in sharded.dmp.modules() for lookup in getattr(m, "_lookups", [])
                    for emb in lookup._emb_modules]
            modes[str(checked)] = sorted(t.bounds_check_mode_int for t in tbes
                                         if isinstance(t, SplitTableBatchedEmbeddingBagsCodegen))
            del sharded
        with open(out, "w") as f:
            json.dump(modes, f)
    finally:
        dist.destroy_process_group()


def test_the_lookups_skip_fbgemms_id_check_only_when_the_input_checks_ran(tmp_path):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

    out = tmp_path / "modes.json"
    mp.start_processes(_bounds_check_worker, args=(free_port(), str(out)), nprocs=1, start_method="spawn")
    modes = json.loads(out.read_text())
    # one fused table-batched lookup per sharding group (table-wise, row-wise): with the input checks
    # every id was checked before it reaches them; without, fbgemm's default check stays
    assert modes == {"True": [BoundsCheckMode.NONE.value] * 2, "False": [BoundsCheckMode.WARNING.value] * 2}
