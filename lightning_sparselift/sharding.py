"""Placement of embedding tables: TorchRec's planner where it can, a constructed plan where it
cannot (row-wise on CPU, which the planner refuses there); the tables built with the embedding
optimizer (:mod:`~lightning_sparselift.embedding_optimizer`) fused into their backward."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from lightning_sparselift.embedding_optimizer import EmbeddingOptimizer
from lightning_sparselift.ir.vocab import SHARDING_TYPES

# The planner never proposes these on CPU; we build their plan ourselves.
_CONSTRUCTED_ON_CPU = ("row_wise", "table_row_wise")

@dataclass
class TableInfo:
    module_path: str
    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: list[str] = field(default_factory=list)
    # the ids the module accepts are [0, id_bound): the rows, or a managed-collision module's raw
    # input range (it remaps them to rows)
    id_bound: int = 0
    managed_collision: bool = False
    data_type: str = "FP32"  # TorchRec's DataType name of the weights

    @property
    def half(self) -> bool:
        return self.data_type in ("FP16", "BF16")


def _sharders() -> dict[type, type]:
    """TorchRec's sparse module types the strategy shards, each with TorchRec's sharder."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection,
    )

    return {EmbeddingBagCollection: EmbeddingBagCollectionSharder, EmbeddingCollection: EmbeddingCollectionSharder,
            FeatureProcessedEmbeddingBagCollection: FeatureProcessedEmbeddingBagCollectionSharder,
            ManagedCollisionEmbeddingBagCollection: ManagedCollisionEmbeddingBagCollectionSharder,
            ManagedCollisionEmbeddingCollection: ManagedCollisionEmbeddingCollectionSharder}


def sharder_for(module: nn.Module) -> Any:
    return _sharders()[type(module)]()


def find_sparse_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every TorchRec sparse module of ``model`` (the outermost one: a feature-processed or
    managed-collision collection's own collection is sharded with it)."""
    kinds = tuple(_sharders())
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if any(path.startswith(f"{p}.") for p in found):
            continue
        if type(module) in kinds:
            found[path] = module
    return found


def dense_state_dict(module: nn.Module, sparse_prefixes: list[str]) -> dict[str, torch.Tensor]:
    """Plain-tensor entries of ``module.state_dict()`` outside the embedding modules."""
    return {k: v for k, v in module.state_dict().items()
            if type(v) is torch.Tensor and not any(k == p or k.startswith(p + ".") for p in sparse_prefixes)}


def _tables_module(module: nn.Module) -> nn.Module:
    """The collection that owns the tables: the module itself, or the collection a
    feature-processed / managed-collision collection wraps."""
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    if isinstance(module, FeatureProcessedEmbeddingBagCollection):
        return module._embedding_bag_collection
    if isinstance(module, BaseManagedCollisionEmbeddingCollection):
        return module._embedding_module
    return module


def table_configs(module: nn.Module) -> list[Any]:
    """The table configs of a sparse module (EmbeddingBagConfig or EmbeddingConfig)."""
    from torchrec.modules.embedding_modules import EmbeddingCollection

    tables = _tables_module(module)
    return list(tables.embedding_configs() if isinstance(tables, EmbeddingCollection)
                else tables.embedding_bag_configs())


def table_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The tables' parameters (what the fused optimizer updates; a feature processor's own
    parameters stay with the dense optimizer)."""
    return list(_tables_module(module).parameters())


def _id_bounds(module: nn.Module) -> dict[str, int]:
    """Per table of a managed-collision collection, the raw ids it accepts ([0, bound)): its
    managed-collision module's input range, remapped to rows by the module."""
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    if not isinstance(module, BaseManagedCollisionEmbeddingCollection):
        return {}
    managers = module._managed_collision_collection._managed_collision_modules
    return {name: int(manager.input_size()) for name, manager in managers.items()}


def describe_tables(model: nn.Module) -> dict[str, TableInfo]:
    """Every table of every sparse module, by table name (names must be unique)."""
    tables: dict[str, TableInfo] = {}
    for path, module in find_sparse_modules(model).items():
        bounds = _id_bounds(module)
        for cfg in table_configs(module):
            if cfg.name in tables:
                raise ValueError(f"table name {cfg.name!r} is used by both {tables[cfg.name].module_path!r} and "
                                 f"{path!r}; sharding plans address tables by name, so names must be unique")
            tables[cfg.name] = TableInfo(path, cfg.name, cfg.num_embeddings, cfg.embedding_dim,
                                         list(cfg.feature_names), bounds.get(cfg.name, cfg.num_embeddings),
                                         cfg.name in bounds, cfg.data_type.name)
    return tables


def validate_sharding_types(sharding_types: Optional[dict[str, str]], tables: dict[str, TableInfo],
                            offered: dict[str, list[str]]) -> dict[str, str]:
    """``sharding_types`` checked against the model's ``tables`` and the types TorchRec's sharder
    of each table's module ``offered`` (by module path)."""
    if not sharding_types:
        return {}
    unknown_tables = sorted(set(sharding_types) - set(tables))
    if unknown_tables:
        raise ValueError(f"sharding_types names table(s) {unknown_tables} that the model does not have; "
                         f"its tables are {sorted(tables)}")
    for table, kind in sharding_types.items():
        if kind not in SHARDING_TYPES:
            raise ValueError(f"unknown sharding type {kind!r} for table {table!r}; choose one of {SHARDING_TYPES}")
        module = tables[table].module_path
        if kind not in offered[module]:
            raise ValueError(f"sharding type {kind!r} (table {table!r}): TorchRec's sharder of the module {module!r} "
                             f"offers {offered[module]}")
        if kind == "data_parallel" and tables[table].half:
            why = _HALF_DATA_PARALLEL.format(data_type=tables[table].data_type)
            raise ValueError(f"sharding type 'data_parallel' (table {table!r}): {why}; choose another sharding type "
                             f"for it")
    return dict(sharding_types)


# why a table in half precision is not made data-parallel (TorchRec's planner would, for a small one)
_HALF_DATA_PARALLEL = ("a data-parallel table is a plain parameter that the dense optimizer updates in the table's own "
                       "dtype ({data_type}), with no fused update and no fp32 optimizer state (Adam's state underflows "
                       "to inf/NaN in fp16)")


def build_sharding_plan(model: nn.Module, sharders: list[Any], world_size: int, device_type: str,
                        sharding_types: dict[str, str], process_group: Any, batch_size: Optional[int] = None) -> Any:
    """A TorchRec ``ShardingPlan`` for every sparse module in ``model``.

    Tables listed in ``sharding_types`` get that type; the others are left to TorchRec's
    planner. On CPU the planner cannot place row-wise or table-row-wise tables, so when any is
    requested the whole plan is constructed: requested types as given (a table-row-wise table on
    the least loaded host, hosts as TorchRec's process groups count them), other tables
    table-wise on the least loaded rank (by rows x dim).
    """
    from torchrec.distributed.comm import get_topology_group_world_size
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, data_parallel, row_wise, table_row_wise, table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    from lightning_sparselift.torchrec_parts import DenseAndInputReservation, planner_topology

    tables = describe_tables(model)
    constructed = device_type == "cpu" and any(k in _CONSTRUCTED_ON_CPU for k in sharding_types.values())
    if not constructed:
        constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in sharding_types.items()}
        # (see _HALF_DATA_PARALLEL: the planner makes small tables data-parallel)
        modules = find_sparse_modules(model)
        constraints.update({t: ParameterConstraints(sharding_types=[
            k for k in sharder_for(modules[info.module_path]).sharding_types(device_type) if k != "data_parallel"])
            for t, info in tables.items() if info.half and t not in sharding_types})
        planner = EmbeddingShardingPlanner(
            topology=planner_topology(world_size, device_type),
            batch_size=batch_size, constraints=constraints, debug=False,
            storage_reservation=DenseAndInputReservation(),
        )
        try:
            if process_group is not None and world_size > 1:
                return planner.collective_plan(model, sharders, process_group)
            return planner.plan(model, sharders)
        except PlannerError as error:
            pinned = f"sharding_types={sharding_types}" if sharding_types else "no sharding_types"
            raise ValueError(f"TorchRec's planner found no sharding plan for the tables {sorted(tables)} on "
                             f"{world_size} {device_type} rank(s) ({pinned}): {error}. Pin a sharding type per table "
                             f"with SparseLiftStrategy(sharding_types={{table: type}}).") from error

    # ranks per host matter to table-row-wise tables only (TorchRec's lookup of it logs warnings
    # when the environment does not say)
    local_size = get_topology_group_world_size(world_size) if "table_row_wise" in sharding_types.values() else world_size
    load = [0.0] * world_size
    generators: dict[str, dict[str, Any]] = {}
    for name, info in sorted(tables.items(), key=lambda kv: (-kv[1].num_embeddings * kv[1].embedding_dim, kv[0])):
        kind = sharding_types.get(name, "table_wise")
        if kind == "table_wise":
            rank = min(range(world_size), key=lambda r: (load[r], r))
            load[rank] += info.num_embeddings * info.embedding_dim
            gen = table_wise(rank=rank)
        elif kind == "column_wise":
            if info.embedding_dim % world_size:
                raise ValueError(f"table {name!r} (embedding_dim {info.embedding_dim}): sharding type 'column_wise' "
                                 f"next to row-wise tables on CPU splits its columns evenly over the {world_size} "
                                 f"ranks (TorchRec's CPU planner cannot place row-wise tables, so the plan is "
                                 f"constructed), and {info.embedding_dim} columns do not split in {world_size}; pin "
                                 f"another type for it in sharding_types, or use a world size that divides its "
                                 f"dimension")
            gen = column_wise(ranks=list(range(world_size)))
        elif kind == "row_wise":
            gen = row_wise()
        elif kind == "table_row_wise":
            hosts = [range(h * local_size, (h + 1) * local_size) for h in range(world_size // local_size)]
            host = min(range(len(hosts)), key=lambda h: (sum(load[r] for r in hosts[h]), h))
            for r in hosts[host]:
                load[r] += info.num_embeddings * info.embedding_dim / local_size
            gen = table_row_wise(host_index=host)
        elif kind == "data_parallel":
            gen = data_parallel()
        else:
            raise ValueError(f"table {name!r}: {kind} cannot be combined with row-wise tables on CPU (TorchRec's CPU "
                             f"planner cannot place row-wise tables, so the plan is constructed, and TorchRec has no "
                             f"{kind} plan constructor)")
        generators.setdefault(info.module_path, {})[name] = gen
    modules = find_sparse_modules(model)
    return ShardingPlan(plan={
        path: construct_module_sharding_plan(modules[path], per_param, sharder=sharder_for(modules[path]),
                                             local_size=local_size, world_size=world_size, device_type=device_type)
        for path, per_param in generators.items()
    })


@dataclass
class ShardedModel:
    dmp: nn.Module
    tables: dict[str, TableInfo]
    sparse_module_paths: list[str]


def shard_model(module: nn.Module, world_size: int, device: torch.device, sharding_types: Optional[dict[str, str]],
                embedding_optimizer: EmbeddingOptimizer, process_group: Any, input_check_group: Optional[Any],
                generated_adam: bool = True, qcomms_config: Optional[Any] = None,
                placed_as_exact: bool = False) -> ShardedModel:
    """Shard every TorchRec sparse module of ``module`` (EmbeddingBagCollection,
    EmbeddingCollection, FeatureProcessedEmbeddingBagCollection, the managed-collision
    collections: row-wise, as TorchRec allows) with TorchRec's sharders and
    DistributedModelParallel
    (which also wraps the rest in DDP), with ``embedding_optimizer`` fused into the tables. With
    an ``input_check_group`` every sharded module checks its input (ranks compare on that group,
    over the same ranks as ``process_group``) and fbgemm's lookups skip their own check of the ids;
    None: no checks (fbgemm's stay). ``generated_adam``: Adam on CPU tables runs SparseLift's
    generated kernel (False: TorchRec and fbgemm alone, which have no CPU Adam: ValueError).
    ``qcomms_config``: TorchRec's ``QCommsConfig``, whose codecs TorchRec's sharders apply to the
    output exchanges (its registry for ``device``: on CPU TorchRec turns BF16 into FP16).
    ``placed_as_exact``: TorchRec's planner places the tables as it would without the codecs
    (by default it prices each exchange in its codec's format, which may move a table: under a
    quantized wire a small table can become table-wise where float32 makes it data-parallel, and
    then the tables train with another optimizer); a comparison of wire formats alone needs it."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from lightning_sparselift.initial_tables import built_tables, copy_into_shards
    from lightning_sparselift.torchrec_parts import DenseDataParallelWrapper, register_dense_lookup_autograd

    modules = find_sparse_modules(module)
    # plain weighted EBCs take weights from the batch (a feature-processed one computes its own)
    weighted = {path for path, m in modules.items() if type(m) is EmbeddingBagCollection and m.is_weighted()}
    if not modules:
        raise ValueError(f"SparseLiftStrategy found no torchrec EmbeddingBagCollection or EmbeddingCollection in "
                         f"{type(module).__name__}; it shards recommendation models whose sparse features go through "
                         f"TorchRec's embedding collections")
    tables = describe_tables(module)
    managed = sorted({t.module_path for t in tables.values() if t.managed_collision})
    if managed and device.type == "cpu" and embedding_optimizer.name in ("rowwise_adagrad", "adam"):
        raise ValueError(f"managed-collision collection(s) {managed} with the {embedding_optimizer.name} embedding "
                         f"optimizer on CPU: evicting rows resets their optimizer state with "
                         f"fbgemm::reset_weight_momentum, which fbgemm implements for CUDA only; use sgd or adagrad on "
                         f"CPU (or CUDA devices)")
    check_data_types(tables, device)
    # TorchRec shards managed-collision collections row-wise only: their tables are row-wise unless
    # asked otherwise (which the validation refuses)
    requested = {**{t: "row_wise" for t, info in tables.items() if info.managed_collision}, **(sharding_types or {})}
    # (what the sharder offers on CUDA: on CPU it leaves out the row-wise types, whose plan we construct)
    offered = {path: list(sharder_for(m).sharding_types("cuda")) for path, m in modules.items()}
    checked = validate_sharding_types(requested, tables, offered)
    parameters = [p for m in modules.values() for p in table_parameters(m)]
    values = built_tables(module, parameters)
    embedding_optimizer.apply_in_backward(parameters)
    sharders = sharders_with(modules, quantized_comms(qcomms_config, device))
    planned_with = sharders_with(modules, None) if placed_as_exact else sharders
    plan = build_sharding_plan(module, planned_with, world_size, device.type, checked, process_group)
    if input_check_group is not None:
        _without_lookup_bounds_check(plan)
    register_dense_lookup_autograd()
    with _tables_for(embedding_optimizer, device, generated_adam):
        dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(process_group), device=device,
                                       plan=plan, sharders=sharders, data_parallel_wrapper=DenseDataParallelWrapper())
    copy_into_shards(dmp, values)
    if input_check_group is not None:
        from lightning_sparselift.validation import install_input_checks

        def having(*kinds: str) -> dict[str, tuple[str, ...]]:
            """Per module with tables of these sharding types, their names."""
            found = {path: tuple(sorted(t for t, p in tables_plan.items() if p.sharding_type in kinds))
                     for path, tables_plan in plan.plan.items()}
            return {path: names for path, names in found.items() if names}

        install_input_checks(module, sorted(modules), tables, input_check_group, having("row_wise", "table_row_wise"),
                             set(having("data_parallel")), _pooling_data_parallel(modules, plan), weighted)
    return ShardedModel(dmp, tables, sorted(modules))


def sharders_with(modules: dict[str, nn.Module], codecs: Optional[dict[str, Any]]) -> list[Any]:
    """TorchRec's sharders of ``modules`` with TorchRec's codec registry ``codecs``: one per module
    type, in the order the modules appear (the same list on every rank)."""
    return [cls(qcomm_codecs_registry=codecs) for cls in dict.fromkeys(_sharders()[type(m)] for m in modules.values())]


def quantized_comms(config: Optional[Any], device: torch.device) -> Optional[dict[str, Any]]:
    """TorchRec's codec registry of a ``QCommsConfig`` (None: none, or fp32 both ways)."""
    if config is None:
        return None
    from torchrec.distributed.fbgemm_qcomm_codec import QCommsConfig, get_qcomm_codecs_registry

    if not isinstance(config, QCommsConfig):
        raise TypeError(f"qcomms_config takes TorchRec's QCommsConfig "
                        f"(torchrec.distributed.fbgemm_qcomm_codec), got {type(config).__name__}")
    return get_qcomm_codecs_registry(config, device=device)


def check_data_types(tables: dict[str, TableInfo], device: torch.device) -> None:
    """The tables' weights in a dtype fbgemm trains on ``device``: FP32 and FP16, BF16 on CUDA."""
    trained = ("FP32", "FP16", "BF16") if device.type == "cuda" else ("FP32", "FP16")
    wrong = {name: t.data_type for name, t in tables.items() if t.data_type not in trained}
    if wrong:
        raise ValueError(f"table(s) {wrong} (EmbeddingBagConfig/EmbeddingConfig data_type): fbgemm's training lookups "
                         f"on {device.type} take {', '.join(trained)} weights")


def _tables_for(embedding_optimizer: EmbeddingOptimizer, device: torch.device, generated_adam: bool) -> Any:
    """Where the fused tables are built: fbgemm's module, or for Adam on CPU (which fbgemm's CPU
    module refuses) one keeping Adam's state whose lookups run a generated kernel."""
    if device.type == "cpu" and embedding_optimizer.name == "adam":
        if not generated_adam:
            raise ValueError("embedding optimizer 'adam' on CPU tables: fbgemm's CPU kernels (and so TorchRec's) have "
                             "no Adam; only SparseLift's generated kernel runs it")
        from lightning_sparselift.runtime.codegen.host_adam import host_adam_tables

        return host_adam_tables()
    return contextlib.nullcontext()


def _without_lookup_bounds_check(plan: Any) -> None:
    """fbgemm's table-batched lookups check every id against its table before the lookup (~1 ms
    per step on sparse-heavy); with the input checks installed every id was checked already (on
    every rank, before the input distribution), so the lookups are built without that check."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

    for module_plan in plan.plan.values():
        for parameter_sharding in module_plan.values():
            parameter_sharding.bounds_check_mode = BoundsCheckMode.NONE


def _pooling_data_parallel(modules: dict[str, nn.Module], plan: Any) -> dict[str, frozenset[str]]:
    """Per EmbeddingCollection, the features of its data-parallel tables: on CPU, TorchRec's
    data-parallel lookup (fbgemm's dense table-batched kernel) ignores the collection's
    ``PoolingMode.NONE`` and pools each bag into one row, so only bags of one id come out right."""
    from torchrec.modules.embedding_modules import EmbeddingCollection

    out = {}
    for path, module in modules.items():
        if isinstance(module, EmbeddingCollection):
            features = {f for cfg in module.embedding_configs() if plan.plan[path][cfg.name].sharding_type ==
                        "data_parallel" for f in cfg.feature_names}
            if features:
                out[path] = frozenset(features)
    return out


def plan_summary(plan: Any) -> dict[str, Any]:
    """A TorchRec sharding plan as plain data: per table, its sharding type, ranks and shards
    (what a checkpoint and a plan file record of the placement)."""
    out = {}
    for module_path, module_plan in sorted(plan.plan.items()):
        for table, ps in sorted(module_plan.items()):
            shards = None
            if ps.sharding_spec is not None and hasattr(ps.sharding_spec, "shards"):
                shards = [[list(s.shard_offsets), list(s.shard_sizes), str(s.placement)] for s in ps.sharding_spec.shards]
            out[f"{module_path}.{table}"] = {"sharding_type": ps.sharding_type, "ranks": ps.ranks, "shards": shards}
    return out
