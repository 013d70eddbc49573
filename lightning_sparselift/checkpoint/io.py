"""Saving and loading a sharded checkpoint with ``torch.distributed.checkpoint`` (DCP): the steps
``SparseLiftStrategy`` calls, as Lightning's ``CheckpointIO`` keeps a checkpoint's I/O apart from
the strategy.

:func:`save`: rank 0 names the new folder (:func:`~lightning_sparselift.checkpoint.folder.start_save`),
every rank writes its part (:func:`write_shards`), rank 0 adds Lightning's state and commits the
folder (:func:`commit`). :func:`restore`: rank 0 checks the folder and reads the metadata
(:func:`read_meta`), every rank reads its part (:func:`load`). Rank 0's outcome, result or error,
reaches every rank (``Ranks.on_rank_zero``).

Nothing in a checkpoint is unpickled beyond plain data: the metadata is JSON
(:mod:`~lightning_sparselift.checkpoint.state_json`), and every pickle is read safely first
(:mod:`~lightning_sparselift.checkpoint.safe_load`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_sparselift.checkpoint import rank_state
from lightning_sparselift.checkpoint.compatibility import check_same_model, resets_embedding_state
from lightning_sparselift.checkpoint.folder import CheckpointError, read_record, start_save
from lightning_sparselift.checkpoint.folder import commit as commit_folder
from lightning_sparselift.checkpoint.layout import META_FILE, TENSORS_FILE
from lightning_sparselift.checkpoint.safe_load import check_dcp_files, load_plain_tensors
from lightning_sparselift.checkpoint.state_json import StateEncoder, decode_state


class Ranks(Protocol):
    """What saving and restoring need of the training's processes (the strategy has it)."""

    global_rank: int

    def on_rank_zero(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def barrier(self, name: Optional[str] = None) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


def save(ranks: Ranks, filepath: Path, checkpoint: dict[str, Any], dmp: nn.Module, optimizer: Optional[Any],
         fingerprint: dict[str, Any], plan: dict[str, Any]) -> None:
    """Every rank writes into a new folder named by rank 0, which renames it into place once complete."""
    path, folder = ranks.on_rank_zero(start_save, filepath)
    lightning_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    write_shards(folder, dmp, optimizer, ranks.global_rank)
    ranks.barrier()  # every rank's files are on disk before rank 0 checksums them
    ranks.on_rank_zero(commit, folder, path, lightning_state, fingerprint, plan, optimizer is not None)


def restore(ranks: Ranks, filepath: Path, dmp: nn.Module, optimizer: Optional[Any], fingerprint: dict[str, Any],
            plan: dict[str, Any], allow_optimizer_state_reset: bool) -> dict[str, Any]:
    """Lightning's state (its ``state_dict`` empty: the weights are loaded into ``dmp`` here)."""
    path = Path(ranks.broadcast(str(filepath)))
    lightning_state, info = ranks.on_rank_zero(read_meta, path)
    load(path, dmp, optimizer, info, ranks.global_rank, fingerprint, plan, allow_optimizer_state_reset)
    lightning_state["state_dict"] = {}
    return lightning_state


# ---------------------------------------------------------------------------------------- save
def write_shards(folder: Path, dmp: nn.Module, optimizer: Optional[Any], rank: int) -> None:
    """Every rank: its DCP shards, optimizer hyper-parameters and iteration counters, and random
    number generators."""
    folder.mkdir(parents=True, exist_ok=True)
    rank_state.save_rng(folder, rank)
    state: dict[str, Any] = {"model": dmp.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        rank_state.save_param_groups(folder, rank, optimizer)
        rank_state.save_steps(folder, rank, dmp)
    dcp.save(state, checkpoint_id=str(folder))


def commit(folder: Path, path: Path, lightning_state: dict[str, Any], fingerprint: dict[str, Any],
           plan: dict[str, Any], has_optimizer: bool) -> None:
    """Rank 0, once every rank's shards are in ``folder``: Lightning's state and ours as JSON
    (their tensors in the tensors file), then the commit (checksums, commit record, rename to
    ``path``)."""
    encoder = StateEncoder()
    lightning = encoder.encode(lightning_state, "checkpoint")
    sparselift = encoder.encode({"fingerprint": fingerprint, "plan": plan, "has_optimizer": has_optimizer},
                                "sparselift")
    if encoder.dropped:
        warnings.warn(f"checkpoint {path}: left out {', '.join(encoder.dropped)}: the metadata holds only JSON "
                      f"values, tuples and tensors (other objects would have to be pickled, and unpickling can "
                      f"run code), so these are not restored on resume", RuntimeWarning)
    torch.save(encoder.tensors, folder / TENSORS_FILE)
    commit_folder(folder, path, {"sparselift": sparselift, "lightning": lightning})


# ---------------------------------------------------------------------------------------- load
def read_meta(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0: Lightning's state and our section of the checkpoint at ``path``, once every file is
    the one its save wrote and nothing in it can run code when DCP reads it."""
    record = read_record(path)
    check_dcp_files(path)
    tensors = load_plain_tensors(path / TENSORS_FILE)
    try:
        return decode_state(record["lightning"], tensors), decode_state(record["sparselift"], tensors)
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path / META_FILE} is malformed: {error!r}") from error


def load(path: Path, dmp: nn.Module, optimizer: Optional[Any], info: dict[str, Any], rank: int,
         fingerprint: dict[str, Any], plan: dict[str, Any], allow_optimizer_state_reset: bool) -> None:
    """Every rank, after :func:`read_meta`: weights, optimizer state and hyper-parameters."""
    check_same_model(path, info["fingerprint"], fingerprint)
    state: dict[str, Any] = {"model": dmp.state_dict()}
    load_optimizer = optimizer is not None and info["has_optimizer"]
    reset_embedding_state = load_optimizer and resets_embedding_state(path, info["plan"], plan,
                                                                      allow_optimizer_state_reset)
    if load_optimizer:
        _initialize_lazy_state(optimizer)
        opt_state = optimizer.state_dict()
        if reset_embedding_state:
            opt_state = {"state": {k: v for k, v in opt_state["state"].items() if k.startswith("dense.")}}
        state["optimizer"] = opt_state
    dcp.load(state, checkpoint_id=str(path))
    dmp.load_state_dict(state["model"])
    rank_state.restore_rng(path, rank)
    if load_optimizer:
        if reset_embedding_state:
            dense = dict(optimizer.optimizers)["dense"]
            dense.load_state_dict({"state": {k[len("dense."):]: v for k, v in state["optimizer"]["state"].items()}})
        else:
            optimizer.load_state_dict(state["optimizer"])
            rank_state.restore_steps(path, rank, dmp)
        rank_state.restore_param_groups(path, rank, optimizer, dense_only=reset_embedding_state)


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
