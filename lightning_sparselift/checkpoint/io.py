"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), saved atomically and read
without running code.

A checkpoint is a folder:
- DCP shards of ``{"model": DMP.state_dict(), "optimizer": CombinedOptimizer.state_dict()}``
  (sharded tables, dense weights, fused embedding and dense optimizer state);
- ``param_groups.rank<R>.json``: each rank's optimizer hyper-parameters (learning rates, ...),
  which TorchRec's ``KeyedOptimizer.state_dict()`` leaves out and which differ per rank for the
  fused tables;
- ``optimizer_steps.rank<R>.json``: each of the rank's fbgemm table-batched modules' iteration
  counter (by module path), which its fused optimizer reads (Adam's bias corrections) and
  TorchRec's ``state_dict`` leaves out, so a resumed Adam continues its corrections exactly;
- ``rng.rank<R>.pt``: each rank's random number generators (torch, CUDA, numpy, Python) as plain
  tensors and numbers, restored on load, so randomness inside training steps (dropout, a
  managed-collision module re-initialising evicted rows) continues exactly after a resume;
- ``sparselift.tensors.pt`` (rank 0): the tensors inside Lightning's state (callback scores, ...),
  a list read back with ``torch.load(weights_only=True)``;
- ``sparselift.meta.json`` (rank 0, written last: the commit record): the format, a sha256 of
  every other file, our section (model fingerprint, sharding plan summary) and Lightning's own
  state (loops, schedulers, callbacks, hyper-parameters, epoch/global step, versions) as JSON.
  Tuples, dicts with non-string keys and tensors are tagged objects (``{"$sparselift": "tuple",
  ...}``, tensors by index into the tensors file), so they come back exactly; subclasses
  (Lightning's ``AttributeDict``, an ``IntEnum``) come back as their base type. A value that is
  none of these (an arbitrary object) cannot be stored without pickling it: its dict entry is
  left out and the save warns, naming it (raising instead would make a model whose
  hyper-parameters hold, say, a function impossible to checkpoint at all).

Nothing in a checkpoint is unpickled beyond plain data: the metadata is JSON, the tensors file is
loaded weights-only, DCP's own pickled ``.metadata`` is first read with an unpickler that knows
only DCP's metadata classes, and DCP's non-tensor values are checked weights-only before DCP
unpickles them. Metadata pickled by older versions (``sparselift.meta.pt``) is refused.

A save is atomic: every rank writes into a new sibling folder ``<name>.partial-<id>``; rank 0
then checksums it, writes the commit record and renames it to ``<name>`` (an existing checkpoint
there is first renamed to ``<name>.old-<id>`` and deleted afterwards). A crash leaves either the
previous or the new checkpoint under ``<name>``, or, between the two renames, no ``<name>`` and a
load error naming both leftovers. A load first checks every file against its checksum and refuses
torn (no commit record) or corrupt folders, naming the file. All ranks share the filesystem (as
DCP's resharding load needs), so rank 0 alone hashes every file, streaming it, once all ranks
have written theirs, and alone verifies them on load (sha256 runs at about 1.5 GB/s: well under a
second for a few hundred MB); the strategy tells the other ranks the outcome.

Weights can be loaded into a different sharding plan (DCP reshards them). Fused embedding
optimizer state cannot be resharded: loading a checkpoint whose plan differs raises unless
``allow_optimizer_state_reset`` is set, in which case that state starts fresh.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_sparselift.checkpoint.state_json import StateEncoder, decode_state

META_FILE = "sparselift.meta.json"
TENSORS_FILE = "sparselift.tensors.pt"
LEGACY_META_FILE = "sparselift.meta.pt"
FORMAT = "sparselift-dcp-2"
_DCP_METADATA = ".metadata"
_CHUNK = 4 << 20


class CheckpointError(ValueError):
    """A checkpoint folder that is refused: missing, torn, corrupt, unsafe or of an unknown format."""


def _param_groups_file(path: Path, rank: int) -> Path:
    return path / f"param_groups.rank{rank}.json"


def _rng_file(path: Path, rank: int) -> Path:
    return path / f"rng.rank{rank}.pt"


def _steps_file(path: Path, rank: int) -> Path:
    return path / f"optimizer_steps.rank{rank}.json"


def _table_batches(dmp: nn.Module) -> dict[str, nn.Module]:
    """fbgemm's table-batched embedding modules in the model, by path. TorchRec's sharded modules
    keep their lookups in a plain list (``_lookups``), which ``named_modules`` does not reach."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    found = {}
    for path, module in dmp.named_modules():
        lookups = getattr(module, "_lookups", None)
        if not isinstance(lookups, list):
            continue
        for i, lookup in enumerate(lookups):
            for name, m in lookup.named_modules(prefix=f"{path}._lookups.{i}"):
                if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen):
                    found[name] = m
    return found


def _restore_steps(path: Path, rank: int, dmp: nn.Module) -> None:
    file = _steps_file(path, rank)
    modules = _table_batches(dmp)
    if not file.exists():
        if modules:
            warnings.warn(f"{file.name} is missing (the checkpoint was saved before checkpoints held them): the fused "
                          f"embedding optimizers' iteration counters start from 0 (Adam's bias corrections restart)",
                          RuntimeWarning)
        return
    saved = json.loads(file.read_text())
    if saved.keys() != modules.keys():
        raise CheckpointError(f"checkpoint {path}: rank {rank} saved iteration counters for the table-batched modules "
                              f"{sorted(saved)}, this model has {sorted(modules)}")
    for name, module in modules.items():
        module.iter.fill_(saved[name])
        # fbgemm's forward takes its host copy from ``iter`` while that copy is 0
        module.iter_cpu.fill_(0)


def _rng_state() -> dict[str, Any]:
    """This process's random number generators as tensors and numbers (loadable weights-only)."""
    import random

    import numpy as np

    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, python_state, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached)},
             "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    np.random.set_state(("MT19937", saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                         saved["cached_gaussian"]))
    python = state["python"]
    random.setstate((python["version"], tuple(int(v) for v in python["state"]), python["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                       if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))})
    return groups


def model_fingerprint(dmp: nn.Module, tables: dict[str, Any], sparse_prefixes: list[str]) -> dict[str, Any]:
    """What must match for a checkpoint to belong to this model: tables and dense shapes."""
    from lightning_sparselift.lightning.launcher import dense_state_dict

    return {
        "tables": {name: [t.num_embeddings, t.embedding_dim] for name, t in sorted(tables.items())},
        "dense": {k: list(v.shape) for k, v in sorted(dense_state_dict(dmp, sparse_prefixes).items())},
    }


def _describe_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str:
    lines = []
    for kind in ("tables", "dense"):
        a, b = saved.get(kind, {}), current.get(kind, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                lines.append(f"  {kind} {key}: checkpoint {a.get(key)} vs model {b.get(key)}")
    return "\n".join(lines[:20]) + ("\n  ..." if len(lines) > 20 else "")


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
    return not names or bool(names & {META_FILE, LEGACY_META_FILE, _DCP_METADATA})


def write_shards(folder: Path, dmp: nn.Module, optimizer: Optional[Any], rank: int) -> None:
    """Every rank: its DCP shards, optimizer hyper-parameters and iteration counters, and random
    number generators."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), _rng_file(folder, rank))
    state: dict[str, Any] = {"model": dmp.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        _param_groups_file(folder, rank).write_text(json.dumps(_per_optimizer_groups(optimizer)))
        _steps_file(folder, rank).write_text(json.dumps({name: int(m.iter.item())
                                                          for name, m in _table_batches(dmp).items()}))
    dcp.save(state, checkpoint_id=str(folder))


def _per_optimizer_groups(optimizer: Any) -> dict[str, list[dict[str, Any]]]:
    return {key: _hyperparameters(opt) for key, opt in optimizer.optimizers}


def commit(folder: Path, path: Path, lightning_state: dict[str, Any], fingerprint: dict[str, Any],
           plan: dict[str, Any], has_optimizer: bool) -> None:
    """Rank 0, once every rank's shards are in ``folder``: checksums, the commit record, and the
    rename to ``path``. Files are flushed to disk before the rename, so the previous checkpoint is
    deleted only once the new one is durable."""
    encoder = StateEncoder()
    lightning = encoder.encode(lightning_state, "checkpoint")
    sparselift = encoder.encode({"fingerprint": fingerprint, "plan": plan, "has_optimizer": has_optimizer},
                                "sparselift")
    if encoder.dropped:
        warnings.warn(f"checkpoint {path}: left out {', '.join(encoder.dropped)}: the metadata holds only JSON "
                      f"values, tuples and tensors (other objects would have to be pickled, and unpickling can "
                      f"run code), so these are not restored on resume", RuntimeWarning)
    torch.save(encoder.tensors, folder / TENSORS_FILE)
    checksums = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        checksums[file.relative_to(folder).as_posix()] = _sha256(file)
        _fsync(file)
    record = {"format": FORMAT, "checksums": checksums, "sparselift": sparselift, "lightning": lightning}
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
def read_meta(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0: Lightning's state and our section of the checkpoint at ``path``, once every file is
    the one its save wrote and nothing in it can run code when DCP reads it."""
    record = _read_commit_record(path)
    _verify_checksums(path, record["checksums"])
    _check_dcp_files(path)
    try:
        tensors = torch.load(path / TENSORS_FILE, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{path / TENSORS_FILE} holds more than plain tensors and is refused "
                              f"(unpickling it could run code)") from error
    try:
        return decode_state(record["lightning"], tensors), decode_state(record["sparselift"], tensors)
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path / META_FILE} is malformed: {error!r}") from error


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
    if _DCP_METADATA in names or any(name.endswith(".distcp") for name in names):
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


def load(path: Path, dmp: nn.Module, optimizer: Optional[Any], info: dict[str, Any], rank: int,
         fingerprint: dict[str, Any], plan: dict[str, Any], allow_optimizer_state_reset: bool) -> None:
    """Every rank, after :func:`read_meta`: weights, optimizer state and hyper-parameters."""
    if info["fingerprint"] != fingerprint:
        raise ValueError(f"checkpoint {path} was saved from a different model:\n"
                         f"{_describe_mismatch(info['fingerprint'], fingerprint)}")
    state: dict[str, Any] = {"model": dmp.state_dict()}
    load_optimizer = optimizer is not None and info["has_optimizer"]
    reset_embedding_state = False
    if load_optimizer and info["plan"] != plan:
        changed = sorted(k for k in set(info["plan"]) | set(plan) if info["plan"].get(k) != plan.get(k))
        if not allow_optimizer_state_reset:
            raise ValueError(
                f"checkpoint {path} was saved with a different sharding plan (tables {changed[:8]}). Table weights "
                f"can be resharded, fused embedding optimizer state cannot. Pass "
                f"SparseLiftStrategy(allow_optimizer_state_reset=True) to load the weights and restart that state.")
        warnings.warn(f"sharding plan changed for {changed[:8]}: embedding optimizer state starts fresh",
                      RuntimeWarning)
        reset_embedding_state = True
    if load_optimizer:
        _initialize_lazy_state(optimizer)
        opt_state = optimizer.state_dict()
        if reset_embedding_state:
            opt_state = {"state": {k: v for k, v in opt_state["state"].items() if k.startswith("dense.")}}
        state["optimizer"] = opt_state
    dcp.load(state, checkpoint_id=str(path))
    dmp.load_state_dict(state["model"])
    rng = _rng_file(path, rank)
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=True))
    else:
        warnings.warn(f"{rng.name} is missing (the checkpoint was saved by fewer ranks, or before checkpoints held "
                      f"generator states): this rank's random number generators are not restored", RuntimeWarning)
    if load_optimizer:
        if reset_embedding_state:
            dense = dict(optimizer.optimizers)["dense"]
            dense.load_state_dict({"state": {k[len("dense."):]: v for k, v in state["optimizer"]["state"].items()}})
        else:
            optimizer.load_state_dict(state["optimizer"])
            _restore_steps(path, rank, dmp)
        groups_file = _param_groups_file(path, rank)
        if not groups_file.exists():
            raise FileNotFoundError(f"{groups_file} is missing: the checkpoint was saved by a different world size")
        saved_groups = json.loads(groups_file.read_text())
        for key, opt in optimizer.optimizers:
            if reset_embedding_state and key != "dense":
                continue
            groups = saved_groups.get(key)
            if groups is None or len(groups) != len(opt.param_groups):
                raise ValueError(f"checkpoint {path}: optimizer {key!r} has {len(opt.param_groups)} param groups "
                                 f"here but {None if groups is None else len(groups)} in the checkpoint")
            for group, saved in zip(opt.param_groups, groups):
                group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})


def _initialize_lazy_state(optimizer: Any) -> None:
    """Dense optimizers (Adam, ...) create their state on the first step; DCP loads in place,
    so the state must exist first. A zero-gradient step creates it (weights are overwritten by
    the load right after)."""
    dense = dict(optimizer.optimizers).get("dense")
    if dense is not None and len(dense.state) < len([p for p in dense.params.values() if p.requires_grad]):
        saved_grads = {k: p.grad for k, p in dense.params.items()}
        dense.init_state()
        for k, p in dense.params.items():
            p.grad = saved_grads[k]


# --------------------------------------------------------------- DCP's pickles, read safely
_DCP_METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}
_DTYPE_NAMES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """DCP pickles its ``.metadata`` and reads it with plain ``pickle.load``; this unpickler
    builds only DCP's metadata classes, so a file that passes it is safe for DCP to read."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def _check_dcp_files(path: Path) -> None:
    """DCP unpickles its ``.metadata`` with plain pickle (falling back to per-rank
    ``__<rank>.metadata`` files) and its non-tensor values with ``torch.load(weights_only=False)``:
    all of them are read here first, safely, and refused unless they are plain data."""
    for file in sorted(p for p in path.iterdir() if p.name.endswith(_DCP_METADATA)):
        try:
            with open(file, "rb") as f:
                metadata = _DcpMetadataUnpickler(f).load()
            values = [(index.fqn, info) for index, info in metadata.storage_data.items()
                      if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)]
        except Exception as error:
            raise CheckpointError(f"{file} is not plain DCP metadata and is refused (DCP unpickles it, which "
                                  f"could run code)") from error
        for fqn, info in values:
            try:
                with open(path / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
            except Exception as error:
                raise CheckpointError(f"{path / info.relative_path}: value {fqn!r} is not plain data and is refused "
                                      f"(DCP unpickles it, which could run code)") from error
