"""The systems the benchmark compares, all on the same model shape, data and process group.

Every system trains the same scenario (same dense modules, same batches) and exposes
``step()`` (one full training step) plus the hook points the stage timer needs. Data is
prepared before timing: a step never generates or slices data. One file per family:
``base`` (the environment and :class:`~.base.System`), ``dlrm_baseline``, ``torchrec``,
``dense_only``, ``sparselift`` (with its ablations) and ``lightning`` (``Trainer.fit``'s, which
the runner drives); here, the registry by name.
"""

from __future__ import annotations

from lightning_sparselift.bench.systems.base import System
from lightning_sparselift.bench.systems.dense_only import DenseOnly
from lightning_sparselift.bench.systems.dlrm_baseline import DLRMBaseline
from lightning_sparselift.bench.systems.lightning import LIGHTNING_SYSTEM
from lightning_sparselift.bench.systems.sparselift import (
    ABLATIONS, UNCALIBRATED, SparseLift, SparseLiftFast, SparseLiftQComm,
)
from lightning_sparselift.bench.systems.torchrec import TorchRecBase, TorchRecMX4, TorchRecQComm, TorchRecSparseDist

# the systems a step loop runs, by name (the Lightning one is run by the runner's Trainer.fit)
SYSTEMS: dict[str, type[System]] = {cls.name: cls for cls in (DLRMBaseline, TorchRecBase, TorchRecSparseDist,
                                                              TorchRecQComm, TorchRecMX4, DenseOnly, SparseLift,
                                                              SparseLiftQComm, SparseLiftFast, *UNCALIBRATED,
                                                              *ABLATIONS)}
ALL_SYSTEMS = [*SYSTEMS, LIGHTNING_SYSTEM]
