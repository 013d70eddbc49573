"""A checkpoint folder's commit protocol and checksums: plain filesystem code.

A save is atomic: every rank writes into a new sibling folder ``<name>.partial-<id>``; rank 0
then checksums it, writes the commit record and renames it to ``<name>`` (an existing checkpoint
there is first renamed to ``<name>.old-<id>`` and deleted afterwards). A crash leaves either the
previous or the new checkpoint under ``<name>``, or, between the two renames, no ``<name>`` and a
load error naming both leftovers. A load first checks every file against its checksum and refuses
torn (no commit record) or corrupt folders, naming the file. All ranks share the filesystem (as
DCP's resharding load needs), so rank 0 alone hashes every file, streaming it, once all ranks
have written theirs, and alone verifies them on load (sha256 runs at about 1.5 GB/s: well under a
second for a few hundred MB); the strategy tells the other ranks the outcome.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from lightning_sparselift.checkpoint.layout import DCP_METADATA, FORMAT, LEGACY_META_FILE, META_FILE

_CHUNK = 4 << 20


class CheckpointError(ValueError):
    """A checkpoint folder that is refused: missing, torn, corrupt, unsafe or of an unknown format."""


# ---------------------------------------------------------------------------------------- save
def start_save(path: Path) -> tuple[Path, Path]:
    """``path`` and the new folder every rank writes its save into (rank 0 calls this; the
    strategy shares its answer, so all ranks agree on the name)."""
    if path.is_file():
        raise FileExistsError(f"{path} is a file; SparseLift checkpoints are folders")
    if path.is_dir() and not _replaceable(path):
        raise FileExistsError(f"{path} is a folder that is not a SparseLift checkpoint; refusing to replace it")
    return path, _sibling(path, "partial")


def _replaceable(folder: Path) -> bool:
    """Empty, or a checkpoint (ours, an older one, or a torn one: DCP's ``.metadata`` is there)."""
    names = {p.name for p in folder.iterdir()}
    return not names or bool(names & {META_FILE, LEGACY_META_FILE, DCP_METADATA})


def commit(folder: Path, path: Path, sections: dict[str, Any]) -> None:
    """Rank 0, once every file is in ``folder``: checksums, the commit record (the format, the
    checksums and ``sections``), and the rename to ``path``. Files are flushed to disk before the
    rename, so the previous checkpoint is deleted only once the new one is durable."""
    checksums = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        checksums[file.relative_to(folder).as_posix()] = _sha256(file)
        _fsync(file)
    record = {"format": FORMAT, "checksums": checksums, **sections}
    (folder / META_FILE).write_text(json.dumps(record, indent=1))
    _fsync(folder / META_FILE)
    _fsync(folder)
    previous = _move_aside(path) if os.path.lexists(path) else None
    os.rename(folder, path)
    _fsync(path.parent)
    if previous is not None:
        _delete(previous)


def remove(path: Path) -> None:
    """Deletes a checkpoint; it leaves its name first, so a crash midway leaves no half-deleted
    folder under that name."""
    if os.path.lexists(path):
        _delete(_move_aside(path))


def _sibling(path: Path, kind: str) -> Path:
    return path.with_name(f"{path.name}.{kind}-{uuid.uuid4().hex[:12]}")


def _move_aside(path: Path) -> Path:
    aside = _sibling(path, "old")
    os.rename(path, aside)
    return aside


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    """Flushes a file, or a folder's entries, to disk (Linux syncs through a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):  # a filesystem that cannot sync this (some FUSE)
            raise
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- load
def read_record(path: Path) -> dict[str, Any]:
    """Rank 0: the commit record of the checkpoint at ``path``, once every file is the one its
    save wrote."""
    record = _read_commit_record(path)
    _verify_checksums(path, record["checksums"])
    return record


def _read_commit_record(path: Path) -> dict[str, Any]:
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(_why_not_committed(path))
    try:
        record = json.loads(meta_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{meta_file} is not valid JSON: {error}") from error
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else None
        raise CheckpointError(f"{path}: unknown checkpoint format {found!r} (this version reads {FORMAT!r})")
    if not isinstance(record.get("checksums"), dict):
        raise CheckpointError(f"{meta_file} is malformed: no checksums")
    return record


def _why_not_committed(path: Path) -> str:
    if not os.path.lexists(path):
        leftovers = sorted(p.name for p in path.parent.glob("*")
                           if p.name.startswith((f"{path.name}.old-", f"{path.name}.partial-")))
        if leftovers:
            return (f"{path} does not exist: a save into it was interrupted while replacing the previous "
                    f"checkpoint. Left over next to it: {leftovers} ('.old-': the previous checkpoint, "
                    f"'.partial-': the new one, complete if it has {META_FILE}); rename the one to keep to "
                    f"{path.name!r}")
        return f"{path} does not exist"
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    if LEGACY_META_FILE in names:
        return (f"{path} was saved by an older SparseLift, whose metadata ({LEGACY_META_FILE}) is a pickle: "
                f"unpickling a file runs any code it contains, so it is refused (it is never unpickled, "
                f"whatever weights_only says). This version reads checkpoints with JSON metadata ({META_FILE}) "
                f"only; train again or resume with the version that wrote it")
    if DCP_METADATA in names or any(name.endswith(".distcp") for name in names):
        return (f"{path} is a torn checkpoint: it has DCP shards but no {META_FILE}, which a save writes "
                f"last, so its save was interrupted; load an earlier checkpoint")
    return (f"{path} is not a SparseLift checkpoint (no {META_FILE}); SparseLiftStrategy saves and loads "
            f"sharded checkpoint folders written by itself")


def _verify_checksums(path: Path, checksums: dict[str, str]) -> None:
    problems = []
    for name, expected in sorted(checksums.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif (actual := _sha256(file)) != expected:
            problems.append(f"{file} is corrupt: sha256 {actual}, its save recorded {expected}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its checksums ({len(problems)} file(s)):\n  "
                              + "\n  ".join(problems[:20]))
