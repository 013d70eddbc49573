"""Sharded checkpoints: exact resume, resharding weights, clear errors."""

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import DumpLocalState, load_dumps, tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy


def _strategy(**kwargs):
    args = dict(start_method="fork", embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                embedding_lr_schedule="follow_dense")
    args.update(kwargs)
    return SparseLiftStrategy(**args)


def _fit(dm, tmp_path: Path, name: str, epochs: int, ckpt_path=None, **strategy_kwargs):
    L.seed_everything(11)
    model = tiny_model(dm, lr_scheduler="cosine", lr_scheduler_steps=20)
    callbacks = [DumpLocalState(tmp_path / name),
                 ModelCheckpoint(dirpath=tmp_path / f"{name}-ckpt", save_top_k=-1, every_n_epochs=1)]
    t = trainer(2, _strategy(**strategy_kwargs), max_epochs=epochs, callbacks=callbacks, limit_val_batches=0,
                enable_checkpointing=True)
    t.fit(model, dm, ckpt_path=ckpt_path)
    return sorted((tmp_path / f"{name}-ckpt").iterdir())


def test_resume_continues_exactly(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    _fit(dm, tmp_path, "straight", epochs=2)
    first = _fit(dm, tmp_path, "half", epochs=1)
    assert [p.name for p in first] == ["epoch=0-step=8.ckpt"]
    _fit(dm, tmp_path, "resumed", epochs=2, ckpt_path=first[0])

    straight, half, resumed = (load_dumps(tmp_path / n, 2) for n in ("straight", "half", "resumed"))
    for rank in range(2):
        assert straight[rank].keys() == resumed[rank].keys()
        tables = [k for k in straight[rank] if "embedding_bags" in k and not k.startswith("optim/")]
        assert tables, "no table shards found"
        assert any(k.startswith("optim/") for k in straight[rank]), "no fused optimizer state found"
        for key in straight[rank]:
            assert torch.equal(straight[rank][key], resumed[rank][key]), f"rank {rank}: {key} differs after resume"
        # and training after the checkpoint really changed the tables
        assert any(not torch.equal(straight[rank][k], half[rank][k]) for k in tables)


def test_weights_load_into_a_different_plan(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    ckpt = _fit(dm, tmp_path, "tw", epochs=1, embedding_optimizer="sgd",
                sharding_types={t: "table_wise" for t in ("t_cat_0", "t_cat_2", "t_cat_4")})[0]

    def validate(sharding_types):
        L.seed_everything(0)
        t = trainer(2, _strategy(embedding_optimizer="sgd", sharding_types=sharding_types))
        return t.validate(tiny_model(dm), dm, ckpt_path=ckpt, verbose=False)[0]

    same = validate({t: "table_wise" for t in ("t_cat_0", "t_cat_2", "t_cat_4")})
    other = validate({"t_cat_0": "row_wise", "t_cat_2": "column_wise", "t_cat_4": "data_parallel"})
    fresh = trainer(2, _strategy(embedding_optimizer="sgd")).validate(tiny_model(dm), dm, verbose=False)[0]
    for key in ("val/auc", "val/logloss"):
        assert other[key] == pytest.approx(same[key], abs=1e-5)
    assert fresh["val/logloss"] != pytest.approx(same["val/logloss"], abs=1e-5)


def test_optimizer_state_resharding_is_refused(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    ckpt = _fit(dm, tmp_path, "tw", epochs=1)[0]
    with pytest.raises(Exception, match="different sharding plan"):
        _fit(dm, tmp_path, "rw", epochs=2, ckpt_path=ckpt, sharding_types={"t_cat_2": "row_wise"})


def test_checkpoint_of_another_model_is_rejected(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    ckpt = _fit(dm, tmp_path, "small", epochs=1)[0]
    L.seed_everything(0)
    bigger = tiny_model(dm, embedding_dim=16, dense_arch_layer_sizes=[16, 16])
    with pytest.raises(Exception, match="different model"):
        trainer(2, _strategy()).validate(bigger, dm, ckpt_path=ckpt, verbose=False)


def test_not_a_checkpoint_folder(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    with pytest.raises(Exception, match="not a SparseLift checkpoint"):
        trainer(1, _strategy()).validate(tiny_model(dm), dm, ckpt_path=tmp_path, verbose=False)
