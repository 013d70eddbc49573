"""Loading a checkpoint runs no code from it: a crafted folder (with checksums that match, as an
attacker would write them) is refused before anything in it is unpickled beyond plain data."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from checkpoint_folders import (
    NO_PROCESS_GROUP_WARNING, RunsCode, TinyModel, checksum_like_an_attacker, copy_folder, forge_dcp_value, save,
)
from lightning_sparselift.checkpoint import CheckpointError
from lightning_sparselift.checkpoint import io as ckpt
from lightning_sparselift.checkpoint.layout import LEGACY_META_FILE, META_FILE, TENSORS_FILE

# torch's weights-only loader warns about the crafted payload's pickle protocol before refusing it
pytestmark = [pytest.mark.filterwarnings(NO_PROCESS_GROUP_WARNING),
              pytest.mark.filterwarnings("ignore:Detected pickle protocol 4 in the checkpoint:UserWarning")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint; tests change copies only."""
    path = tmp_path_factory.mktemp("saved") / "epoch=0-step=8.ckpt"
    save(path, TinyModel(0), 8)
    return path


@pytest.mark.parametrize("crafted", ["legacy metadata", "tensors file", "dcp metadata", "dcp value"])
def test_crafted_checkpoint_cannot_run_code(crafted, saved, tmp_path):
    folder = copy_folder(saved, tmp_path)
    marker = tmp_path / "code-ran"
    payload = pickle.dumps(RunsCode(marker))
    if crafted == "legacy metadata":
        (folder / META_FILE).unlink()
        (folder / LEGACY_META_FILE).write_bytes(payload)
        expected = r"sparselift\.meta\.pt\) is a pickle: unpickling a file runs any code"
    elif crafted == "tensors file":
        (folder / TENSORS_FILE).write_bytes(payload)
        expected = r"sparselift\.tensors\.pt holds more than plain tensors and is refused"
    elif crafted == "dcp metadata":
        (folder / ".metadata").write_bytes(payload)
        expected = r"\.metadata is not plain DCP metadata and is refused"
    else:
        forge_dcp_value(folder, payload)
        expected = r"forged\.distcp: value .* is not plain data and is refused"
    if crafted != "legacy metadata":
        checksum_like_an_attacker(folder)
    with pytest.raises(CheckpointError, match=expected):
        ckpt.read_meta(folder)
    assert not marker.exists()
