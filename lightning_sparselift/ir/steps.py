"""The operations of one training step, derived from the lifted modules and their schedules:
collectives with their role, process group, dtype, bytes per member and the points where they
are issued and waited for; compute with its kernel, workload and workspace. Passes read them for
their cost inputs, ``explain`` prints them, and the bytes are checked against what TorchRec and
the executor really send."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from lightning_sparselift.ir.schedule import InputExchange, OutputExchange
from lightning_sparselift.ir.vocab import BACKWARD_OF, DTYPE_BYTES, POINTS, ROW_SHARDED, WIRE_FORMATS, Point, aligned

if TYPE_CHECKING:
    from lightning_sparselift.ir.graph import LiftedModule, ShardingGroup, SparseGraph


@dataclass
class CollectiveNode:
    id: str
    module: str
    groups: list[int]
    phase: str  # forward | backward
    op: str  # all_to_all_single | reduce_scatter | all_gather | all_reduce
    role: str
    process_group: str
    dtype: str
    order: int  # position among the step's collectives (module by module), identical on every rank
    bytes_per_member: list[int]
    data_dependent: bool  # bytes follow the batch's ids (predicted from the captured mean)
    issue: Point
    wait: Point
    after: list[str] = field(default_factory=list)
    bucket: Optional[int] = None  # a pipelined bucket's all-to-all: the bucket's index among its group's lookups


@dataclass
class ComputeNode:
    id: str
    module: str
    groups: list[int]
    phase: str
    # a region (permute | bucketize | recat | lookup | output), fused_update, dense_grad, or
    # torchrec_group (a group that keeps TorchRec's path, its exchanges included)
    op: str
    rank: Optional[int]  # None: the same op on every rank
    kernel: str
    tables: list[str]
    workload: dict[str, float]
    workspace_bytes: int
    after: list[str] = field(default_factory=list)


Node = Union[CollectiveNode, ComputeNode]


def member_bytes(nodes: list[CollectiveNode], world: int) -> list[int]:
    """Bytes each member puts into ``nodes`` together (e.g. what one merged collective carries)."""
    return [sum(n.bytes_per_member[r] for n in nodes) for r in range(world)]


class _Step:
    def __init__(self, world: int) -> None:
        self.world = world
        self.nodes: list[Node] = []
        self.order = 0

    def collective(self, **kw) -> CollectiveNode:
        node = CollectiveNode(order=self.order, process_group=kw.pop("process_group", f"world[{self.world}]"), **kw)
        self.order += 1
        self.nodes.append(node)
        return node

    def compute(self, **kw) -> ComputeNode:
        node = ComputeNode(**kw)
        self.nodes.append(node)
        return node


def step_nodes(graph: "SparseGraph") -> list[Node]:
    """Forward module by module (each module's splits exchanges, payloads, lookups, outputs),
    then backward in reverse, then DDP's dense all-reduce."""
    step = _Step(graph.world_size)
    for m in graph.modules:
        _forward(step, m)
    for m in reversed(graph.modules):
        _backward(step, m)
    if graph.world_size > 1 and graph.dense_param_bytes:
        step.collective(id="dense/grad_all_reduce", module="dense", groups=[], phase="backward", op="all_reduce",
                        role="dense_grad", dtype="float32", bytes_per_member=[graph.dense_param_bytes] * step.world,
                        data_dependent=False, issue="ddp_backward", wait="ddp_backward")
    return step.nodes


def _pg(world: int, exchange_pg: str) -> str:
    return f"{exchange_pg}[{world}]"


def _per_bucket(m: "LiftedModule", e: OutputExchange, nbytes: list[int], forward: bool
                ) -> list[tuple[Optional[int], str, list[int]]]:
    """(bucket, process group, bytes per member) of each all-to-all ``e`` runs: one (bucket None), or (split
    per bucket of a pooled group's lookups) one per bucket, its columns' share of the bytes: of
    the member's own columns forward, of every rank's (the member's samples' gradients) backward."""
    if not e.split:
        return [(None, e.process_group, nbytes)]
    (i,) = e.groups
    g = m.groups[i]
    out = []
    for k, (pg, per_rank) in enumerate(zip(e.split, g.bucket_columns(m.schedule.region("lookup", i).buckets))):
        widths = [len(c) for c in per_rank]
        share = [w / max(d, 1) for w, d in zip(widths, g.dim_sum_per_rank)] if forward else \
            [sum(widths) / max(sum(g.dim_sum_per_rank), 1)] * len(widths)
        out.append((k, pg, [round(n * f) for n, f in zip(nbytes, share)]))
    return out


def _suffix(bucket: Optional[int]) -> str:
    return "" if bucket is None else f"/b{bucket}"


def _forward(step: _Step, m: "LiftedModule") -> None:
    world, s, B = step.world, m.schedule, m.batch_size_per_rank
    lengths_size, values_size = DTYPE_BYTES[m.lengths_dtype], DTYPE_BYTES[m.values_dtype]
    prev: list[str] = []
    if m.feature_order:
        prev = [step.compute(id=f"{m.path}/permute", module=m.path, groups=[], phase="forward", op="permute",
                             rank=None, kernel=s.region("permute").kernel, tables=[],
                             workload={"ids": max(sum(stats.values()) for stats in m.ids_per_step),
                                       "keys": len(m.keys)}, workspace_bytes=0, after=[]).id]
    ready = {g.index: list(prev) for g in m.groups}  # what each group's next operation waits for
    for g in m.lifted_groups:
        if g.sharding_type in ROW_SHARDED:
            node = step.compute(id=f"{m.path}/g{g.index}/bucketize", module=m.path, groups=[g.index], phase="forward",
                                op="bucketize", rank=None, kernel=s.region("bucketize", g.index).kernel, tables=[],
                                workload={"ids": max(m.ids_per_member(g))}, workspace_bytes=0,
                                after=list(prev))
            ready[g.index] = [node.id]
    splits = {}
    for e in s.inputs:
        tensors = 3 + int(m.weighted)  # lengths, values, [weights,] batch size
        after = sorted({d for i in e.groups for d in ready[i]})
        splits[e.label] = step.collective(
            id=f"{m.path}/{e.label}/input_splits", module=m.path, groups=list(e.groups), phase="forward",
            op="all_to_all_single", role="input_splits", dtype="int64", process_group=_pg(world, e.process_group),
            bytes_per_member=[world * tensors * len(e.groups) * 8] * world, data_dependent=False, issue=e.issue,
            wait=e.issue, after=after)
    for e in s.inputs:
        base = dict(module=m.path, groups=list(e.groups), phase="forward", op="all_to_all_single",
                    process_group=_pg(world, e.process_group), issue=e.issue, wait=s.lookup_at,
                    after=[splits[e.label].id])
        if e.packing == "bytes":
            payload = [step.collective(id=f"{m.path}/{e.label}/input_payload", role="input_payload", dtype="uint8",
                                       bytes_per_member=_packed_bytes(m, e, world), data_dependent=True, **base)]
        else:
            (g,) = [m.groups[i] for i in e.groups]
            fan = world if g.sharding_type in ROW_SHARDED else 1
            ids = m.ids_per_member(g)
            payload = [step.collective(id=f"{m.path}/{e.label}/input_lengths", role="input_lengths",
                                       dtype=m.lengths_dtype, bytes_per_member=[
                                           len(g.features) * fan * B[r] * lengths_size for r in range(world)],
                                       data_dependent=False, **base),
                       step.collective(id=f"{m.path}/{e.label}/input_values", role="input_values",
                                       dtype=m.values_dtype, bytes_per_member=[round(i * values_size) for i in ids],
                                       data_dependent=True, **base)]
            if m.weighted:
                payload.append(step.collective(id=f"{m.path}/{e.label}/input_weights", role="input_weights",
                                               dtype="float32", bytes_per_member=[round(i * 4) for i in ids],
                                               data_dependent=True, **base))
        for i in e.groups:
            node = step.compute(id=f"{m.path}/g{i}/recat", module=m.path, groups=[i], phase="forward", op="recat",
                                rank=None, kernel=s.region("recat", i).kernel, tables=[],
                                workload={"keys": len(m.groups[i].features)}, workspace_bytes=0,
                                after=[payload[-1].id])
            ready[i] = [node.id]
    for g in m.groups:
        if g.not_lifted:
            ready[g.index] = [_kept(step, m, g, "forward", prev).id]
            continue
        lookups = []
        fed = m.fed_ids(g.features)
        held = g.tables_by_rank()
        for rank in (range(world) if g.sharding_type != "data_parallel" else [None]):
            owned = held.get(rank, [])
            if not owned:
                continue
            columns = g.dim_sum_per_rank[rank] if g.dim_sum_per_rank else sum(g.embedding_dims)
            if g.sharding_type == "data_parallel":
                rows_out, ids = B[0], max(m.ids_per_member(g))
            elif g.sharding_type in ROW_SHARDED:
                rows_out, ids = sum(B), sum(m.ids_per_member(g)) / world
            else:
                rows_out, ids = sum(B), sum(fed[k] for k in g.keys_on_rank(rank))
            lookups.append(step.compute(
                id=f"{m.path}/g{g.index}/lookup@{rank if rank is not None else 'all'}", module=m.path,
                groups=[g.index], phase="forward", op="lookup", rank=rank, kernel=s.region("lookup", g.index).kernel,
                tables=sorted({t.table for t in owned}),
                workload={"ids": ids, "rows": sum(t.rows for t in owned), "samples": rows_out},
                workspace_bytes=round((rows_out if m.pooled else ids) * columns * 4), after=ready[g.index]).id)
        ready[g.index] = lookups
    for e in s.outputs:
        groups = [m.groups[i] for i in e.groups]
        after = sorted({d for i in e.groups for d in ready[i]})
        if e.op == "all_to_all_single" and not m.pooled:
            # each member sends back a row for every id it received
            values = [sum(m.ids_to_each_rank(src, g, world)[r] * g.dim_sum_per_rank[r]
                          for g in groups for src in range(world)) for r in range(world)]
            role = "output_sequence"
        elif e.op == "all_to_all_single":
            values = [sum(sum(B) * g.dim_sum_per_rank[r] for g in groups) for r in range(world)]
            role = "output_pooled"
        else:
            values = [sum(B) * sum(groups[0].embedding_dims)] * world
            role = "output_partial_sums"
        dtype, size = WIRE_FORMATS.get(m.wire_format(role), ("float32", 4))
        nbytes = [round(v * size) for v in values]
        nodes = [step.collective(id=f"{m.path}/{e.label}/{role}{_suffix(bucket)}", module=m.path,
                                 groups=list(e.groups), phase="forward", op=e.op, role=role, dtype=dtype,
                                 process_group=_pg(world, pg), bytes_per_member=share, data_dependent=not m.pooled,
                                 issue=s.lookup_at, wait=e.wait, after=after, bucket=bucket)
                 for bucket, pg, share in _per_bucket(m, e, nbytes, forward=True)]
        for i in e.groups:
            ready[i] = [n.id for n in nodes]
    outputs = sorted({d for g in m.groups for d in ready[g.index]})
    # pooled: a [batch, columns] KeyedTensor; sequence: a row per id of each feature
    rows = B[0] if m.pooled else max(sum(stats.values()) for stats in m.ids_per_step)
    columns = sum(m.embedding_dims) if m.pooled else max(m.embedding_dims, default=0)
    step.compute(id=f"{m.path}/output", module=m.path, groups=[], phase="forward", op="output", rank=None,
                 kernel=s.region("output").kernel, tables=[], workload={"columns": columns},
                 workspace_bytes=round(rows * columns * 4), after=outputs)


def _backward(step: _Step, m: "LiftedModule") -> None:
    world, s, B = step.world, m.schedule, m.batch_size_per_rank
    start = {g.index: [f"{m.path}/output"] for g in m.groups}
    # the gradients' collectives in the order backward issues them
    for e in sorted(reversed(s.outputs), key=lambda e: POINTS.index(BACKWARD_OF[e.wait])):
        groups = [m.groups[i] for i in e.groups]
        if e.op == "all_to_all_single" and not m.pooled:
            # each member sends the gradient of a row for every id it sent
            op, role = "all_to_all_single", "grad_sequence"
            values = [sum(ids * g.dim_sum_per_rank[dst] for g in groups
                          for dst, ids in enumerate(m.ids_to_each_rank(r, g, world))) for r in range(world)]
        elif e.op == "all_to_all_single":
            op, role = "all_to_all_single", "grad_pooled"
            values = [B[r] * sum(sum(g.dim_sum_per_rank) for g in groups) for r in range(world)]
        else:
            op, role = "all_gather", "grad_all_gather"
            values = [B[r] * sum(groups[0].embedding_dims) for r in range(world)]
        dtype, size = WIRE_FORMATS.get(m.wire_format(role), ("float32", 4))
        nbytes = [round(v * size) for v in values]
        # autograd runs forward's points in reverse: issued where the forward waited, waited where it was issued
        nodes = [step.collective(id=f"{m.path}/{e.label}/{role}{_suffix(bucket)}", module=m.path,
                                 groups=list(e.groups), phase="backward", op=op, role=role, dtype=dtype,
                                 process_group=_pg(world, pg), bytes_per_member=share, data_dependent=not m.pooled,
                                 issue=BACKWARD_OF[e.wait], wait=BACKWARD_OF[s.lookup_at], after=[f"{m.path}/output"],
                                 bucket=bucket)
                 for bucket, pg, share in _per_bucket(m, e, nbytes, forward=False)]
        for i in e.groups:
            start[i] = [n.id for n in nodes]
    for g in reversed(m.groups):
        if g.not_lifted:
            _kept(step, m, g, "backward", start[g.index])
            continue
        if g.sharding_type == "data_parallel":
            grad = step.compute(id=f"{m.path}/g{g.index}/table_grad", module=m.path, groups=[g.index],
                                phase="backward", op="dense_grad", rank=None, kernel="torch",
                                tables=sorted({t.table for t in g.tables}), workload={"rows": sum(t.rows for t in g.tables)},
                                workspace_bytes=sum(t.rows * t.dim for t in g.tables) * 4, after=start[g.index])
            if world > 1:
                step.collective(id=f"{m.path}/g{g.index}/table_grad_all_reduce", module=m.path, groups=[g.index],
                                phase="backward", op="all_reduce", role="dp_table_grad", dtype="float32",
                                bytes_per_member=[sum(t.rows * t.dim for t in g.tables) * 4] * world,
                                data_dependent=False, issue="ddp_backward", wait="ddp_backward", after=[grad.id])
            continue
        held = g.tables_by_rank()
        for rank in range(world):
            owned = held.get(rank, [])
            if owned:
                step.compute(id=f"{m.path}/g{g.index}/fused_update@{rank}", module=m.path, groups=[g.index],
                             phase="backward", op="fused_update", rank=rank, kernel=s.region("lookup", g.index).kernel,
                             tables=sorted({t.table for t in owned}), workload={"rows": sum(t.rows for t in owned)},
                             workspace_bytes=0, after=start[g.index])


def _kept(step: _Step, m: "LiftedModule", g: "ShardingGroup", phase: str, after: list[str]) -> ComputeNode:
    """A group that keeps TorchRec's path: TorchRec's modules of the group run its input
    distribution, lookup and output distribution (backward: the gradients' exchanges and the
    fused update); their collectives are TorchRec's, issued inside this node, not listed here."""
    return step.compute(id=f"{m.path}/g{g.index}/torchrec_{phase}", module=m.path, groups=[g.index], phase=phase,
                        op="torchrec_group", rank=None, kernel="torchrec", tables=sorted({t.table for t in g.tables}),
                        workload={"ids": max(m.ids_per_member(g))},
                        workspace_bytes=0, after=list(after))


def _packed_bytes(m: "LiftedModule", e: InputExchange, world: int) -> list[int]:
    """Per member: its byte-packed payload of ``e``'s groups, each destination's chunk aligned."""
    lengths_size, values_size = DTYPE_BYTES[m.lengths_dtype], DTYPE_BYTES[m.values_dtype]
    groups = [m.groups[i] for i in e.groups]
    keys = [[len(g.features) if g.sharding_type in ROW_SHARDED else g.features_per_rank[dst] for dst in range(world)]
            for g in groups]
    id_size = values_size + (4 if m.weighted else 0)
    out = []
    done: dict[tuple[int, int], int] = {}  # (members holding one statistics object and batch: packed once)
    for member in range(world):
        same = (id(m.ids_per_step[member]), m.batch_size_per_rank[member])
        if same in done:
            out.append(done[same])
            continue
        sent = [m.ids_to_each_rank(member, g, world) for g in groups]
        rows = m.batch_size_per_rank[member] * lengths_size
        total = 0
        for dst in range(world):
            chunk = 0.0
            for ids_to, keys_to in zip(sent, keys):
                chunk += ids_to[dst] * id_size
                chunk += keys_to[dst] * rows
            total += aligned(round(chunk))
        done[same] = total
        out.append(total)
    return out

