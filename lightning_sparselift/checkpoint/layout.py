"""What a checkpoint folder holds, by file name.

- DCP shards of ``{"model": DMP.state_dict(), "optimizer": CombinedOptimizer.state_dict()}``
  (sharded tables, dense weights, fused embedding and dense optimizer state) and DCP's pickled
  ``.metadata``;
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
  state (loops, schedulers, callbacks, hyper-parameters, epoch/global step, versions) as JSON
  (:mod:`~lightning_sparselift.checkpoint.state_json`).

Older versions pickled the metadata into ``sparselift.meta.pt``; such folders are refused.
"""

from __future__ import annotations

from pathlib import Path

FORMAT = "sparselift-dcp-2"
META_FILE = "sparselift.meta.json"
TENSORS_FILE = "sparselift.tensors.pt"
LEGACY_META_FILE = "sparselift.meta.pt"
DCP_METADATA = ".metadata"


def param_groups_file(path: Path, rank: int) -> Path:
    return path / f"param_groups.rank{rank}.json"


def rng_file(path: Path, rank: int) -> Path:
    return path / f"rng.rank{rank}.pt"


def steps_file(path: Path, rank: int) -> Path:
    return path / f"optimizer_steps.rank{rank}.json"
