"""Sharded checkpoints: exact resume, resharding weights, atomic saves, checksums, no code on
load, clear errors."""

import hashlib
import json
import pickle
import re
import shutil
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.parsing import AttributeDict
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

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


def test_not_a_checkpoint_folder(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    with pytest.raises(Exception, match="not a SparseLift checkpoint"):
        trainer(1, _strategy()).validate(tiny_model(dm), dm, ckpt_path=tmp_path, verbose=False)


# ------------------------------------------------------------------ atomic saves, checksums, safety
@pytest.fixture(scope="module")
def saved(tmp_path_factory, data_cache):
    """The checkpoints after epochs 0 and 1 of one run; tests change copies only."""
    return _fit(tiny_data(data_cache), tmp_path_factory.mktemp("saved"), "run", epochs=2)


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def _validate(dm, ckpt_path):
    L.seed_everything(0)
    return trainer(2, _strategy()).validate(tiny_model(dm), dm, ckpt_path=ckpt_path, verbose=False)


def _same(a, b) -> bool:
    """Equal, with the same types all the way down (tensors: equal values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_metadata_round_trips_exactly_and_names_what_it_cannot_store(tmp_path):
    state = {
        "epoch": 3, "pytorch-lightning_version": "2.6.6", "inf": float("inf"),
        "loops": {"fit_loop": {"pair": (1, (2.5, "a")), 7: "int key", (1, 2): "tuple key", None: [True, None]}},
        "callbacks": {"Score": {"best": torch.tensor(0.25), "k": {"/p/epoch=0.ckpt": torch.tensor([1.0, 2.0])}}},
        "user": {"$sparselift": "a key that looks like our tag"},
        "hyper_parameters": AttributeDict(lr=0.1, dims=(8, 16)),
        "loss_fn": lambda x: x,
        "mixed": {"keep": 1, "drop": object()},
    }
    expected = {k: v for k, v in state.items() if k != "loss_fn"}
    expected.update(hyper_parameters={"lr": 0.1, "dims": (8, 16)}, mixed={"keep": 1})
    path = tmp_path / "x.ckpt"
    for step in (1, 2):  # the second save replaces the first
        folder = tmp_path / f"x.ckpt.partial-{step}"
        folder.mkdir()
        (folder / "shard.distcp").write_bytes(b"step %d" % step)
        with pytest.warns(RuntimeWarning, match=r"left out checkpoint\['loss_fn'\] \(function\), "
                                                 r"checkpoint\['mixed'\]\['drop'\] \(object\)"):
            ckpt.commit(folder, path, {**state, "global_step": step}, {"tables": {}}, {}, has_optimizer=False)
    lightning, info = ckpt.read_meta(path)
    assert _same(lightning, {**expected, "global_step": 2})
    assert info == {"fingerprint": {"tables": {}}, "plan": {}, "has_optimizer": False}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]
    assert sorted(p.name for p in path.iterdir()) == ["shard.distcp", ckpt.META_FILE, ckpt.TENSORS_FILE]
    assert json.loads((path / ckpt.META_FILE).read_text())["format"] == ckpt.FORMAT


def test_flipped_byte_in_a_shard_is_refused(saved, tmp_path, data_cache):
    folder = _copy(saved[0], tmp_path)
    metadata = FileSystemReader(str(folder)).read_metadata()
    table = max((info for index, info in metadata.storage_data.items()
                 if index.fqn.startswith("model.") and "embedding_bags" in index.fqn), key=lambda info: info.length)
    shard = folder / table.relative_path
    data = bytearray(shard.read_bytes())
    data[table.offset + table.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(Exception, match=rf"{re.escape(table.relative_path)} is corrupt: sha256"):
        _validate(tiny_data(data_cache), folder)


def test_shards_of_another_save_are_refused(saved, tmp_path, data_cache):
    """What an in-place save killed midway used to leave: new shards under old metadata."""
    folder = _copy(saved[0], tmp_path)
    for name in [".metadata"] + [p.name for p in saved[1].glob("*.distcp")]:
        shutil.copy(saved[1] / name, folder / name)
    with pytest.raises(Exception, match=r"does not match its checksums"):
        _validate(tiny_data(data_cache), folder)


@pytest.mark.parametrize("crash", ["writing", "replacing"])
def test_interrupted_save_keeps_the_previous_checkpoint(crash, tmp_path, data_cache, monkeypatch):
    """The run dies in its second save of last.ckpt: before the commit ("writing"), or after the
    previous checkpoint was moved aside and before the new one was renamed in ("replacing")."""
    commit, move_aside, last_commits = ckpt.commit, ckpt._move_aside, []

    def commit_dying_in_the_second_save_of_last(folder, path, *args):
        if path.name == "last.ckpt":
            last_commits.append(path)
            if len(last_commits) == 2:
                raise RuntimeError("killed while saving")
        commit(folder, path, *args)

    def move_aside_and_die(path):
        aside = move_aside(path)
        if path.name == "last.ckpt":
            raise RuntimeError("killed while saving")
        return aside

    if crash == "writing":
        monkeypatch.setattr(ckpt, "commit", commit_dying_in_the_second_save_of_last)
    else:
        monkeypatch.setattr(ckpt, "_move_aside", move_aside_and_die)
    dm = tiny_data(data_cache)
    L.seed_everything(11)
    t = trainer(2, _strategy(), max_epochs=2, limit_val_batches=0, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_last=True, every_n_epochs=1)])
    with pytest.raises(Exception, match="killed while saving"):
        t.fit(tiny_model(dm), dm)
    monkeypatch.undo()

    last = tmp_path / "last.ckpt"
    partial, = tmp_path.glob("last.ckpt.partial-*")
    if crash == "writing":
        assert ckpt.read_meta(last)[0]["global_step"] == 8
        _validate(dm, last)
        with pytest.raises(Exception, match="torn checkpoint"):
            _validate(dm, partial)
    else:
        old, = tmp_path.glob("last.ckpt.old-*")
        with pytest.raises(Exception, match=r"interrupted while replacing the previous checkpoint.*last\.ckpt\.old-"):
            _validate(dm, last)
        assert ckpt.read_meta(old)[0]["global_step"] == 8
        assert ckpt.read_meta(partial)[0]["global_step"] == 16
        partial.rename(last)
        _validate(dm, last)


def test_model_checkpoint_replaces_and_removes_folders(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    L.seed_everything(11)
    t = trainer(2, _strategy(), max_epochs=3, limit_val_batches=0, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=1, save_last=True, every_n_epochs=1)])
    t.fit(tiny_model(dm), dm)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=2-step=24.ckpt", "last.ckpt"]
    for folder in tmp_path.iterdir():
        assert ckpt.read_meta(folder)[0]["global_step"] == 24


class _RunsCode:
    """Unpickling this creates ``marker``: it stands for any code a crafted checkpoint could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _checksum_like_an_attacker(folder: Path) -> None:
    meta = json.loads((folder / ckpt.META_FILE).read_text())
    meta["checksums"] = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in meta["checksums"]}
    (folder / ckpt.META_FILE).write_text(json.dumps(meta))


def _forge_dcp_value(folder: Path, payload: bytes) -> None:
    """Declares a dense weight as a pickled value (DCP unpickles those) stored in a new file."""
    metadata = FileSystemReader(str(folder)).read_metadata()
    fqn = next(k for k in metadata.state_dict_metadata if k.startswith("model.") and "dense_arch" in k)
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != fqn}
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo("forged.distcp", 0, len(payload))
    (folder / "forged.distcp").write_bytes(payload)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("crafted", ["legacy metadata", "tensors file", "dcp metadata", "dcp value"])
def test_crafted_checkpoint_cannot_run_code(crafted, saved, tmp_path, data_cache):
    folder = _copy(saved[0], tmp_path)
    marker = tmp_path / "code-ran"
    payload = pickle.dumps(_RunsCode(marker))
    if crafted == "legacy metadata":
        (folder / ckpt.META_FILE).unlink()
        (folder / ckpt.LEGACY_META_FILE).write_bytes(payload)
        expected = r"sparselift\.meta\.pt\) is a pickle: unpickling a file runs any code"
    elif crafted == "tensors file":
        (folder / ckpt.TENSORS_FILE).write_bytes(payload)
        expected = r"sparselift\.tensors\.pt holds more than plain tensors and is refused"
    elif crafted == "dcp metadata":
        (folder / ".metadata").write_bytes(payload)
        expected = r"\.metadata is not plain DCP metadata and is refused"
    else:
        _forge_dcp_value(folder, payload)
        expected = r"forged\.distcp: value .* is not plain data and is refused"
    if crafted != "legacy metadata":
        _checksum_like_an_attacker(folder)
    dm = tiny_data(data_cache)
    with pytest.raises(Exception, match=expected):
        trainer(2, _strategy()).fit(tiny_model(dm), dm, ckpt_path=folder)
    assert not marker.exists()
