"""The workload on ``world`` ranks: tables placed by TorchRec's planner for that world size and the
profile's topology (on meta, no processes), and the lifted graph of that placement (the lifter's
own layout derivation, :func:`~lightning_sparselift.frontend.lift.lift_placement`), every rank
seeing the workload's inputs at its batch.

The planner is offered the sharding types the lifted executor runs: table-wise, column-wise,
row-wise and data-parallel (not table-row-wise: TorchRec builds its sharding from the node's process
groups, which a world that never ran does not have; across nodes it keeps TorchRec's path, which
the step-time model does not price). Its cost is bounded: TorchRec's estimator prices every shard of
an option one by one, and row-wise and data-parallel options have ``world`` shards (replicas), so
they are offered while ``tables x world`` stays within :data:`ESTIMATES` (26 tables with them: 15 s
on 512 ranks, 32 s on 1,024 here), beyond only to a table no rank can hold; with table- and
column-wise options 1,000 tables on 1,024 ranks place in 4 s. Placements are cached per (tables,
world, topology, batch) within a process.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.simulate.profile import HardwareProfile

if TYPE_CHECKING:
    from lightning_sparselift.simulate.workload import Workload

_PLACEMENTS: dict[str, Any] = {}
_GREEDY_TABLES = 64  # beyond: TorchRec's uniform proposer only
ESTIMATES = 4096  # tables x world up to which row-wise and data-parallel are offered to every table
_STATE_BYTES = 2  # bytes of a table row per its float32 weights: the weights and the optimizer's state (Adam: 3)


def offered_types(rows: int, dim: int, world: int, tables: int, profile: HardwareProfile) -> list[str]:
    """The sharding types the planner may give a table of ``rows x dim``, one of ``tables``, on
    ``world`` ranks."""
    kinds = ["table_wise", "column_wise"]
    if tables * world <= ESTIMATES:
        return kinds + ["row_wise", "data_parallel"]
    if rows * dim * 4 * _STATE_BYTES > profile.device.memory_gib * 2**30 * 0.5:
        kinds.append("row_wise")  # (no rank holds it in half its memory)
    return kinds


def place(workload: Workload, world: int, batch_per_rank: int, profile: HardwareProfile) -> Any:
    """TorchRec's ``ShardingPlan`` of the workload's tables on ``world`` ranks of ``profile``."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.proposers import UniformProposer
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig

    from lightning_sparselift.sharding import describe_tables, find_sparse_modules, sharder_for
    from lightning_sparselift.torchrec_parts import DenseAndInputReservation

    tables = describe_tables(workload.model)
    key = hashlib.sha256(json.dumps([sorted((t, i.num_embeddings, i.embedding_dim) for t, i in tables.items()), world,
                                     batch_per_rank, profile.ranks_per_node, profile.device.kind,
                                     profile.device.memory_gib]).encode()).hexdigest()
    if key in _PLACEMENTS:
        return _PLACEMENTS[key]
    constraints = {t: ParameterConstraints(sharding_types=offered_types(i.num_embeddings, i.embedding_dim, world,
                                                                        len(tables), profile))
                   for t, i in tables.items()}
    memory = round(profile.device.memory_gib * 2**30)
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world, local_world_size=min(world, profile.ranks_per_node),
                                     **({"hbm_cap_bytes": memory} if profile.device.kind == "cuda"
                                        else {"ddr_cap_bytes": memory})),
        kernel_config=KernelConfig(compute_device=profile.device.kind))
    # (TorchRec's greedy proposer partitions one proposal per table option over every rank)
    proposer = None if len(tables) <= _GREEDY_TABLES else UniformProposer()
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_per_rank, constraints=constraints,
                                       proposer=proposer, debug=False, storage_reservation=DenseAndInputReservation())
    modules = find_sparse_modules(workload.model)
    quiet = logging.getLogger("torchrec.distributed.planner")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # (its per-plan stats tables)
    try:
        plan = planner.plan(workload.model, list({type(m): sharder_for(m) for m in modules.values()}.values()))
    finally:
        quiet.setLevel(level)
    _PLACEMENTS[key] = plan
    return plan


def scaled_graph(workload: Workload, world: int, batch_per_rank: int, profile: HardwareProfile) -> SparseGraph:
    """The identity graph of the workload on ``world`` ranks in TorchRec's placement, each rank with
    ``batch_per_rank`` samples; generated lookup kernels counted as available (the
    GPU path's Triton kernels, the CPU path's C++ ones)."""
    from lightning_sparselift.frontend.lift import lift_placement

    plan = place(workload, world, batch_per_rank, profile)
    captures = [workload.capture_at(r, world, batch_per_rank) for r in range(world)]
    backend = "nccl" if profile.device.kind == "cuda" else "gloo"
    graph = lift_placement(workload.model, plan, workload.module_paths, captures, world, profile.device.kind,
                           backend if world > 1 else "none", workload.dense_param_bytes)
    threads = max(1, round(profile.device.concurrent_lookups))
    graph.threads_per_rank = [threads] * world
    for m in graph.modules:
        # every rank sees the same inputs: one object for all (a copy of the graph copies it once)
        m.ids_per_step = [m.ids_per_step[0]] * world
        for g in m.lifted_groups:
            g.lookup_kernels = ["torchrec", "generated"]
    return graph
