"""What must match for a checkpoint to load into this model.

The model must be the same: its tables and dense shapes (its fingerprint). The sharding plan may
differ, since DCP reshards weights; fused embedding optimizer state cannot be resharded, so a
changed plan raises unless ``allow_optimizer_state_reset`` is set, in which case that state
starts fresh.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torch import nn

from lightning_sparselift.sharding import dense_state_dict


def model_fingerprint(dmp: nn.Module, tables: dict[str, Any], sparse_prefixes: list[str]) -> dict[str, Any]:
    """What must match for a checkpoint to belong to this model: tables and dense shapes."""
    return {
        "tables": {name: [t.num_embeddings, t.embedding_dim] for name, t in sorted(tables.items())},
        "dense": {k: list(v.shape) for k, v in sorted(dense_state_dict(dmp, sparse_prefixes).items())},
    }


def check_same_model(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    if saved != current:
        raise ValueError(f"checkpoint {path} was saved from a different model:\n{_describe_mismatch(saved, current)}")


def _describe_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str:
    lines = []
    for kind in ("tables", "dense"):
        a, b = saved.get(kind, {}), current.get(kind, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                lines.append(f"  {kind} {key}: checkpoint {a.get(key)} vs model {b.get(key)}")
    return "\n".join(lines[:20]) + ("\n  ..." if len(lines) > 20 else "")


def resets_embedding_state(path: Path, saved_plan: dict[str, Any], plan: dict[str, Any],
                           allow_optimizer_state_reset: bool) -> bool:
    """Whether the fused embedding optimizer state starts fresh (the plan changed and that is
    allowed); a changed plan that is not allowed raises."""
    if saved_plan == plan:
        return False
    changed = sorted(k for k in set(saved_plan) | set(plan) if saved_plan.get(k) != plan.get(k))
    if not allow_optimizer_state_reset:
        raise ValueError(
            f"checkpoint {path} was saved with a different sharding plan (tables {changed[:8]}). Table weights "
            f"can be resharded, fused embedding optimizer state cannot. Pass "
            f"SparseLiftStrategy(allow_optimizer_state_reset=True) to load the weights and restart that state.")
    warnings.warn(f"sharding plan changed for {changed[:8]}: embedding optimizer state starts fresh", RuntimeWarning)
    return True
