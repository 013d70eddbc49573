"""The lifted graph (SRSV: Sparse Resource Semantic View) of a model's sparse path: per lifted
module, its sharding groups with the exact layout the executor needs and the schedule it runs;
the operations of one training step (:attr:`SparseGraph.nodes`) are derived from those."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_sparselift.ir.schedule import ModuleSchedule
from lightning_sparselift.ir.vocab import ROW_SHARDED, Dtype, LiftedShardingType, WireFormat

GRAPH_VERSION = 3


@dataclass
class TableShard:
    table: str
    rank: Optional[int]  # None: replicated on every rank (data_parallel)
    rows: int
    dim: int
    row_offset: int
    col_offset: int
    kernel: str  # TorchRec's compute kernel
    pooling: str
    features: list[str] = field(default_factory=list)  # the features that read the table


@dataclass
class OutputBlock:
    """Columns of a rank's pooled output: one feature's pooled rows of one table (shard)."""

    table: str
    width: int


@dataclass
class ShardingGroup:
    """One sharding type of one module: what the executor needs to move its data exactly as
    TorchRec does."""

    index: int
    sharding_type: LiftedShardingType
    features: list[str]  # this group's KJT keys in send order (column-wise repeats a feature per shard)
    features_per_rank: list[int]  # keys sent to each rank (all-to-all groups)
    block_sizes: list[int]  # row_wise: rows per bucket, per feature
    # output columns each rank produces: pooled (table/column-wise), or, for an EmbeddingCollection,
    # the width of each rank's rows (every exchanged kind)
    dim_sum_per_rank: list[int]
    column_order: list[int]  # output column permutation after the all-to-all; [] = identity
    embedding_names: list[str]
    embedding_dims: list[int]
    tables: list[TableShard]
    # pooled all-to-all groups: per rank, its output's column blocks in order (one per feature a
    # shard on the rank serves); what a bucket of tables sends is read from them
    output_blocks: list[list[OutputBlock]] = field(default_factory=list, kw_only=True)
    # the lookup kernels every rank can run for this group (the reference, and "generated" when the
    # runtime built one everywhere), and why another one is not available; probed on the machine
    lookup_kernels: list[str] = field(default_factory=lambda: ["torchrec"])
    lookup_notes: dict[str, str] = field(default_factory=dict)
    # the tables in buckets (subgraph parallelism's) a generated kernel was built for on every rank
    built_buckets: list[list[list[str]]] = field(default_factory=list)
    # why this group keeps TorchRec's path ("": the executor runs it): its input distribution,
    # lookup and output distribution are then TorchRec's own modules of the group, called in the
    # executor's step (the layout fields above stay empty; the passes leave the group alone)
    not_lifted: str = ""

    def tables_by_rank(self) -> dict[Optional[int], list[TableShard]]:
        """The group's table shards per rank holding them (None: replicated), in table order."""
        out: dict[Optional[int], list[TableShard]] = {}
        for t in self.tables:
            out.setdefault(t.rank, []).append(t)
        return out

    @property
    def kind(self) -> Optional[str]:
        """The sharding type the schedule runs, None when the group keeps TorchRec's path (no
        exchange or kernel of the schedule is its)."""
        return None if self.not_lifted else self.sharding_type

    def bucket_columns(self, buckets: list[list[str]]) -> list[list[list[int]]]:
        """Per bucket of table names, per rank: the columns of the rank's output (its
        :attr:`output_blocks` in order) that hold the bucket's tables."""
        out = []
        for bucket in buckets:
            names = set(bucket)
            per_rank = []
            for blocks in self.output_blocks:
                columns, at = [], 0
                for block in blocks:
                    if block.table in names:
                        columns.extend(range(at, at + block.width))
                    at += block.width
                per_rank.append(columns)
            out.append(per_rank)
        return out

    def keys_on_rank(self, rank: int) -> list[str]:
        if self.sharding_type in ROW_SHARDED:
            return list(self.features)
        start = sum(self.features_per_rank[:rank])
        return self.features[start:start + self.features_per_rank[rank]]


@dataclass
class OutputConsumer:
    """How the model read a pooled module's output in every captured step: all keys' values
    concatenated along the key dim in one ``torch.cat``, in ``keys`` order, after other operands
    ``before`` columns wide and before others ``after`` columns wide (e.g. the bottom MLP's output
    first), and not read otherwise."""

    keys: list[str]
    before: int = 0
    after: int = 0


@dataclass
class LiftedModule:
    path: str
    keys: list[str]  # the input KJT's keys, in the order the model passes them
    weighted: bool
    lengths_dtype: Dtype
    values_dtype: Dtype
    feature_order: list[int]  # permutation of the input keys into group order; [] = identity
    groups: list[ShardingGroup]
    batch_size_per_rank: list[int]
    ids_per_step: list[dict[str, float]]  # per member rank, per feature: mean ids per step
    length_percentiles: dict[str, dict[str, float]]  # per feature (member 0): p50/p90/p99 bag length
    schedule: ModuleSchedule
    # where the input KJT is when the root forward begins (same on every rank and step), else None
    root_input: Optional[list[list[Any]]] = None
    # where the input KJT is in the training step's batch, when the batch the loop announces as
    # next held exactly the features the module received in every captured step (else None, and
    # next_batch_note says why): the next step's input distribution can then start a step early
    batch_input: Optional[list[list[Any]]] = None
    next_batch_note: str = ""
    # TorchRec's row-wise mean pooling: the lookups of row-wise tables sum, and after the
    # reduce-scatter the module's whole output is divided by a per-sample divisor per feature:
    # its bag length (+1e-6), or 1 (+1e-6) for the row-wise sum features listed here
    mean_after_reduce: bool = False
    reduce_sum_features: list[str] = field(default_factory=list)
    # an EmbeddingBagCollection (pooled per bag) or an EmbeddingCollection (False: one row per id,
    # returned as a JaggedTensor per feature)
    pooled: bool = True
    # EmbeddingCollection, column-wise: per output key, the order of its column shards in the
    # output (TorchRec's features_to_permute_indices); absent: rank order
    column_shard_order: dict[str, list[int]] = field(default_factory=dict)
    # the model's concatenation of the pooled output (capture), else None and consumer_note says
    # how the model read it
    consumer: Optional[OutputConsumer] = None
    consumer_note: str = ""
    # the output kernels every rank can run (the reference, and "consumer" when the runtime built
    # the layout kernel everywhere), and why another one is not available; probed on the machine
    output_kernels: list[str] = field(default_factory=lambda: ["torchrec"])
    output_notes: dict[str, str] = field(default_factory=dict)
    # the generated input kernel (its permute, bucketize and recat regions) when the runtime built it on
    # every rank (["generated"]; the reference kernels are always there), else why not
    input_kernels: list[str] = field(default_factory=list)
    input_notes: dict[str, str] = field(default_factory=dict)
    # TorchRec's quantized communication: the format on the wire of each output collective it
    # encodes, by role (ir/steps: output_pooled, grad_pooled, ...); the others exchange float32
    wire: dict[str, WireFormat] = field(default_factory=dict)

    def wire_format(self, role: str) -> str:
        """The format an output collective of ``role`` travels in ("": float32): TorchRec's
        codec's, else the schedule's (the communication-precision pass)."""
        return self.wire.get(role) or self.schedule.wire.get(role, "")

    @property
    def embedding_names(self) -> list[str]:
        return [n for g in self.groups for n in g.embedding_names]

    @property
    def embedding_dims(self) -> list[int]:
        return [d for g in self.groups for d in g.embedding_dims]

    @property
    def kinds(self) -> list[Optional[str]]:
        return [g.kind for g in self.groups]

    @property
    def lifted_groups(self) -> list[ShardingGroup]:
        """The groups the executor runs itself (the ones the passes may change)."""
        return [g for g in self.groups if not g.not_lifted]

    def group_ids(self, member: int, group: ShardingGroup, keys: Optional[list[str]] = None) -> float:
        """Mean ids per step that ``member`` feeds into ``keys`` (default: all of the group's)."""
        stats = self.ids_per_step[member]
        return sum(stats[k] for k in (group.features if keys is None else keys))

    def ids_per_member(self, group: ShardingGroup, keys: Optional[list[str]] = None) -> list[float]:
        """:meth:`group_ids` of every member (members holding one statistics object, as the
        simulator's ranks do, summed once)."""
        keys = group.features if keys is None else keys
        seen: dict[int, float] = {}
        out = []
        for stats in self.ids_per_step:
            if id(stats) not in seen:
                seen[id(stats)] = sum(stats[k] for k in keys)
            out.append(seen[id(stats)])
        return out

    def fed_ids(self, keys: list[str]) -> dict[str, float]:
        """Per key: the ids all members feed it per step."""
        shared: dict[int, list[Any]] = {}  # (members holding one statistics object counted together)
        for stats in self.ids_per_step:
            shared.setdefault(id(stats), [stats, 0])[1] += 1
        return {k: sum(stats[k] * n for stats, n in shared.values()) for k in keys}

    def touched_bytes(self, groups: list[int]) -> float:
        """Bytes of fp32 rows the lookups of ``groups`` touch per step, for the member feeding them
        the most ids (each id at its group's widest dim)."""
        per_group = [(self.ids_per_member(self.groups[i]), max(self.groups[i].embedding_dims, default=0))
                     for i in groups]
        return max((sum(ids[m] * dim for ids, dim in per_group) for m in range(len(self.ids_per_step))),
                   default=0.0) * 4

    def ids_to_each_rank(self, member: int, group: ShardingGroup, world: int) -> list[float]:
        """Mean ids ``member`` sends to each rank in ``group``'s input all-to-all (row-wise: an
        even split across row blocks, the ids' real spread is data-dependent)."""
        if group.sharding_type in ROW_SHARDED:
            return [self.group_ids(member, group) / world] * world
        stats, out, start = self.ids_per_step[member], [], 0
        for count in group.features_per_rank[:world]:  # (keys_on_rank rank by rank, in one walk)
            ids = 0
            for k in group.features[start:start + count] if count else ():
                ids += stats[k]
            out.append(ids)
            start += count
        return out


@dataclass
class SparseGraph:
    """Every lifted module of a model and how its step runs."""

    world_size: int
    backend: str
    modules: list[LiftedModule]
    dense_param_bytes: int
    versions: dict[str, str]
    version: int = GRAPH_VERSION
    provenance: list[str] = field(default_factory=list)  # the passes applied, in order
    # sharded modules that keep TorchRec's path, with the reason the lifter gave
    not_lifted: dict[str, str] = field(default_factory=dict)
    # each rank's intra-op threads when captured (a property of the run, not of the graph's structure)
    threads_per_rank: list[int] = field(default_factory=list)
    # where the tables and the step run ("cpu" or "cuda"; the run's, like the threads: one GPU runs
    # without a process group, so the backend does not say it)
    device: str = "cpu"
    # the workspace a schedule may hold beyond the identity plan's, per rank (the user's
    # ``workspace_budget_mb``; None: no limit); like the threads, the run's, not the structure's
    workspace_budget_bytes: Optional[int] = None
    # per module, the buckets of its lookups (G) in the plan in use when this planning round began
    # (absent: one); subgraph parallelism's sweep starts there; like the threads, not the structure's
    incumbent_buckets: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version != GRAPH_VERSION:
            raise ValueError(f"sparse graph version {self.version} is not {GRAPH_VERSION}")

    def module(self, path: str) -> LiftedModule:
        for m in self.modules:
            if m.path == path:
                return m
        raise KeyError(path)

    @property
    def nodes(self) -> list[Any]:
        """The operations of one training step, as the schedules run them."""
        from lightning_sparselift.ir.steps import step_nodes

        return step_nodes(self)

    def collectives(self, phase: Optional[str] = None) -> list[Any]:
        """The step's collectives in issue order (``phase``: only forward or backward)."""
        from lightning_sparselift.ir.steps import CollectiveNode

        nodes = [n for n in self.nodes if isinstance(n, CollectiveNode)]
        return sorted((n for n in nodes if phase is None or n.phase == phase), key=lambda n: n.order)

    def to_dict(self) -> dict[str, Any]:
        from lightning_sparselift.ir.serialize import graph_to_dict

        return graph_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "SparseGraph":
        """The graph ``data`` (parsed JSON) describes; ValueError naming the first field of the wrong type."""
        from lightning_sparselift.ir.serialize import graph_from_dict

        return graph_from_dict(data)

    def lookup_buckets(self) -> dict[str, int]:
        """Per module whose lookups run in buckets: their count (the largest of its groups')."""
        out = {}
        for m in self.modules:
            counts = [len(r.buckets) for r in m.schedule.regions if r.name == "lookup" and r.buckets]
            if counts:
                out[m.path] = max(counts)
        return out

    def copy(self) -> "SparseGraph":
        """An independent copy (what the graph shares within itself, it shares within the copy).
        A pickle round trip in memory: planning copies the graph for every candidate and every
        combination a design measures, on the training thread, and on these plain dataclasses
        that is ~3x faster than ``copy.deepcopy`` (sparse-heavy's graph: 0.66 ms against 1.87)."""
        return pickle.loads(pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL))

    def to_json(self) -> str:
        from lightning_sparselift.ir.serialize import graph_to_json

        return graph_to_json(self)

    def fingerprint(self) -> str:
        from lightning_sparselift.ir.serialize import fingerprint

        return fingerprint(self)

    def explain(self) -> str:
        from lightning_sparselift.ir.explain import explain

        return explain(self)

    def to_dot(self) -> str:
        from lightning_sparselift.ir.explain import to_dot

        return to_dot(self)
