"""A checkpoint folder used without the strategy: exported to one plain state dict (every table
whole), and a model rebuilt from it in one process scoring the AUC the strategy scores on the same
validation data."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch

from helpers import tiny_data, tiny_model, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_sparselift import DLRMModule, SparseLiftStrategy, export_checkpoint, load_from_checkpoint
from lightning_sparselift.checkpoint import CheckpointError
from lightning_sparselift.cli import main as cli


def test_an_exported_checkpoint_scores_what_the_strategy_scores(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    L.seed_everything(0)
    strategy = lambda: SparseLiftStrategy(start_method="fork", embedding_optimizer={"name": "rowwise_adagrad",  # noqa: E731
                                                                                    "lr": 0.05},
                                          sharding_types={"t_cat_4": "row_wise", "t_cat_2": "column_wise"})
    fit = trainer(2, strategy(), limit_val_batches=0, enable_checkpointing=True,
                  callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)])
    fit.fit(tiny_model(dm), dm)
    (folder,) = sorted((tmp_path / "ckpt").iterdir())
    sharded = trainer(2, strategy()).validate(tiny_model(dm), dm, ckpt_path=folder, verbose=False)[0]

    # Lightning's own call on the folder, and the one for any LightningModule: no strategy, one process
    model = DLRMModule.load_from_checkpoint(folder)
    assert isinstance(model, DLRMModule) and model.hparams.embedding_dim == 8
    plain = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False).validate(model, dm, verbose=False)[0]
    assert plain["val/auc"] == pytest.approx(sharded["val/auc"], abs=1e-6)
    assert plain["val/logloss"] == pytest.approx(sharded["val/logloss"], abs=1e-6)

    # the file `sparselift export` writes is plain tensors, the tables whole (row-wise, column-wise ones included)
    assert cli(["export", str(folder), str(tmp_path / "model.pt")]) == 0
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    tables = model.model.sparse_arch.embedding_bag_collection.embedding_bags
    assert weights["model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_4.weight"].shape == (1000, 8)
    fresh = tiny_model(dm)  # tables on meta, as for training
    fresh.load_state_dict(weights, assign=True)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    assert torch.equal(tables["t_cat_2"].weight, weights["model.sparse_arch.embedding_bag_collection.embedding_bags."
                                                        "t_cat_2.weight"])
    assert load_from_checkpoint(DLRMModule, folder, dense_lr=0.5).hparams.dense_lr == 0.5

    # the folder's checks come first: a changed shard is refused, naming it
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        export_checkpoint(folder)
    assert cli(["export", str(folder), str(tmp_path / "other.pt")]) == 1
