"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a folder:
- DCP shards of ``{"model": DMP.state_dict(), "optimizer": CombinedOptimizer.state_dict()}``
  (sharded tables, dense weights, fused embedding and dense optimizer state);
- ``param_groups.rank<R>.json``: each rank's optimizer hyper-parameters (learning rates, ...),
  which TorchRec's ``KeyedOptimizer.state_dict()`` leaves out and which differ per rank for the
  fused tables;
- ``sparselift.meta.pt`` (rank 0): Lightning's own state (loops, schedulers, callbacks,
  hyper-parameters), the model fingerprint and the sharding plan summary.

Weights can be loaded into a different sharding plan (DCP reshards them). Fused embedding
optimizer state cannot be resharded: loading a checkpoint whose plan differs raises unless
``allow_optimizer_state_reset`` is set, in which case that state starts fresh.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

META_FILE = "sparselift.meta.pt"
FORMAT = "sparselift-dcp-1"


def _param_groups_file(path: Path, rank: int) -> Path:
    return path / f"param_groups.rank{rank}.json"


def _hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                       if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))})
    return groups


def model_fingerprint(dmp: nn.Module, tables: dict[str, Any], sparse_prefixes: list[str]) -> dict[str, Any]:
    """What must match for a checkpoint to belong to this model: tables and dense shapes."""
    from lightning_sparselift.launcher import dense_state_dict

    return {
        "tables": {name: [t.num_embeddings, t.embedding_dim] for name, t in sorted(tables.items())},
        "dense": {k: list(v.shape) for k, v in sorted(dense_state_dict(dmp, sparse_prefixes).items())},
    }


def plan_summary(plan: Any) -> dict[str, Any]:
    out = {}
    for module_path, module_plan in sorted(plan.plan.items()):
        for table, ps in sorted(module_plan.items()):
            shards = None
            if ps.sharding_spec is not None and hasattr(ps.sharding_spec, "shards"):
                shards = [[list(s.shard_offsets), list(s.shard_sizes), str(s.placement)] for s in ps.sharding_spec.shards]
            out[f"{module_path}.{table}"] = {"sharding_type": ps.sharding_type, "ranks": ps.ranks, "shards": shards}
    return out


def _describe_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str:
    lines = []
    for kind in ("tables", "dense"):
        a, b = saved.get(kind, {}), current.get(kind, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                lines.append(f"  {kind} {key}: checkpoint {a.get(key)} vs model {b.get(key)}")
    return "\n".join(lines[:20]) + ("\n  ..." if len(lines) > 20 else "")


def save(path: Path, dmp: nn.Module, optimizer: Optional[Any], lightning_state: dict[str, Any], rank: int,
         fingerprint: dict[str, Any], plan: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"model": dmp.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
        _param_groups_file(path, rank).write_text(json.dumps(_per_optimizer_groups(optimizer)))
    dcp.save(state, checkpoint_id=str(path))
    if rank == 0:
        meta = dict(lightning_state)
        meta["sparselift"] = {"format": FORMAT, "fingerprint": fingerprint, "plan": plan,
                              "has_optimizer": optimizer is not None}
        torch.save(meta, path / META_FILE)


def _per_optimizer_groups(optimizer: Any) -> dict[str, list[dict[str, Any]]]:
    return {key: _hyperparameters(opt) for key, opt in optimizer.optimizers}


def read_meta(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    meta_file = path / META_FILE
    if not meta_file.exists():
        raise FileNotFoundError(f"{path} is not a SparseLift checkpoint (no {META_FILE}); SparseLiftStrategy saves "
                                f"and loads sharded checkpoint folders written by itself")
    meta = torch.load(meta_file, weights_only=bool(weights_only), map_location="cpu")
    if meta.get("sparselift", {}).get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {meta.get('sparselift', {}).get('format')!r}")
    return meta


def load(path: Path, dmp: nn.Module, optimizer: Optional[Any], meta: dict[str, Any], rank: int,
         fingerprint: dict[str, Any], plan: dict[str, Any], allow_optimizer_state_reset: bool) -> None:
    info = meta["sparselift"]
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
    if load_optimizer:
        if reset_embedding_state:
            dense = dict(optimizer.optimizers)["dense"]
            dense.load_state_dict({"state": {k[len("dense."):]: v for k, v in state["optimizer"]["state"].items()}})
        else:
            optimizer.load_state_dict(state["optimizer"])
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
