"""Each rank's state that DCP's shards leave out: its random number generators, its optimizers'
hyper-parameters and its fbgemm table batches' iteration counters (files named in
:mod:`~lightning_sparselift.checkpoint.layout`), saved and restored by that rank."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_sparselift.checkpoint.folder import CheckpointError
from lightning_sparselift.checkpoint.layout import param_groups_file, rng_file, steps_file


# ---------------------------------------------------------------------- random number generators
def save_rng(folder: Path, rank: int) -> None:
    torch.save(_rng_state(), rng_file(folder, rank))


def restore_rng(path: Path, rank: int) -> None:
    file = rng_file(path, rank)
    if file.exists():
        _set_rng_state(torch.load(file, weights_only=True))
    else:
        warnings.warn(f"{file.name} is missing (the checkpoint was saved by fewer ranks, or before checkpoints held "
                      f"generator states): this rank's random number generators are not restored", RuntimeWarning)


def _rng_state() -> dict[str, Any]:
    """This process's random number generators as tensors and numbers (loadable weights-only)."""
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
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    np.random.set_state(("MT19937", saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                         saved["cached_gaussian"]))
    python = state["python"]
    random.setstate((python["version"], tuple(int(v) for v in python["state"]), python["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------- optimizer hyper-parameters
def save_param_groups(folder: Path, rank: int, optimizer: Any) -> None:
    """``optimizer`` is the strategy's CombinedOptimizer: its optimizers' groups, by key."""
    groups = {key: _hyperparameters(opt) for key, opt in optimizer.optimizers}
    param_groups_file(folder, rank).write_text(json.dumps(groups))


def restore_param_groups(path: Path, rank: int, optimizer: Any, dense_only: bool) -> None:
    groups_file = param_groups_file(path, rank)
    if not groups_file.exists():
        raise FileNotFoundError(f"{groups_file} is missing: the checkpoint was saved by a different world size")
    saved_groups = json.loads(groups_file.read_text())
    for key, opt in optimizer.optimizers:
        if dense_only and key != "dense":
            continue
        groups = saved_groups.get(key)
        if groups is None or len(groups) != len(opt.param_groups):
            raise ValueError(f"checkpoint {path}: optimizer {key!r} has {len(opt.param_groups)} param groups "
                             f"here but {None if groups is None else len(groups)} in the checkpoint")
        for group, saved in zip(opt.param_groups, groups):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})


def _hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                       if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))})
    return groups


# ---------------------------------------------------------------------- table batches' iteration counters
def save_steps(folder: Path, rank: int, dmp: nn.Module) -> None:
    steps_file(folder, rank).write_text(json.dumps({name: int(m.iter.item())
                                                     for name, m in _table_batches(dmp).items()}))


def restore_steps(path: Path, rank: int, dmp: nn.Module) -> None:
    file = steps_file(path, rank)
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
