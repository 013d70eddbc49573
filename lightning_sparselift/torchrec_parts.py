"""The TorchRec pieces that ``sharding.py`` configures explicitly instead of taking TorchRec's
defaults, which warn (deprecations in torch 2.13 / torchrec 1.8): the planner's topology, its
storage reservation and the data-parallel wrapper of the unsharded part; and fbgemm's CPU
data-parallel lookup's dispatch (:func:`register_dense_lookup_autograd`). Each gives what the
default gave. This module imports torchrec; ``sharding.py`` imports it when a model is sharded."""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch
from torch import nn
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner.constants import BIGINT_DTYPE, POOLING_FACTOR
from torchrec.distributed.planner.types import (
    KernelConfig, PlannerError, PlannerErrorType, Storage, StorageReservation, Topology, TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import ShardingEnv, get_tensor_size_bytes


def planner_topology(world_size: int, device_type: str) -> Topology:
    """The planner's view of the ranks: ``world_size`` devices of ``device_type`` with TorchRec's
    default capacities and bandwidths. Made by ``TopologyFactory`` (torchrec 1.8 warns about a
    ``Topology`` constructed directly); without hardware overrides the factory passes the same
    values the constructor defaults to."""
    return TopologyFactory.create_topology(trainer_config=TrainerConfig(world_size=world_size),
                                           kernel_config=KernelConfig(compute_device=device_type))


class DenseAndInputReservation(StorageReservation):
    """The storage the planner keeps free on every device for what it does not place:
    ``percentage`` of HBM, the dense part (its parameters x ``parameter_multiplier`` for the
    parameter, its optimizer state and DDP's buckets, plus its buffers) and a batch's input KJTs
    (int64 ids: pooling factor x batch size per table, 20 copies), on the compute device's memory
    (HBM on GPUs, DDR on CPU).

    These are the amounts of TorchRec's default ``HeuristicalStorageReservation(percentage=0.15)``,
    with the same arithmetic, so the planner places tables as it did with the default
    (``tests/ranks/test_console.py`` compares the reserved topologies). That class warns on every
    construction (FutureWarning) and, without an explicit dense estimate, again when it reserves;
    here the dense estimate is computed from the model's own tensors (the dense part is
    materialized; of tables on meta only the sizes are read)."""

    def __init__(self, percentage: float = 0.15, parameter_multiplier: float = 6.0) -> None:
        if not 0 <= percentage <= 1:
            raise ValueError(f"percentage must be in [0, 1], got {percentage}")
        # attribute names as in TorchRec's reservations: its planner logging and stats read them
        self._percentage = percentage
        self._parameter_multiplier = parameter_multiplier
        self._dense_storage: Optional[Storage] = None
        self._kjt_storage: Optional[Storage] = None
        self._last_reserved_topology: Optional[Topology] = None

    def _size(self, module: nn.Module) -> int:
        # the heuristic's arithmetic, in its order (float sums, rounded per module)
        params = sum([self._parameter_multiplier * get_tensor_size_bytes(p) for p in module.parameters()])
        return round(params + sum([get_tensor_size_bytes(b) for b in module.buffers()]))

    def reserve(self, topology: Topology, batch_size: int, module: nn.Module, sharders: list[Any],
                constraints: Optional[dict[str, Any]] = None) -> Topology:
        by_type = {sharder_name(s.module_type): s for s in sharders}
        shardable: dict[int, nn.Module] = {}
        batch_inputs: list[float] = []

        def visit(m: nn.Module) -> None:
            sharder = by_type.get(sharder_name(type(m)))
            if sharder is None:
                for child in m.children():
                    visit(child)
                return
            shardable[id(m)] = m
            for name in sharder.shardable_parameters(m):
                c = constraints.get(name) if constraints else None
                factors = c.pooling_factors if c else [POOLING_FACTOR]
                sizes = c.batch_sizes if c and c.batch_sizes else [batch_size] * len(factors)
                batch_inputs.extend(f * b for f, b in zip(factors, sizes))

        visit(module)
        dense = self._size(module) - sum([self._size(m) for m in shardable.values()])
        kjt = math.ceil(sum(batch_inputs) * float(BIGINT_DTYPE)) * 20  # 2 pipelined batches x 10 copies
        accelerator = topology.compute_device in ("cuda", "mtia")
        self._dense_storage = Storage(hbm=dense if accelerator else 0, ddr=0 if accelerator else dense, ssd=0)
        self._kjt_storage = Storage(hbm=kjt if accelerator else 0, ddr=0 if accelerator else kjt, ssd=0)
        reserved = copy.deepcopy(topology)
        for device in reserved.devices:
            device.storage.hbm = int((1 - self._percentage) * device.storage.hbm)
            device.storage -= self._dense_storage
            device.storage -= self._kjt_storage
        if any(device.storage.hbm < 0 for device in reserved.devices):
            raise PlannerError(
                error_type=PlannerErrorType.INSUFFICIENT_STORAGE,
                message=f"no HBM is left for embedding tables after reserving {self._percentage:.0%} of it, "
                        f"{dense} bytes for the dense part and {kjt} bytes for the input KJTs on every device")
        self._last_reserved_topology = copy.deepcopy(reserved)
        return reserved

    @property
    def last_reserved_topology(self) -> Optional[Topology]:
        return copy.deepcopy(self._last_reserved_topology)


class DenseDataParallelWrapper(DefaultDataParallelWrapper):
    """TorchRec's default data-parallel wrapper (DDP over the parts of the model that are not
    sharded), without the ``broadcast_buffers=False`` that torch 2.13 deprecates: DDP gets
    ``forward_sync_buffers=False`` (no buffer sync in forward) and the wrapped module's buffers
    among the names it ignores, so that it does not broadcast them at construction either.
    Together that is what ``broadcast_buffers=False`` did: buffers stay each rank's own,
    parameters are broadcast from rank 0 at construction, gradients are all-reduced."""

    def _ddp_wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: Any,
                  ddp_ignore_param_names: set[str]) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if env.process_group is None:
            raise RuntimeError("Can only init DDP for ProcessGroup-based ShardingEnv")
        module = dmp._dmp_wrapped_module
        if not set(dict(dmp.named_parameters())) - ddp_ignore_param_names:
            return  # nothing to make data-parallel (as TorchRec's wrapper)
        ignored = set(ddp_ignore_param_names) | {name for name, _ in module.named_buffers()}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module=module, params_and_buffers_to_ignore=ignored)
        if self._allreduce_comm_precision is not None:
            raise ValueError("DenseDataParallelWrapper does not compress all-reduces")
        dmp._dmp_wrapped_module = DistributedDataParallel(
            module=module.to(device),
            device_ids=None if device.type == "cpu" else [device],
            process_group=env.process_group,
            gradient_as_bucket_view=True,
            forward_sync_buffers=False,
            static_graph=self._static_graph,
            find_unused_parameters=self._find_unused_parameters,
            bucket_cap_mb=self._bucket_cap_mb,
            **self._ddp_kwargs,
        )


_DENSE_LOOKUP = "fbgemm::dense_embedding_codegen_lookup_function"
_DENSE_LOOKUP_LIBRARY: list[Any] = []  # (the registration lives as long as its Library object)


def register_dense_lookup_autograd() -> None:
    """fbgemm's lookup of data-parallel tables on CPU registers its kernel for the CPU dispatch key
    only; that kernel applies its own autograd Function (the gradient is right:
    ``tests/unit/test_dense_lookup.py`` compares it with ``embedding_bag``'s, per-sample weights
    included). With no Autograd kernel, torch's deprecated autograd fallback warns at every
    backward ("an autograd kernel was not registered ... may lead to silently incorrect behavior")
    and then falls through to it. Registering that fallthrough for AutogradCPU is the same dispatch
    without the warning, and keeps it once torch removes the fallback. Idempotent; nothing is
    registered where fbgemm has an AutogradCPU kernel of its own."""
    if _DENSE_LOOKUP_LIBRARY or torch._C._dispatch_has_kernel_for_dispatch_key(_DENSE_LOOKUP, "AutogradCPU"):
        return
    library = torch.library.Library("fbgemm", "IMPL")
    library.impl(_DENSE_LOOKUP.split("::")[1], torch.library.fallthrough_kernel, "AutogradCPU")
    _DENSE_LOOKUP_LIBRARY.append(library)
