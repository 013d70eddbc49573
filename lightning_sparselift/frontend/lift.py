"""Lifting: a sharded model's sparse path as a :class:`~lightning_sparselift.ir.SparseGraph`.

TorchRec runs each sharded EmbeddingBagCollection or EmbeddingCollection as one opaque call.
:func:`lift` rebuilds it as plain data: per module, its sharding groups (one per sharding type, as
TorchRec groups them) with the exact layout the executor needs (feature order, features per rank,
row blocks, output dims per rank, column order), and the identity schedule (TorchRec's own step).
The layout is derived from public TorchRec structure (the ShardingPlan, the tables' configs,
``create_grouped_sharding_infos`` / ``create_embedding_bag_sharding`` /
``create_embedding_sharding``);
:func:`~lightning_sparselift.frontend.check.check_against_runtime` cross-checks it against the
sharded module's own attributes. Anything not understood raises :class:`LiftError` naming the
module, so the strategy can fall back to TorchRec's path.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import nn

from lightning_sparselift.frontend.capture import RankCapture, common_path
from lightning_sparselift.ir.graph import (
    LiftedModule, OutputBlock, OutputConsumer, ShardingGroup, SparseGraph, TableShard,
)
from lightning_sparselift.ir.schedule import identity_schedule
from lightning_sparselift.ir.vocab import (
    COLUMN_SHARDED, DTYPE_BYTES, INPUT_ALL_TO_ALL, LIFTED_SHARDING_TYPES, POOLED_ALL_TO_ALL, ROW_SHARDED, WIRE_FORMATS,
    WIRE_ROLES,
)


class LiftError(RuntimeError):
    """The sparse path of a module has a structure the lifted executor does not handle."""


def _sharded_types() -> dict[type, bool]:
    """The sharded modules the lifter rebuilds, and whether their lookups pool."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    return {ShardedEmbeddingBagCollection: True, ShardedEmbeddingCollection: False}


def _table_shards(cfg: Any, ps: Any, pooling: str) -> list[TableShard]:
    features = list(cfg.feature_names)
    if ps.sharding_type == "data_parallel":
        return [TableShard(cfg.name, None, cfg.num_embeddings, cfg.embedding_dim, 0, 0, ps.compute_kernel, pooling,
                           features)]
    shards = []
    for meta in ps.sharding_spec.shards:
        shards.append(TableShard(cfg.name, meta.placement.rank(), int(meta.shard_sizes[0]), int(meta.shard_sizes[1]),
                                 int(meta.shard_offsets[0]), int(meta.shard_offsets[1]), ps.compute_kernel, pooling,
                                 features))
    return shards


def _column_order(sharding: Any) -> list[int]:
    """Column permutation that puts each table's column shards together in offset order, as
    TorchRec's column-wise output dist does after its all-to-all; [] when it is the identity."""
    names = sharding.uncombined_embedding_names()
    dims = sharding.uncombined_embedding_dims()
    metas = sharding.embedding_shard_metadata()
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        first.setdefault(name, i)
    order = sorted(range(len(names)), key=lambda i: (first[names[i]], metas[i].shard_offsets[1] if metas[i] else 0))
    starts = [sum(dims[:i]) for i in range(len(dims))]
    columns = [c for i in order for c in range(starts[i], starts[i] + dims[i])]
    return [] if columns == list(range(len(columns))) else columns


def _shardings(sharded: nn.Module, plan: dict[str, Any], env: Any, device: torch.device, pooled: bool
               ) -> Iterator[tuple[str, list[Any], Any]]:
    """TorchRec's sharding of each group (sharding type, its tables' sharding infos, the
    EmbeddingSharding), built as TorchRec's sharded module builds them, from a meta copy of the
    unsharded module."""
    if pooled:
        from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection as Sharded
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        meta = EmbeddingBagCollection(tables=list(sharded._embedding_bag_configs), is_weighted=sharded._is_weighted,
                                      device=torch.device("meta"))
        for sharding_type, infos in Sharded.create_grouped_sharding_infos(meta, plan, "embedding_bags.", None).items():
            yield sharding_type, infos, Sharded.create_embedding_bag_sharding(infos, env, device,
                                                                              permute_embeddings=True)
    else:
        from torchrec.distributed.embedding import ShardedEmbeddingCollection as Sharded
        from torchrec.modules.embedding_modules import EmbeddingCollection

        meta = EmbeddingCollection(tables=list(sharded._embedding_configs), device=torch.device("meta"))
        for sharding_type, infos in Sharded.create_grouped_sharding_infos(meta, plan, None).items():
            yield sharding_type, infos, Sharded.create_embedding_sharding(sharding_type, infos, env, device)


def _configs(sharded: nn.Module, pooled: bool) -> list[Any]:
    return list(sharded._embedding_bag_configs if pooled else sharded._embedding_configs)


def _row_widths(path: str, sharding_type: str, tables: list[TableShard], world: int) -> list[int]:
    """EmbeddingCollection: the width of the rows each rank looks up (TorchRec views every rank's
    lookup output of a group as rows of one width)."""
    widths = {t.dim for t in tables}
    if len(widths) != 1:
        raise LiftError(f"{path}: {sharding_type} shards of widths {sorted(widths)}: TorchRec's sequence lookups "
                        f"take one width per group")
    return [widths.pop()] * world


def _column_shard_order(configs: list[Any], plan: dict[str, Any]) -> dict[str, list[int]]:
    """EmbeddingCollection, column-wise: per output key, where each column shard (in shard order)
    sits among the rows the ranks return in rank order (TorchRec's features_to_permute_indices;
    a feature read by several tables is keyed ``feature@table``)."""
    readers: dict[str, int] = {}
    for cfg in configs:
        for f in cfg.feature_names:
            readers[f] = readers.get(f, 0) + 1
    out = {}
    for cfg in configs:
        if plan[cfg.name].sharding_type != "column_wise":
            continue
        ranks = list(plan[cfg.name].ranks)
        by_rank: dict[int, list[int]] = {}
        for i, r in enumerate(sorted(ranks)):
            by_rank.setdefault(r, []).append(i)
        order = [by_rank[r].pop(0) for r in ranks]
        for f in cfg.feature_names:
            out[f"{f}@{cfg.name}" if readers[f] > 1 else f] = order
    return out


def _lift_groups(path: str, sharded: nn.Module, module_plan: Any, env: Any, device: torch.device, pooled: bool
                 ) -> list[ShardingGroup]:
    plan = dict(module_plan)
    groups = []
    by_name = {c.name: c for c in _configs(sharded, pooled)}
    world = env.world_size
    for index, (sharding_type, infos, sharding) in enumerate(_shardings(sharded, plan, env, device, pooled)):
        table_names = [i.embedding_config.name for i in infos]
        tables = []
        for info in infos:
            cfg = by_name[info.embedding_config.name]
            pooling = (cfg.pooling.name if hasattr(cfg.pooling, "name") else str(cfg.pooling)) if pooled else "NONE"
            tables.extend(_table_shards(cfg, plan[cfg.name], pooling))
        features = list(sharding.feature_names())
        reason = _not_lifted(sharding_type, table_names, sharding, world)
        if reason and not pooled:
            # (TorchRec's sequence output dist needs every group's context: an EmbeddingCollection
            # keeps TorchRec's path as a whole module)
            raise LiftError(f"{path}: {reason}, so this module keeps TorchRec's path")
        if reason:
            groups.append(ShardingGroup(index, sharding_type, features, [], [], [], [],
                                        list(sharding.embedding_names()), list(sharding.embedding_dims()), tables,
                                        not_lifted=reason))
            continue
        features_per_rank: list[int] = []
        block_sizes: list[int] = []
        dim_sum_per_rank: list[int] = []
        output_blocks: list[list[OutputBlock]] = []
        column_order: list[int] = []
        if sharding_type in POOLED_ALL_TO_ALL:
            features_per_rank = list(sharding.features_per_rank())
        if not pooled and sharding_type in INPUT_ALL_TO_ALL:
            dim_sum_per_rank = _row_widths(path, sharding_type, tables, world)
        elif sharding_type in POOLED_ALL_TO_ALL:
            names_per_rank = sharding.embedding_names_per_rank()
            dims = sharding.uncombined_embedding_dims() if sharding_type in COLUMN_SHARDED else sharding.embedding_dims()
            table_of = {f: t.table for t in tables for f in t.features}
            start = 0
            for names in names_per_rank:
                dim_sum_per_rank.append(sum(dims[start:start + len(names)]))
                output_blocks.append([OutputBlock(table_of[n], int(d)) for n, d in zip(names, dims[start:start + len(names)])])
                start += len(names)
            if sharding_type in COLUMN_SHARDED:
                column_order = _column_order(sharding)
        if sharding_type in ROW_SHARDED:
            rows = {}
            for info in infos:
                for feature in info.embedding_config.feature_names:
                    rows[feature] = info.embedding_config.num_embeddings
            block_sizes = [(rows[f] + world - 1) // world for f in features]
        groups.append(ShardingGroup(index, sharding_type, features, features_per_rank, block_sizes, dim_sum_per_rank,
                                    column_order, list(sharding.embedding_names()), list(sharding.embedding_dims()),
                                    tables, output_blocks=output_blocks))
    if all(g.not_lifted for g in groups):
        raise LiftError(f"{path}: {'; '.join(g.not_lifted for g in groups)}, so this module keeps TorchRec's path")
    return groups


def _not_lifted(sharding_type: str, tables: list[str], sharding: Any, world: int) -> str:
    """Why the lifted executor cannot run this group ("": it can)."""
    if sharding_type not in LIFTED_SHARDING_TYPES:
        return (f"sharding type {sharding_type!r} (tables {tables}) is not supported by the lifted executor; "
                f"supported: {LIFTED_SHARDING_TYPES}")
    if sharding_type == "table_row_wise" and sharding._local_size != world:
        return (f"table_row_wise tables {tables} span {world // sharding._local_size} hosts of "
                f"{sharding._local_size} ranks; the lifted executor runs table_row_wise on one host only (its "
                f"exchanges are then row-wise's)")
    return ""


def _module_inputs(path: str, captures: list[RankCapture]) -> tuple[list[str], bool, str, str, list[int]]:
    seen = [c.modules.get(path) for c in captures]
    missing = [c.rank for c, m in zip(captures, seen) if m is None]
    if missing:
        raise LiftError(f"{path}: no input was captured on rank(s) {missing} (the module did not run in the "
                        f"captured training steps)")
    first = seen[0]
    for m in seen[1:]:
        if (m.keys, m.weighted, m.lengths_dtype, m.values_dtype) != (first.keys, first.weighted, first.lengths_dtype,
                                                                      first.values_dtype):
            raise LiftError(f"{path}: ranks see different input structures: {first.keys} {first.weighted} vs "
                            f"{m.keys} {m.weighted}")
    return first.keys, first.weighted, first.lengths_dtype, first.values_dtype, [m.batch_size for m in seen]


def dense_parameter_bytes(model: nn.Module, module_paths: list[str]) -> int:
    """Bytes of the trainable parameters outside the sharded modules (what DDP all-reduces)."""
    def sparse(name: str) -> bool:
        return any(f"{p}." in f".{name}" or name.startswith(f"{p}.") for p in module_paths)

    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad and not sparse(n))


def _next_batch_source(captured: list[Any]) -> tuple[Optional[list[list[Any]]], str]:
    """Where a module's input is in the batch the loop announces as next (every rank's capture),
    or None and why that batch cannot stand for the next step's input."""
    source = common_path([m.batch_input for m in captured])
    if source is None:
        return None, "the module's input was not found in the training step's batch on every rank (the model builds it)"
    if max(m.calls_per_step for m in captured) > 1:
        return None, "the module ran more than once in a training step"
    checks = [e for m in captured for e in m.announced_exact]
    if False in checks:
        return None, ("the batch the training loop announced as next differed from the features the module received "
                      "(something between the data loader and the model changes them)")
    if True not in checks:
        return None, "the training loop announced no next batch during capture (needs >= 2 captured steps)"
    return source, ""


def lift(model: nn.Module, sharding_plan: Any, module_paths: list[str], captures: list[RankCapture],
         process_group: Any, device: torch.device, dense_param_bytes: int = 0) -> SparseGraph:
    """The SRSV of the sharded modules at ``module_paths`` (paths in ``model``), in the order
    their forwards ran in the captured steps. A module the lifter cannot rebuild keeps TorchRec's
    path (``SparseGraph.not_lifted``, with the reason); :class:`LiftError` when none can be lifted."""
    from torchrec.distributed.types import ShardingEnv

    env = ShardingEnv.from_process_group(process_group)
    backend = str(torch.distributed.get_backend(process_group)) if env.world_size > 1 else "none"
    return _lift_all(model, sharding_plan, module_paths, captures, env, device, dense_param_bytes, backend,
                     _sharded_types())


def lift_placement(model: nn.Module, sharding_plan: Any, module_paths: list[str], captures: list[RankCapture],
                   world_size: int, device_type: str, backend: str, dense_param_bytes: int = 0) -> SparseGraph:
    """The graph :func:`lift` would give for ``model``'s unsharded modules placed by
    ``sharding_plan`` on ``world_size`` ranks, from ``captures`` (one per rank): the same layout
    derivation, with no process group (the simulator's graphs at world sizes that never ran)."""
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    env = ShardingEnv(world_size=world_size, rank=0, pg=None)
    return _lift_all(model, sharding_plan, module_paths, captures, env, torch.device("meta"), dense_param_bytes,
                     backend, {EmbeddingBagCollection: True, EmbeddingCollection: False}, device_type)


def _lift_all(model: nn.Module, sharding_plan: Any, module_paths: list[str], captures: list[RankCapture], env: Any,
              device: torch.device, dense_param_bytes: int, backend: str, types: dict[type, bool],
              device_type: Optional[str] = None) -> SparseGraph:
    import fbgemm_gpu
    import torchrec

    ran = [p for p in captures[0].modules if p in module_paths]
    order = ran + [p for p in module_paths if p not in ran]
    modules, not_lifted = [], {}
    for path in order:
        try:
            modules.append(_lift_module(model, path, sharding_plan, captures, env, device, types))
        except LiftError as error:
            not_lifted[path] = str(error)
    if not modules:
        raise LiftError("; ".join(not_lifted.values()))
    versions = {"torch": torch.__version__, "torchrec": getattr(torchrec, "__version__", "?"),
                "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?")}
    return SparseGraph(env.world_size, backend, modules, dense_param_bytes, versions, not_lifted=not_lifted,
                       threads_per_rank=[c.threads for c in sorted(captures, key=lambda c: c.rank)],
                       device=device_type or device.type)


def _lift_module(model: nn.Module, path: str, sharding_plan: Any, captures: list[RankCapture], env: Any,
                 device: torch.device, types: dict[type, bool]) -> LiftedModule:
    world = env.world_size
    sharded = model.get_submodule(path)
    pooled = types.get(type(sharded))
    if pooled is None:
        raise LiftError(f"{path}: {type(sharded).__name__} is not a plain "
                        f"{' or '.join(t.__name__ for t in types)}; the lifted executor handles only those module "
                        f"types (this module keeps TorchRec's path)")
    wire = _wire(path, sharded)
    if not pooled:
        for flag, what in (("_need_indices", "need_indices=True (ids returned with the embeddings)"),
                           ("_use_index_dedup", "index deduplication"),
                           ("enable_embedding_update", "tables with enable_embedding_update")):
            if getattr(sharded, flag, False):
                raise LiftError(f"{path}: an EmbeddingCollection with {what} is not supported by the lifted executor")
    keys, weighted, lengths_dtype, values_dtype, batch_sizes = _module_inputs(path, captures)
    if {lengths_dtype, values_dtype} - set(DTYPE_BYTES):
        raise LiftError(f"{path}: input dtypes {lengths_dtype}/{values_dtype} are not ones the graph knows")
    root_input = common_path([c.modules[path].root_input for c in captures])
    batch_input, next_batch_note = _next_batch_source([c.modules[path] for c in captures])
    is_weighted = bool(sharded._is_weighted) if pooled else False
    if weighted != is_weighted:
        raise LiftError(f"{path}: the module is {'weighted' if is_weighted else 'unweighted'} but its captured input "
                        f"{'has' if weighted else 'has no'} weights")
    groups = _lift_groups(path, sharded, sharding_plan.plan[path], env, device, pooled)
    names = [f for g in groups for f in g.features]
    unknown = sorted(set(names) - set(keys))
    if unknown:
        raise LiftError(f"{path}: features {unknown} of the tables are missing from the input KJT keys {keys}")
    # TorchRec skips the permute when the keys already are in group order: an EBC only when they are exactly its
    # features, an EC also when its features are the first keys (the split then takes them, the rest is ignored)
    feature_order = [keys.index(f) for f in names]
    if names == keys or (not pooled and feature_order == list(range(len(names)))):
        feature_order = []
    # (as TorchRec decides it: by the pooling of the row-wise tables' configs)
    plan = sharding_plan.plan[path]
    row_wise = [c for c in _configs(sharded, pooled) if plan[c.name].sharding_type in ROW_SHARDED]
    mean_after_reduce = pooled and any(c.pooling.value == "MEAN" for c in row_wise)
    reduce_sum_features = [f for c in row_wise if c.pooling.value == "SUM" for f in c.feature_names] if pooled else []
    ids = [{k: c.modules[path].features[k].ids_per_step for k in keys} for c in captures]
    percentiles = {k: captures[0].modules[path].features[k].percentiles for k in keys}
    schedule = identity_schedule([g.kind for g in groups], world, bool(feature_order), pooled)
    consumer, consumer_note = _consumer([c.modules[path] for c in captures], pooled)
    return LiftedModule(path, keys, weighted, lengths_dtype, values_dtype, feature_order, groups, batch_sizes,
                        ids, percentiles, schedule, root_input=root_input, batch_input=batch_input,
                        next_batch_note=next_batch_note, mean_after_reduce=mean_after_reduce,
                        reduce_sum_features=reduce_sum_features, pooled=pooled,
                        column_shard_order={} if pooled else _column_shard_order(_configs(sharded, False), plan),
                        consumer=consumer, consumer_note=consumer_note, wire=wire)


def _wire(path: str, sharded: nn.Module) -> dict[str, str]:
    """The format on the wire of each output collective that TorchRec's quantized communication
    encodes (by role; the others exchange float32). FP16 and BF16 (loss scale included) act value
    by value; INT8 quantizes rows of 32 values of the send buffer as laid out, which the lifted
    all-to-alls reproduce exchange by exchange (aggregation then leaves them apart; on a row-wise
    reduce-scatter TorchRec's own path fails under it, in the capture steps); LiftError for the
    others (MX4, FP8)."""
    wire = {}
    for op, codecs in (getattr(sharded, "qcomm_codecs_registry", None) or {}).items():
        for role, codec in zip(WIRE_ROLES.get(op, ()), (codecs.forward, codecs.backward)):
            name = codec._comm_precision.name.lower()
            if name == "fp32":
                continue
            if name not in WIRE_FORMATS:
                raise LiftError(f"{path}: TorchRec's quantized communication encodes its {role.replace('_', ' ')} "
                                f"exchange as {name.upper()}, which the lifted executor does not apply (it applies "
                                f"FP16, BF16 and INT8); this module keeps TorchRec's path")
            wire[role] = name
    return wire


def _consumer(captured: list[Any], pooled: bool) -> tuple[Optional[OutputConsumer], str]:
    """The model's concatenation of the pooled output, when every rank saw the same one."""
    if not pooled:
        return None, "an EmbeddingCollection's output is a JaggedTensor per feature, read by position"
    found = [m.consumer for m in captured]
    if found[0] is not None and all(f == found[0] for f in found):
        keys, before, after = found[0]
        return OutputConsumer(keys, before, after), ""
    notes = [m.consumer_note for m in captured if m.consumer_note]
    return None, notes[0] if notes else "the ranks' models concatenated the pooled values differently"
