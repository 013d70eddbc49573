"""Checkpoint folders for the tests: saved and loaded in one process by the package's own steps
(what ``SparseLiftStrategy`` does on each rank, here with one rank and no process group), and
crafted ones that carry code."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from lightning_sparselift.checkpoint import compatibility
from lightning_sparselift.checkpoint import folder as checkpoint_folder
from lightning_sparselift.checkpoint import io as ckpt
from lightning_sparselift.checkpoint.layout import META_FILE

# DCP without a process group saves and loads in this process, and says so on every call
NO_PROCESS_GROUP_WARNING = "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"


class TinyModel(nn.Module):
    """A table (``embedding_bags``) and a dense layer (``dense_arch``), as the tests find them by name."""

    def __init__(self, seed: int):
        super().__init__()
        self.embedding_bags = nn.EmbeddingBag(200, 8)
        self.dense_arch = nn.Linear(8, 1)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))


def save(path: Path, model: nn.Module, step: int) -> None:
    """``SparseLiftStrategy.save_checkpoint`` on one rank, without an optimizer."""
    target, folder = checkpoint_folder.start_save(path)
    ckpt.write_shards(folder, model, None, rank=0)
    ckpt.commit(folder, target, {"global_step": step}, compatibility.model_fingerprint(model, {}, []), {},
                has_optimizer=False)


def load(path: Path, model: nn.Module) -> dict[str, Any]:
    """``SparseLiftStrategy.load_checkpoint`` on one rank: Lightning's state; the weights go into ``model``."""
    lightning_state, info = ckpt.read_meta(path)
    ckpt.load(path, model, None, info, 0, compatibility.model_fingerprint(model, {}, []), {},
              allow_optimizer_state_reset=False)
    return lightning_state


def copy_folder(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


class RunsCode:
    """Unpickling this creates ``marker``: it stands for any code a crafted checkpoint could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def checksum_like_an_attacker(folder: Path) -> None:
    meta = json.loads((folder / META_FILE).read_text())
    meta["checksums"] = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in meta["checksums"]}
    (folder / META_FILE).write_text(json.dumps(meta))


def forge_dcp_value(folder: Path, payload: bytes) -> None:
    """Declares a dense weight as a pickled value (DCP unpickles those) stored in a new file."""
    metadata = FileSystemReader(str(folder)).read_metadata()
    fqn = next(k for k in metadata.state_dict_metadata if k.startswith("model.") and "dense_arch" in k)
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != fqn}
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo("forged.distcp", 0, len(payload))
    (folder / "forged.distcp").write_bytes(payload)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
