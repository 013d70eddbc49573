"""Sharded checkpoints through Trainer.fit: exact resume, resharding weights, clear errors, and
ModelCheckpoint's folders. The folder protocol itself (atomic saves, checksums, refused folders,
no code on load) is tested in one process: tests/unit/test_checkpoint_*.py."""

import pickle
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from checkpoint_folders import RunsCode, checksum_like_an_attacker
from helpers import DumpLocalState, load_dumps, tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.checkpoint import io as ckpt


def _strategy(**kwargs):
    args = dict(start_method="fork", embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                embedding_lr_schedule="follow_dense")
    args.update(kwargs)
    return SparseLiftStrategy(**args)


def _fit(dm, tmp_path: Path, name: str, epochs: int, ckpt_path=None, model=None, **strategy_kwargs):
    L.seed_everything(11)
    model = model() if model is not None else tiny_model(dm, lr_scheduler="cosine", lr_scheduler_steps=20)
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


@pytest.mark.parametrize("kind, model", [("sequence", "WithSequenceFeature"), ("managed", "WithManagedCollisions"),
                                         ("managed", "WithManagedSequence"), ("embeddings", "WithDropout"),
                                         ("embeddings", "WithVariableBatch")])
def test_a_model_with_another_collection_kind_or_dropout_resumes_exactly(kind, model, tmp_path, data_cache):
    # the managed-collision module re-initialises evicted rows and dropout draws masks from the
    # global generator: exact only because each rank's generators are saved and restored
    import user_models

    dm = tiny_data(data_cache)
    cls = getattr(user_models, model)
    model = lambda: cls(dm.table_sizes, dm.feature_names)  # noqa: E731
    options = dict(embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05})
    if kind == "managed":  # (fbgemm resets evicted rows' row-wise Adagrad state on CUDA only)
        options["embedding_optimizer"] = {"name": "adagrad", "lr": 0.05}
    if cls is user_models.WithVariableBatch:  # (no data-parallel tables: they take no VBE on CPU)
        options["sharding_types"] = {f"table_{f}": "table_wise" for f in dm.feature_names}
    _fit(dm, tmp_path, "straight", epochs=2, model=model, **options)
    first = _fit(dm, tmp_path, "half", epochs=1, model=model, **options)
    _fit(dm, tmp_path, "resumed", epochs=2, ckpt_path=first[0], model=model, **options)
    straight, half, resumed = (load_dumps(tmp_path / n, 2) for n in ("straight", "half", "resumed"))
    for rank in range(2):
        assert straight[rank].keys() == resumed[rank].keys()
        own = [k for k in straight[rank] if k.startswith(f"{kind}.") and not k.startswith("optim/")]
        assert own and any(k.startswith(f"optim/{kind}.") for k in straight[rank])
        for key in straight[rank]:
            assert torch.equal(straight[rank][key], resumed[rank][key]), f"rank {rank}: {key} differs after resume"
        assert any(not torch.equal(straight[rank][k], half[rank][k]) for k in own)
    if kind == "managed":  # the managed-collision state (remapping, counts) is part of what resumed exactly
        assert any("_mch_remapped_ids_mapping" in k for k in straight[0])


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


def test_model_checkpoint_replaces_and_removes_folders(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    L.seed_everything(11)
    t = trainer(2, _strategy(), max_epochs=3, limit_val_batches=0, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=1, save_last=True, every_n_epochs=1)])
    t.fit(tiny_model(dm), dm)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=2-step=24.ckpt", "last.ckpt"]
    for folder in tmp_path.iterdir():
        assert ckpt.read_meta(folder)[0]["global_step"] == 24


def test_crafted_checkpoint_cannot_run_code(tmp_path, data_cache):
    """Rank 0 refuses the folder before any rank's DCP unpickles its ``.metadata`` (which every
    rank reads); each crafted file is refused in tests/unit/test_checkpoint_safe_load.py."""
    dm = tiny_data(data_cache)
    folder = _fit(dm, tmp_path, "run", epochs=1)[0]
    marker = tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    checksum_like_an_attacker(folder)
    with pytest.raises(Exception, match=r"\.metadata is not plain DCP metadata and is refused"):
        trainer(2, _strategy()).fit(tiny_model(dm), dm, ckpt_path=folder)
    assert not marker.exists()
