"""The process side of the strategy: launching the rank processes, the process groups (the
training's and the step checks' own), and the collectives Lightning asks a strategy for. Nothing
here knows about sharding or the compiler (``strategy.py``)."""

from __future__ import annotations

import atexit
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection, _distributed_is_initialized, _get_default_process_group_backend_for_device,
    _init_dist_connection, _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_sparselift.lightning import console
from lightning_sparselift.lightning.launcher import DenseOnlyMultiProcessingLauncher

START_METHODS = ("popen", "spawn", "fork")


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device over gloo or NCCL, started by re-running the script (``popen``, like
    DDP), ``spawn`` or ``fork``, or by torchrun / SLURM; plus a process group of its own for the
    checks made at every step (:attr:`check_group`)."""

    def __init__(self, timeout: Union[float, timedelta], process_group_backend: Optional[str],
                 start_method: Literal["popen", "spawn", "fork"], accelerator: Optional[Accelerator],
                 parallel_devices: Optional[list[torch.device]], cluster_environment: Optional[ClusterEnvironment],
                 checkpoint_io: Optional[CheckpointIO], precision_plugin: Optional[Precision]) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._process_group_backend = process_group_backend
        self._start_method = start_method
        self.check_group: Any = None  # created with the process group (setup_environment)
        self.num_nodes = 1

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Under torchrun, SLURM, ... the rank processes exist already: as with popen, this launcher
        # then only checks the settings against the environment and starts nothing (the fork/spawn
        # launchers would start every rank again inside each rank).
        if self._start_method == "popen" or self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = DenseOnlyMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        console.install()  # in every rank process: the library warnings we cannot avoid
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        initialized = _distributed_is_initialized()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        if not initialized and self._process_group_backend != "nccl":  # (Lightning registers it for NCCL)
            # a gloo group left to the interpreter's finalization can abort the process at exit
            # ("terminate called without an active exception"): destroy it while Python is alive
            atexit.register(_destroy_dist_connection)
        # The checks of every step (inputs compared across ranks, non-finite values) get their own
        # process group: collectives on one group run in order, and on the training group they
        # would wait behind the next batch's input all-to-alls that latency hiding leaves in flight.
        self.check_group = torch.distributed.new_group(backend=self._process_group_backend, timeout=self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def on_rank_zero(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run by rank 0; every rank returns its result or raises its error (a rank
        raising alone would leave the others waiting in the next collective)."""
        outcome: tuple[Any, Optional[Exception]] = (None, None)
        if self.is_global_zero:
            try:
                outcome = (fn(*args), None)
            except Exception as error:
                outcome = (None, error)
        result, error = self.broadcast(outcome)
        if error is not None:
            raise error
        return result

    @override
    def model_to_device(self) -> None:
        # Tables are created by the sharding on the right device; the dense part moves there in setup.
        pass

    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None):
        return nullcontext()

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
