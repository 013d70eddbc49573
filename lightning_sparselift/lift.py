"""Lift: the Sparse Resource Semantic View (SRSV) of a sharded model's sparse path.

TorchRec runs each sharded EmbeddingBagCollection as one opaque call. :func:`lift` rebuilds it
as plain data: per module, its sharding groups (one per sharding type, as TorchRec groups them)
with the exact layout the executor needs (feature order, features per rank, row blocks, output
dims per rank, column order), and a graph of the operations one training step runs, each with
its resource semantics: collectives with role, process group, dtype, layout, order and bytes per
member; compute with workload and workspace.

The layout is derived from public TorchRec structure (the ShardingPlan, the tables'
EmbeddingBagConfigs, ``create_grouped_sharding_infos`` / ``create_embedding_bag_sharding``), and
:func:`check_against_runtime` cross-checks it against the sharded module's own (private)
attributes after a warmup step. Anything not understood raises :class:`LiftError` naming the
module, so the strategy can fall back to TorchRec's path.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from torch import nn

from lightning_sparselift.capture import RankCapture, common_path, describe_path
from lightning_sparselift.typed_json import decode

SUPPORTED_SHARDING_TYPES = ("table_wise", "column_wise", "row_wise", "data_parallel")
# sharding types whose features travel to their owners through an all-to-all
_ALL_TO_ALL_INPUT = ("table_wise", "column_wise", "row_wise")
_GRAPH_VERSION = 1
# element sizes of the dtypes a graph names (uint8: byte-packed payloads)
DTYPE_BYTES = {"int32": 4, "int64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1}


class LiftError(RuntimeError):
    """The sparse path of a module has a structure the lifted executor does not handle."""


@dataclass
class TableShard:
    table: str
    rank: Optional[int]  # None: replicated on every rank (data_parallel)
    rows: int
    dim: int
    row_offset: int
    col_offset: int
    kernel: str
    pooling: str


@dataclass
class ShardingGroup:
    """One sharding type of one module: what the executor needs to move its data exactly as
    TorchRec does."""

    index: int
    sharding_type: str
    features: list[str]  # this group's KJT keys in send order (column-wise repeats a feature per shard)
    features_per_rank: list[int]  # keys sent to each rank (all-to-all groups)
    block_sizes: list[int]  # row_wise: rows per bucket, per feature
    dim_sum_per_rank: list[int]  # pooled output columns each rank produces (table/column-wise)
    column_order: list[int]  # output column permutation after the all-to-all; [] = identity
    embedding_names: list[str]
    embedding_dims: list[int]
    tables: list[TableShard]

    def keys_on_rank(self, rank: int) -> list[str]:
        if self.sharding_type == "row_wise":
            return list(self.features)
        start = sum(self.features_per_rank[:rank])
        return self.features[start:start + self.features_per_rank[rank]]


@dataclass
class LiftedModule:
    path: str
    keys: list[str]  # the input KJT's keys, in the order the model passes them
    weighted: bool
    lengths_dtype: str
    values_dtype: str
    feature_order: list[int]  # permutation of the input keys into group order; [] = identity
    groups: list[ShardingGroup]
    batch_size_per_rank: list[int]
    ids_per_step: list[dict[str, float]]  # per member rank, per feature: mean ids per step
    length_percentiles: dict[str, dict[str, float]]  # per feature (member 0): p50/p90/p99 bag length
    aggregated: list[str] = field(default_factory=list)  # collective roles merged across groups (a pass sets it)
    # where the input KJT is when the root forward begins (same on every rank and step), else None
    root_input: Optional[list[list[Any]]] = None
    # where the input KJT is in the training step's batch, when the batch the loop announces as
    # next held exactly the features the module received in every captured step (else None, and
    # next_batch_note says why): the next step's input distribution can then start a step early
    batch_input: Optional[list[list[Any]]] = None
    next_batch_note: str = ""
    schedules: list[str] = field(default_factory=list)  # latency-hiding schedules in use (a pass sets them)

    @property
    def embedding_names(self) -> list[str]:
        return [n for g in self.groups for n in g.embedding_names]

    @property
    def embedding_dims(self) -> list[int]:
        return [d for g in self.groups for d in g.embedding_dims]

    def group_ids(self, member: int, group: ShardingGroup, keys: Optional[list[str]] = None) -> float:
        """Mean ids per step that ``member`` feeds into ``keys`` (default: all of the group's)."""
        stats = self.ids_per_step[member]
        return sum(stats[k] for k in (group.features if keys is None else keys))

    def ids_to_each_rank(self, member: int, group: ShardingGroup, world: int) -> list[float]:
        """Mean ids ``member`` sends to each rank in ``group``'s input all-to-all (row-wise: an
        even split across row blocks, the ids' real spread is data-dependent)."""
        if group.sharding_type == "row_wise":
            return [self.group_ids(member, group) / world] * world
        return [self.group_ids(member, group, group.keys_on_rank(r)) for r in range(world)]


@dataclass
class CollectiveNode:
    id: str
    module: str
    group: Optional[int]
    phase: str  # forward | backward
    op: str  # all_to_all_single | reduce_scatter | all_gather | all_reduce
    role: str
    process_group: str
    dtype: str
    layout: str
    order: int  # position among the step's collectives, identical on every rank
    bytes_per_member: list[int]
    data_dependent: bool  # bytes follow the batch's ids (predicted from the captured mean)
    after: list[str] = field(default_factory=list)
    kind: Literal["collective"] = "collective"


@dataclass
class ComputeNode:
    id: str
    module: str
    group: Optional[int]
    phase: str
    op: str  # permute | bucketize | recat | lookup | fused_update | concat
    rank: Optional[int]  # None: the same op on every rank
    tables: list[str]
    workload: dict[str, float]
    workspace_bytes: int
    after: list[str] = field(default_factory=list)
    kind: Literal["compute"] = "compute"


Node = Union[CollectiveNode, ComputeNode]


@dataclass
class SparseGraph:
    """The SRSV: every lifted module and the operations of one training step."""

    world_size: int
    backend: str
    modules: list[LiftedModule]
    nodes: list[Node]
    dense_param_bytes: int
    versions: dict[str, str]
    version: int = _GRAPH_VERSION
    provenance: list[str] = field(default_factory=list)  # the passes applied, in order

    def __post_init__(self) -> None:
        if self.version != _GRAPH_VERSION:
            raise ValueError(f"sparse graph version {self.version} is not {_GRAPH_VERSION}")

    def module(self, path: str) -> LiftedModule:
        for m in self.modules:
            if m.path == path:
                return m
        raise KeyError(path)

    def collectives(self, phase: Optional[str] = None) -> list[CollectiveNode]:
        nodes = [n for n in self.nodes if isinstance(n, CollectiveNode)]
        return sorted((n for n in nodes if phase is None or n.phase == phase), key=lambda n: n.order)

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "SparseGraph":
        """The graph ``data`` (parsed JSON) describes; ValueError naming the first field of the wrong type."""
        return decode(cls, data)

    def copy(self) -> "SparseGraph":
        return SparseGraph.from_dict(self.to_dict())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: Union[str, Path]) -> "SparseGraph":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def fingerprint(self) -> str:
        """A hash of the structure (not of the measured statistics): equal on every rank exactly
        when all ranks will issue the same collectives in the same order with the same layouts."""
        structure = {
            "world_size": self.world_size, "backend": self.backend,
            "modules": [{**asdict(m), "ids_per_step": None, "length_percentiles": None} for m in self.modules],
            "collectives": [(n.id, n.op, n.role, n.dtype, n.layout, n.order) for n in self.collectives()],
        }
        return hashlib.sha256(json.dumps(structure, sort_keys=True).encode()).hexdigest()[:16]

    # ---------------------------------------------------------------- for humans
    def explain(self) -> str:
        lines = [f"SparseGraph (SRSV) v{self.version}: {self.world_size} rank(s), backend {self.backend}, "
                 f"fingerprint {self.fingerprint()}"]
        lines += [f"pass applied: {p}" for p in self.provenance]
        for m in self.modules:
            batch = ",".join(map(str, sorted(set(m.batch_size_per_rank))))
            lines.append(f"module {m.path}: {len(m.keys)} features, {'weighted' if m.weighted else 'unweighted'}, "
                         f"batch {batch}/rank, ids {m.lengths_dtype}/{m.values_dtype}"
                         + ("" if not m.feature_order else ", keys permuted into group order"))
            if m.root_input is not None:
                lines.append(f"  input available when the root forward begins: {describe_path(m.root_input)}")
            if m.batch_input is not None:
                lines.append(f"  input found in the batch the loop announces as next: "
                             f"{describe_path(m.batch_input, 'batch')}")
            for g in m.groups:
                lines.append(f"  group {g.index} {g.sharding_type}: {len(g.features)} keys, "
                             f"{sum(g.embedding_dims)} output columns")
                by_rank: dict[Any, list[str]] = {}
                for t in g.tables:
                    label = "all" if t.rank is None else t.rank
                    part = f"{t.table}[{t.rows}x{t.dim}"
                    if g.sharding_type == "row_wise":
                        part += f" rows {t.row_offset}+"
                    if g.sharding_type == "column_wise":
                        part += f" cols {t.col_offset}+"
                    by_rank.setdefault(label, []).append(part + "]")
                for rank, parts in by_rank.items():
                    lines.append(f"    rank {rank}: " + ", ".join(parts))
        lines.append("step (collectives in issue order; bytes = what each member puts in):")
        for phase in ("forward", "backward"):
            for n in self.nodes:
                if n.phase != phase:
                    continue
                where = f"{n.module.split('.')[-1]}" + (f"/g{n.group}" if n.group is not None else "")
                if isinstance(n, CollectiveNode):
                    approx = "~" if n.data_dependent else ""
                    sizes = ",".join(approx + _human_bytes(b) for b in n.bytes_per_member)
                    lines.append(f"  {phase[:3]} #{n.order:<3d} {n.op:<17s} {n.role:<22s} {where:<28s} {n.dtype:<7s} "
                                 f"{sizes}  layout {n.layout}")
                else:
                    rank = "every rank" if n.rank is None else f"rank {n.rank}"
                    work = ", ".join(f"{k}={v:,.0f}" for k, v in n.workload.items())
                    lines.append(f"  {phase[:3]}      {n.op:<17s} {rank:<22s} {where:<28s} {work}"
                                 + (f", workspace {_human_bytes(n.workspace_bytes)}" if n.workspace_bytes else ""))
        total = sum(sum(n.bytes_per_member) for n in self.collectives())
        lines.append(f"{len(self.collectives())} collectives per step, {_human_bytes(total)} put in by all members; "
                     f"dense parameters {_human_bytes(self.dense_param_bytes)}")
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz source of the step (``dot -Tpng``)."""
        out = ["digraph srsv {", "  rankdir=TB; node [fontname=Helvetica, fontsize=10];"]
        for n in self.nodes:
            if isinstance(n, CollectiveNode):
                label = f"{n.op}\\n{n.role}\\n{_human_bytes(max(n.bytes_per_member))}/member"
                out.append(f'  "{n.id}" [shape=box, style=filled, fillcolor="#ffd9a0", label="{label}"];')
            else:
                rank = "" if n.rank is None else f" r{n.rank}"
                out.append(f'  "{n.id}" [shape=ellipse, label="{n.op}{rank}"];')
            for dep in n.after:
                out.append(f'  "{dep}" -> "{n.id}";')
        out.append("}")
        return "\n".join(out)


def member_bytes(nodes: list[CollectiveNode], world: int) -> list[int]:
    """Bytes each member puts into ``nodes`` together (e.g. what one merged collective carries)."""
    return [sum(n.bytes_per_member[r] for n in nodes) for r in range(world)]


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n}"


# ==================================================================== lifting
def _sharded_type() -> type:
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    return ShardedEmbeddingBagCollection


def _table_shards(name: str, ps: Any, pooling: str, rows: int, dim: int) -> list[TableShard]:
    if ps.sharding_type == "data_parallel":
        return [TableShard(name, None, rows, dim, 0, 0, ps.compute_kernel, pooling)]
    shards = []
    for meta in ps.sharding_spec.shards:
        shards.append(TableShard(name, meta.placement.rank(), int(meta.shard_sizes[0]), int(meta.shard_sizes[1]),
                                 int(meta.shard_offsets[0]), int(meta.shard_offsets[1]), ps.compute_kernel, pooling))
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


def _lift_groups(path: str, sharded: nn.Module, module_plan: Any, env: Any, device: torch.device) -> list[ShardingGroup]:
    from torchrec.modules.embedding_configs import PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = list(sharded._embedding_bag_configs)
    meta_ebc = EmbeddingBagCollection(tables=configs, is_weighted=sharded._is_weighted, device=torch.device("meta"))
    plan = dict(module_plan)
    cls = _sharded_type()
    infos_by_type = cls.create_grouped_sharding_infos(meta_ebc, plan, "embedding_bags.", None)
    groups = []
    by_name = {c.name: c for c in configs}
    for index, (sharding_type, infos) in enumerate(infos_by_type.items()):
        if sharding_type not in SUPPORTED_SHARDING_TYPES:
            raise LiftError(f"{path}: sharding type {sharding_type!r} (tables {[i.embedding_config.name for i in infos]}) "
                            f"is not supported by the lifted executor; supported: {SUPPORTED_SHARDING_TYPES}")
        sharding = cls.create_embedding_bag_sharding(infos, env, device, permute_embeddings=True)
        world = env.world_size
        tables = []
        for info in infos:
            cfg = by_name[info.embedding_config.name]
            pooling = cfg.pooling.name if hasattr(cfg.pooling, "name") else str(cfg.pooling)
            if sharding_type == "row_wise" and cfg.pooling == PoolingType.MEAN:
                raise LiftError(f"{path}: table {cfg.name!r} is row-wise with mean pooling (TorchRec divides after "
                                f"the reduce-scatter); the lifted executor does not implement that")
            tables.extend(_table_shards(cfg.name, plan[cfg.name], pooling, cfg.num_embeddings, cfg.embedding_dim))
        features = list(sharding.feature_names())
        features_per_rank: list[int] = []
        block_sizes: list[int] = []
        dim_sum_per_rank: list[int] = []
        column_order: list[int] = []
        if sharding_type in ("table_wise", "column_wise"):
            features_per_rank = list(sharding.features_per_rank())
            names_per_rank = sharding.embedding_names_per_rank()
            dims = sharding.uncombined_embedding_dims() if sharding_type == "column_wise" else sharding.embedding_dims()
            start = 0
            for names in names_per_rank:
                dim_sum_per_rank.append(sum(dims[start:start + len(names)]))
                start += len(names)
            if sharding_type == "column_wise":
                column_order = _column_order(sharding)
        elif sharding_type == "row_wise":
            rows = {}
            for info in infos:
                for feature in info.embedding_config.feature_names:
                    rows[feature] = info.embedding_config.num_embeddings
            block_sizes = [(rows[f] + world - 1) // world for f in features]
        groups.append(ShardingGroup(index, sharding_type, features, features_per_rank, block_sizes, dim_sum_per_rank,
                                    column_order, list(sharding.embedding_names()), list(sharding.embedding_dims()),
                                    tables))
    return groups


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
    their forwards ran in the captured steps."""
    import fbgemm_gpu
    import torchrec
    from torchrec.distributed.types import ShardingEnv

    env = ShardingEnv.from_process_group(process_group)
    world = env.world_size
    cls = _sharded_type()
    ran = [p for p in captures[0].modules if p in module_paths]
    order = ran + [p for p in module_paths if p not in ran]
    modules = []
    for path in order:
        sharded = model.get_submodule(path)
        if type(sharded) is not cls:
            raise LiftError(f"{path}: {type(sharded).__name__} is not a plain ShardedEmbeddingBagCollection; the lifted "
                            f"executor handles only that module type")
        if getattr(sharded, "qcomm_codecs_registry", None):
            raise LiftError(f"{path}: quantized communication codecs are not supported by the lifted executor")
        keys, weighted, lengths_dtype, values_dtype, batch_sizes = _module_inputs(path, captures)
        root_input = common_path([c.modules[path].root_input for c in captures])
        batch_input, next_batch_note = _next_batch_source([c.modules[path] for c in captures])
        if weighted != bool(sharded._is_weighted):
            raise LiftError(f"{path}: the module is {'weighted' if sharded._is_weighted else 'unweighted'} but its "
                            f"captured input {'has' if weighted else 'has no'} weights")
        groups = _lift_groups(path, sharded, sharding_plan.plan[path], env, device)
        names = [f for g in groups for f in g.features]
        unknown = sorted(set(names) - set(keys))
        if unknown:
            raise LiftError(f"{path}: features {unknown} of the tables are missing from the input KJT keys {keys}")
        feature_order = [] if names == keys else [keys.index(f) for f in names]
        ids = [{k: c.modules[path].features[k].ids_per_step for k in keys} for c in captures]
        percentiles = {k: captures[0].modules[path].features[k].percentiles for k in keys}
        modules.append(LiftedModule(path, keys, weighted, lengths_dtype, values_dtype, feature_order, groups,
                                    batch_sizes, ids, percentiles, root_input=root_input, batch_input=batch_input,
                                    next_batch_note=next_batch_note))
    nodes = _step_nodes(modules, world, dense_param_bytes)
    versions = {"torch": torch.__version__, "torchrec": getattr(torchrec, "__version__", "?"),
                "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?")}
    return SparseGraph(world, str(torch.distributed.get_backend(process_group)) if world > 1 else "none",
                       modules, nodes, dense_param_bytes, versions)


def _step_nodes(modules: list[LiftedModule], world: int, dense_param_bytes: int) -> list[Node]:
    """The nodes of one training step under the identity plan, collectives numbered in the order
    the executor issues them (forward: module by module, splits of every group, then each group's
    payloads, lookups, outputs; backward: the reverse)."""
    nodes: list[Node] = []
    order = 0

    def collective(**kw: Any) -> CollectiveNode:
        nonlocal order
        node = CollectiveNode(order=order, process_group=f"world[{world}]", **kw)
        order += 1
        return node

    for m in modules:
        B = m.batch_size_per_rank
        lengths_size = DTYPE_BYTES[m.lengths_dtype]
        values_size = DTYPE_BYTES[m.values_dtype]
        prev = []
        if m.feature_order:
            ids = [sum(stats.values()) for stats in m.ids_per_step]
            nodes.append(ComputeNode(f"{m.path}/permute", m.path, None, "forward", "permute", None, [],
                                     {"ids": max(ids), "keys": len(m.keys)}, 0))
            prev = [nodes[-1].id]
        dist_groups = [g for g in m.groups if g.sharding_type in _ALL_TO_ALL_INPUT] if world > 1 else []
        for g in m.groups:
            if g.sharding_type == "row_wise":
                nodes.append(ComputeNode(f"{m.path}/g{g.index}/bucketize", m.path, g.index, "forward", "bucketize", None,
                                         [], {"ids": max(m.group_ids(r, g) for r in range(world))}, 0, list(prev)))
        tensors = 3 + int(m.weighted)  # lengths, values, [weights,] batch size
        for g in dist_groups:
            nodes.append(collective(id=f"{m.path}/g{g.index}/input_splits", module=m.path, group=g.index,
                                    phase="forward", op="all_to_all_single", role="input_splits", dtype="int64",
                                    layout=f"[dst][lengths,values{',weights' if m.weighted else ''},batch]",
                                    bytes_per_member=[world * tensors * 8] * world, data_dependent=False,
                                    after=list(prev)))
        for g in dist_groups:
            fan = world if g.sharding_type == "row_wise" else 1
            nkeys = len(g.features) * fan
            base = dict(module=m.path, group=g.index, phase="forward", op="all_to_all_single",
                        after=[f"{m.path}/g{g.index}/input_splits"])
            nodes.append(collective(id=f"{m.path}/g{g.index}/input_lengths", role="input_lengths", dtype=m.lengths_dtype,
                                    layout="[dst][key][sample] -> recat to [key][src][sample]",
                                    bytes_per_member=[nkeys * B[r] * lengths_size for r in range(world)],
                                    data_dependent=False, **base))
            ids = [m.group_ids(r, g) for r in range(world)]
            nodes.append(collective(id=f"{m.path}/g{g.index}/input_values", role="input_values", dtype=m.values_dtype,
                                    layout="ids by [dst][key][sample] -> recat to [key][src][sample]",
                                    bytes_per_member=[round(i * values_size) for i in ids], data_dependent=True,
                                    **base))
            if m.weighted:
                nodes.append(collective(id=f"{m.path}/g{g.index}/input_weights", role="input_weights", dtype="float32",
                                        layout="as input_values", bytes_per_member=[round(i * 4) for i in ids],
                                        data_dependent=True, **base))
        outputs = []
        for g in m.groups:
            dist = g in dist_groups
            inputs = [n.id for n in nodes if n.module == m.path and n.group == g.index and n.phase == "forward"]
            if dist:
                nodes.append(ComputeNode(f"{m.path}/g{g.index}/recat", m.path, g.index, "forward", "recat", None, [],
                                         {"keys": len(g.features)}, 0, inputs[-1:]))
                inputs = [nodes[-1].id]
            lookups = []
            for rank in (range(world) if g.sharding_type != "data_parallel" else [None]):
                owned = [t for t in g.tables if t.rank == rank]
                if not owned:
                    continue
                columns = g.dim_sum_per_rank[rank] if g.dim_sum_per_rank else sum(g.embedding_dims)
                if g.sharding_type == "data_parallel":
                    rows_out, ids = B[0], max(m.group_ids(r, g) for r in range(world))
                elif g.sharding_type == "row_wise":
                    rows_out, ids = sum(B), sum(m.group_ids(r, g) for r in range(world)) / world
                else:
                    keys = g.keys_on_rank(rank)
                    rows_out, ids = sum(B), sum(m.group_ids(r, g, keys) for r in range(world))
                nodes.append(ComputeNode(f"{m.path}/g{g.index}/lookup@{rank if rank is not None else 'all'}", m.path,
                                         g.index, "forward", "lookup", rank, sorted({t.table for t in owned}),
                                         {"ids": ids, "rows": sum(t.rows for t in owned), "samples": rows_out},
                                         rows_out * columns * 4, inputs))
                lookups.append(nodes[-1].id)
            if world > 1 and g.sharding_type in ("table_wise", "column_wise"):
                nodes.append(collective(id=f"{m.path}/g{g.index}/output_pooled", module=m.path, group=g.index,
                                        phase="forward", op="all_to_all_single", role="output_pooled",
                                        dtype="float32",
                                        layout="[dst sample block][src columns] -> concat columns by src rank"
                                        + (", then column permutation" if g.column_order else ""),
                                        bytes_per_member=[sum(B) * g.dim_sum_per_rank[r] * 4 for r in range(world)],
                                        data_dependent=False, after=lookups))
            elif world > 1 and g.sharding_type == "row_wise":
                nodes.append(collective(id=f"{m.path}/g{g.index}/output_reduce_scatter", module=m.path, group=g.index,
                                        phase="forward", op="reduce_scatter", role="output_partial_sums",
                                        dtype="float32", layout="[dst sample block][columns], summed over members",
                                        bytes_per_member=[sum(B) * sum(g.embedding_dims) * 4] * world,
                                        data_dependent=False, after=lookups))
            outputs.append(nodes[-1].id)
        nodes.append(ComputeNode(f"{m.path}/concat", m.path, None, "forward", "concat", None, [],
                                 {"columns": sum(m.embedding_dims)}, B[0] * sum(m.embedding_dims) * 4, outputs))
    # backward: gradients flow through the modules in reverse
    for m in reversed(modules):
        B = m.batch_size_per_rank
        for g in reversed(m.groups):
            start = f"{m.path}/concat"
            if world > 1 and g.sharding_type in ("table_wise", "column_wise"):
                nodes.append(collective(id=f"{m.path}/g{g.index}/grad_pooled", module=m.path, group=g.index,
                                        phase="backward", op="all_to_all_single", role="grad_pooled",
                                        dtype="float32", layout="[dst columns][sample] -> [src sample block], / world",
                                        bytes_per_member=[B[r] * sum(g.dim_sum_per_rank) * 4 for r in range(world)],
                                        data_dependent=False, after=[start]))
                start = nodes[-1].id
            elif world > 1 and g.sharding_type == "row_wise":
                nodes.append(collective(id=f"{m.path}/g{g.index}/grad_all_gather", module=m.path, group=g.index,
                                        phase="backward", op="all_gather", role="grad_pooled", dtype="float32",
                                        layout="[src sample block][columns], / world",
                                        bytes_per_member=[B[r] * sum(g.embedding_dims) * 4 for r in range(world)],
                                        data_dependent=False, after=[start]))
                start = nodes[-1].id
            if g.sharding_type == "data_parallel":
                nodes.append(ComputeNode(f"{m.path}/g{g.index}/table_grad", m.path, g.index, "backward", "dense_grad",
                                         None, sorted({t.table for t in g.tables}),
                                         {"rows": sum(t.rows for t in g.tables)},
                                         sum(t.rows * t.dim for t in g.tables) * 4, [start]))
                if world > 1:
                    nbytes = sum(t.rows * t.dim for t in g.tables) * 4
                    nodes.append(collective(id=f"{m.path}/g{g.index}/table_grad_all_reduce", module=m.path,
                                            group=g.index, phase="backward", op="all_reduce", role="dp_table_grad",
                                            dtype="float32", layout="full table gradients (DDP buckets)",
                                            bytes_per_member=[nbytes] * world, data_dependent=False,
                                            after=[nodes[-1].id]))
            else:
                for rank in range(world):
                    owned = [t for t in g.tables if t.rank == rank]
                    if owned:
                        nodes.append(ComputeNode(f"{m.path}/g{g.index}/fused_update@{rank}", m.path, g.index,
                                                 "backward", "fused_update", rank, sorted({t.table for t in owned}),
                                                 {"rows": sum(t.rows for t in owned)}, 0, [start]))
    if world > 1 and dense_param_bytes:
        nodes.append(collective(id="dense/grad_all_reduce", module="dense", group=None, phase="backward",
                                op="all_reduce", role="dense_grad", dtype="float32",
                                layout="dense gradients (DDP buckets)", bytes_per_member=[dense_param_bytes] * world,
                                data_dependent=False))
    return nodes


# ==================================================================== cross-check
def check_against_runtime(graph: SparseGraph, model: nn.Module) -> None:
    """Compare the lifted layout with what TorchRec built inside each sharded module (its
    private attributes, initialised by the first forward). Raises :class:`LiftError` on any
    difference."""
    for m in graph.modules:
        sharded = model.get_submodule(m.path)

        def expect(what: str, ours: Any, theirs: Any) -> None:
            if ours != theirs:
                raise LiftError(f"{m.path}: lifted {what} {ours} differs from TorchRec's {theirs}")

        if sharded._has_uninitialized_input_dist or getattr(sharded, "_has_uninitialized_output_dist", False):
            raise LiftError(f"{m.path}: TorchRec's input/output dists are not initialised (no forward ran yet)")
        expect("sharding types", [g.sharding_type for g in m.groups], list(sharded._sharding_types))
        expect("feature splits", [len(g.features) for g in m.groups], list(sharded._feature_splits))
        expect("feature order", m.feature_order, list(sharded._features_order) if sharded._has_features_permute else [])
        expect("embedding names", m.embedding_names, list(sharded._embedding_names))
        expect("embedding dims", m.embedding_dims, list(sharded._embedding_dims))
        if getattr(sharded, "_has_mean_pooling_callback", False):
            raise LiftError(f"{m.path}: TorchRec applies a mean-pooling callback the lifted executor does not have")
        for g, input_dist, output_dist in zip(m.groups, sharded._input_dists, sharded._output_dists):
            kind = g.sharding_type
            if kind in ("table_wise", "column_wise"):
                expect(f"group {g.index} features per rank", g.features_per_rank, list(input_dist._dist._splits))
                expect(f"group {g.index} output dims per rank", g.dim_sum_per_rank, list(output_dist._dim_sum_per_rank))
                callbacks = list(getattr(output_dist, "_callbacks", None) or [])
                width = sum(g.dim_sum_per_rank)
                probe = torch.arange(width, dtype=torch.float32).view(1, width)
                for callback in callbacks:
                    probe = callback(probe)
                theirs = [int(c) for c in probe.view(-1).tolist()]
                ours = g.column_order or list(range(width))
                expect(f"group {g.index} output column order", ours, theirs)
            elif kind == "row_wise":
                expect(f"group {g.index} row block sizes", g.block_sizes,
                       [int(b) for b in input_dist._feature_block_sizes_tensor.tolist()])
                if getattr(input_dist, "_has_multiple_blocks_per_shard", False) or input_dist.zch_bucketize_row_pos:
                    raise LiftError(f"{m.path}: row-wise group {g.index} uses multi-block bucketization")
                if input_dist._has_feature_processor or input_dist._is_sequence:
                    raise LiftError(f"{m.path}: row-wise group {g.index} bucketizes positions (feature processor)")
