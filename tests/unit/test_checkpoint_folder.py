"""A checkpoint folder's commit protocol and checksums, on folders saved in this process by the
package's own steps: a save replaces the previous checkpoint atomically, a crash midway leaves
it loadable, and a load refuses torn, damaged or unfamiliar folders, naming the file."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from checkpoint_folders import NO_PROCESS_GROUP_WARNING, TinyModel, copy_folder, load, save
from lightning_sparselift.checkpoint import CheckpointError
from lightning_sparselift.checkpoint import folder as checkpoint_folder
from lightning_sparselift.checkpoint import io as ckpt
from lightning_sparselift.checkpoint.layout import META_FILE, TENSORS_FILE

pytestmark = pytest.mark.filterwarnings(NO_PROCESS_GROUP_WARNING)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> list[Path]:
    """Two checkpoints of one run (its steps 8 and 16, other weights); tests change copies only."""
    root = tmp_path_factory.mktemp("saved")
    paths = [root / "epoch=0-step=8.ckpt", root / "epoch=1-step=16.ckpt"]
    for seed, (path, step) in enumerate(zip(paths, (8, 16))):
        save(path, TinyModel(seed), step)
    return paths


def _assert_loads(path: Path, saved_model: nn.Module) -> None:
    model = TinyModel(seed=99)
    load(path, model)
    for key, value in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_save_holds_its_files_and_loads_back(tmp_path):
    path, model = tmp_path / "x.ckpt", TinyModel(0)
    save(path, model, 8)
    assert sorted(p.name for p in path.iterdir() if not p.name.endswith(".distcp")) == [
        ".metadata", "rng.rank0.pt", META_FILE, TENSORS_FILE]
    assert ckpt.read_meta(path)[0]["global_step"] == 8
    _assert_loads(path, model)


def test_a_save_replaces_the_previous_checkpoint_and_remove_leaves_nothing(tmp_path):
    path = tmp_path / "last.ckpt"
    save(path, TinyModel(0), 8)
    save(path, TinyModel(1), 16)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert ckpt.read_meta(path)[0]["global_step"] == 16
    checkpoint_folder.remove(path)
    assert list(tmp_path.iterdir()) == []
    checkpoint_folder.remove(path)  # nothing there: nothing to do


def test_a_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "file").write_text("notes")
    with pytest.raises(FileExistsError, match="is a file; SparseLift checkpoints are folders"):
        checkpoint_folder.start_save(tmp_path / "file")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("notes")
    with pytest.raises(FileExistsError, match="is a folder that is not a SparseLift checkpoint; refusing to replace"):
        checkpoint_folder.start_save(tmp_path / "notes")
    (tmp_path / "empty").mkdir()
    path, folder = checkpoint_folder.start_save(tmp_path / "empty")
    assert path == tmp_path / "empty" and folder.name.startswith("empty.partial-")


def test_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(CheckpointError, match="not a SparseLift checkpoint"):
        ckpt.read_meta(tmp_path)


@pytest.mark.parametrize("crash", ["writing", "replacing"])
def test_interrupted_save_keeps_the_previous_checkpoint(crash, tmp_path, monkeypatch):
    """The run dies in its second save of last.ckpt: before the commit ("writing"), or after the
    previous checkpoint was moved aside and before the new one was renamed in ("replacing")."""
    last = tmp_path / "last.ckpt"
    first, second = TinyModel(0), TinyModel(1)
    save(last, first, 8)
    if crash == "writing":
        _, folder = checkpoint_folder.start_save(last)
        ckpt.write_shards(folder, second, None, rank=0)  # and killed before the commit
    else:
        move_aside = checkpoint_folder._move_aside

        def move_aside_and_die(path):
            move_aside(path)
            raise RuntimeError("killed while saving")

        monkeypatch.setattr(checkpoint_folder, "_move_aside", move_aside_and_die)
        with pytest.raises(RuntimeError, match="killed while saving"):
            save(last, second, 16)
        monkeypatch.undo()

    partial, = tmp_path.glob("last.ckpt.partial-*")
    if crash == "writing":
        assert ckpt.read_meta(last)[0]["global_step"] == 8
        _assert_loads(last, first)
        with pytest.raises(CheckpointError, match="torn checkpoint"):
            ckpt.read_meta(partial)
    else:
        old, = tmp_path.glob("last.ckpt.old-*")
        interrupted = r"interrupted while replacing the previous checkpoint.*last\.ckpt\.old-"
        with pytest.raises(CheckpointError, match=interrupted):
            ckpt.read_meta(last)
        assert ckpt.read_meta(old)[0]["global_step"] == 8
        assert ckpt.read_meta(partial)[0]["global_step"] == 16
        partial.rename(last)
        _assert_loads(last, second)


def test_flipped_byte_in_a_shard_is_refused(saved, tmp_path):
    folder = copy_folder(saved[0], tmp_path)
    metadata = FileSystemReader(str(folder)).read_metadata()
    table = max((info for index, info in metadata.storage_data.items()
                 if index.fqn.startswith("model.") and "embedding_bags" in index.fqn), key=lambda info: info.length)
    shard = folder / table.relative_path
    data = bytearray(shard.read_bytes())
    data[table.offset + table.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{re.escape(table.relative_path)} is corrupt: sha256"):
        ckpt.read_meta(folder)


def test_shards_of_another_save_are_refused(saved, tmp_path):
    """What an in-place save killed midway used to leave: new shards under old metadata."""
    folder = copy_folder(saved[0], tmp_path)
    for name in [".metadata"] + [p.name for p in saved[1].glob("*.distcp")]:
        shutil.copy(saved[1] / name, folder / name)
    with pytest.raises(CheckpointError, match=r"does not match its checksums"):
        ckpt.read_meta(folder)


def test_a_missing_file_is_refused(saved, tmp_path):
    folder = copy_folder(saved[0], tmp_path)
    (folder / "rng.rank0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rng\.rank0\.pt is missing"):
        ckpt.read_meta(folder)


def test_a_record_of_another_format_is_refused(saved, tmp_path):
    folder = copy_folder(saved[0], tmp_path)
    record = json.loads((folder / META_FILE).read_text())
    (folder / META_FILE).write_text(json.dumps({**record, "format": "sparselift-dcp-1"}))
    with pytest.raises(CheckpointError, match="unknown checkpoint format 'sparselift-dcp-1'"):
        ckpt.read_meta(folder)
