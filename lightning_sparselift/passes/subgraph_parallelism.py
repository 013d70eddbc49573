"""Subgraph parallelism: a group's table-local lookup work split into G buckets of tables that run
concurrently, forward (pooling) and backward (the fused update) alike.

Each table's lookups, gradient accumulation and update touch only that table's rows and write
only its features' output columns, so buckets of whole tables are independent: a generated
kernel runs its buckets on the OpenMP threads torch uses (host tables) or on CUDA streams (device
tables), each with the arithmetic of the one-bucket kernel, so results stay bit-identical.
(fbgemm's reference kernel is one call over all of a module's tables; it cannot be split, so the
buckets' lookups run the generated kernel.)

Feasibility: the device offers the buckets concurrency: on CPU some rank runs more than
one intra-op thread (``torch.get_num_threads()`` when captured: the buckets run on torch's OpenMP
team, so with one thread they would run one after the other); on GPUs each bucket's Triton
launches go to a CUDA stream of a small pool (see the Triton source). A group has a generated kernel
on every rank (see the codegen pass) and one for the rung's buckets (built off the training thread
for the sweep's next rung once the first is there, and only for a rung the step-time model
predicts a gain: :meth:`SubgraphParallelism.kernels_to_build`,
:func:`lightning_sparselift.session.kernel_builds.buckets_to_build`; so a trial never waits for a
compiler), some rank holds at least two of its tables, and the workspace
the buckets hold at once fits the graph's ``workspace_budget_bytes``: on CPU each thread running a
bucket keeps its own backward scratch (the generated kernel's, grown to the largest table it
accumulated: up to 56 B + 4 B x dim per id), so G buckets on T threads hold min(G, T) of them where
G = 1 holds one; on a GPU the buckets' streams allocate nothing (the backward's sort runs before
them on the caller's stream, and what they use is recorded on their streams until they are done),
so they hold nothing more than one bucket.

Partitioning: each table weighs the ids its features bring per
step times its dim (what its pooling and update touch, from capture); tables, heaviest first,
go to the bucket whose load is least on the ranks holding a shard of them (a table sharded over
ranks is in one bucket everywhere, so the schedule names buckets by table, the same on all
ranks). Buckets that get no table on a rank are skipped there.

The candidates are the rungs of a bidirectional sweep over G = 2, 4, 8 that starts at the
incumbent's G (``SparseGraph.incumbent_buckets``: the plan in use when the round began, e.g. before
a drift re-plan; 2 on a first round, whose incumbent runs one bucket) and is measured against
the plan of this round so far. Going up, each rung is tried only after the one below it was
accepted (``Candidate.follows``) and is measured against it; when the first step up (or the
start, at the top of the ladder) did not improve, the sweep turns down from the start, each rung
measured against the best so far, and stops at the first G that does not improve. Calibration:
one warmup pair, then paired observations of the lookup regions' *wall* time (the training
thread's CPU time would not see the work moved to other threads), mirrored as the code
generation's. Ranks with more threads than cores (e.g. two ranks of two
threads on two cores) are where the measurement rejects the buckets.
"""

from __future__ import annotations

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.ir import LiftedModule, SparseGraph
from lightning_sparselift.ir.explain import human_bytes
from lightning_sparselift.ir.graph import ShardingGroup, TableShard
from lightning_sparselift.ir.schedule import GENERATED_KERNEL, Region, bucket_process_group, describe_buckets
from lightning_sparselift.ir.vocab import ROW_SHARDED
from lightning_sparselift.passes.base import Candidate, OptimizationPass

BUCKET_COUNTS = (2, 4, 8)
# the two ladders: buckets run concurrently (threads, streams) or pipelined with their all-to-alls
CONCURRENT, PIPELINED = "buckets", "pipelined"


def _role(family: str, count: int) -> str:
    return f"{family}{count}"


def _family(role: str) -> str:
    return PIPELINED if role.startswith(PIPELINED) else CONCURRENT


def _count(role: str) -> int:
    return int(role.removeprefix(_family(role)))


def _start(incumbent: int, feasible: list[int]) -> int:
    """The rung a sweep starts at: the incumbent's G when it is a feasible rung, else the largest
    feasible rung below it, else the first rung."""
    below = [g for g in feasible if g <= incumbent]
    return max(below) if below else BUCKET_COUNTS[0]


def _table_ids(module: LiftedModule, table: TableShard) -> float:
    """The ids a table's features bring per step, all members' batches."""
    return sum(m.get(f, 0.0) for m in module.ids_per_step for f in table.features)


def _table_weights(module: LiftedModule, group: ShardingGroup) -> dict[str, float]:
    """Per table: ids per step (all members' batches) times its dim; the dim alone when capture
    recorded no features for it."""
    out: dict[str, float] = {}
    for t in group.tables:
        out[t.table] = max(out.get(t.table, 0.0), (_table_ids(module, t) if t.features else 1.0) * t.dim)
    return out


def partition(module: LiftedModule, group: ShardingGroup, count: int) -> list[list[str]]:
    """``group``'s tables in at most ``count`` buckets, balanced per rank (see the module docstring);
    the buckets that got a table, each in table order."""
    weights = _table_weights(module, group)
    ranks: dict[str, set] = {}
    for t in group.tables:
        ranks.setdefault(t.table, set()).add(t.rank)
    load: dict[tuple, float] = {}
    bucket_of: dict[str, int] = {}
    for name in sorted(weights, key=lambda n: (-weights[n], n)):
        best = min(range(count), key=lambda b: (max(load.get((r, b), 0.0) for r in ranks[name]), b))
        bucket_of[name] = best
        for r in ranks[name]:
            load[(r, best)] = load.get((r, best), 0.0) + weights[name]
    order = list(dict.fromkeys(t.table for t in group.tables))
    buckets = [[n for n in order if bucket_of[n] == b] for b in range(count)]
    return [b for b in buckets if b]


def contiguous_partition(module: LiftedModule, group: ShardingGroup, count: int) -> list[list[str]]:
    """``group``'s tables in at most ``count`` buckets that are runs of consecutive column blocks
    on every rank (each rank's tables cut into ``count`` segments of about equal weight, by
    each table's midpoint), so that a bucket's columns move as a few strided copies; the
    balanced :func:`partition` when a table has shards on several ranks."""
    ranks: dict[str, set] = {}
    for t in group.tables:
        ranks.setdefault(t.table, set()).add(t.rank)
    if any(len(r) > 1 for r in ranks.values()) or len(group.output_blocks) != len(module.batch_size_per_rank):
        return partition(module, group, count)
    weights = _table_weights(module, group)
    bucket_of: dict[str, int] = {}
    for blocks in group.output_blocks:
        tables = list(dict.fromkeys(b.table for b in blocks))
        total, at = sum(weights[n] for n in tables), 0.0
        for name in tables:
            middle = at + weights[name] / 2
            bucket_of[name] = min(count - 1, int(middle / total * count)) if total else 0
            at += weights[name]
    order = list(dict.fromkeys(t.table for t in group.tables))
    buckets = [[n for n in order if bucket_of[n] == b] for b in range(count)]
    return [b for b in buckets if b]


# the generated backward's scratch per id of a table: its hash keys and slots (up to 4 slots of
# 8 + 4 B per id: the table is the next power of two above 2x the ids), the distinct rows (8 B)
# and the accumulated gradient rows (4 B per column)
SCRATCH_BYTES_PER_ID = 56
SCRATCH_BYTES_PER_ID_AND_COLUMN = 4


def workspace_bytes(graph: SparseGraph, module: LiftedModule, groups: list[int], count: int) -> list[float]:
    """Per rank: the backward scratch ``count`` buckets of ``groups`` hold beyond one bucket's
    (on CPU the threads that run buckets at once, less the calling thread's, each with the scratch
    of the largest table of the rank; on GPUs none)."""
    if graph.device == "cuda":  # streams allocate nothing of their own (see the module docstring)
        return [0.0] * graph.world_size
    out = []
    for rank in range(graph.world_size):
        threads = graph.threads_per_rank[rank] if graph.threads_per_rank else count
        largest = 0.0
        for i in groups:
            group = module.groups[i]
            # a row-wise shard sees about its share of the table's ids
            share = 1 / graph.world_size if group.sharding_type in ROW_SHARDED else 1.0
            for t in group.tables:
                if t.rank in (rank, None):
                    ids = share * _table_ids(module, t)
                    largest = max(largest, ids * (SCRATCH_BYTES_PER_ID + SCRATCH_BYTES_PER_ID_AND_COLUMN * t.dim))
        out.append((min(count, threads) - 1) * largest)
    return out


def _runs_in_buckets(group: ShardingGroup, buckets: list[list[str]]) -> bool:
    """Whether some rank holds tables of two buckets (else the buckets change nothing)."""
    bucket_of = {n: b for b, names in enumerate(buckets) for n in names}
    per_rank: dict[object, set] = {}
    for t in group.tables:
        per_rank.setdefault(t.rank, set()).add(bucket_of[t.table])
    return any(len(b) > 1 for b in per_rank.values())


def _exchange_bytes(graph: SparseGraph, module: LiftedModule, group: ShardingGroup) -> list[float]:
    """Per rank: the bytes its pipelined buckets hold besides the one all-to-all's (the buckets'
    send and receive pieces: its output sent once, the module's output columns received once)."""
    b = module.batch_size_per_rank
    return [4.0 * (graph.world_size * b[r] * group.dim_sum_per_rank[r] + b[r] * sum(group.dim_sum_per_rank))
            for r in range(graph.world_size)]


class SubgraphParallelism(OptimizationPass):
    name = "subgraph_parallelism"
    roles = tuple(_role(f, g) for f in (CONCURRENT, PIPELINED) for g in BUCKET_COUNTS)
    protocol = CalibrationProtocol(warmup_pairs=1, region="lookup_wall", settle_steps=0)
    uses_generated_kernels = True
    runs_after = ("codegen",)

    def protocol_for(self, role: str) -> CalibrationProtocol:
        # pipelining hides exchanges behind compute: only the whole step's wall time sees it (its
        # waits are idle time), within the step
        if _family(role) == PIPELINED:
            return CalibrationProtocol(warmup_pairs=1, region="step", settle_steps=0)
        return self.protocol

    def candidates(self, graph: SparseGraph) -> list[Candidate]:
        out = super().candidates(graph)
        for module, family in [(m, f) for m in graph.modules for f in (CONCURRENT, PIPELINED)]:
            rungs = {_count(c.role): c for c in out if c.module == module.path and _family(c.role) == family}
            start = _start(graph.incumbent_buckets.get(module.path, 1), [g for g, c in rungs.items() if c.feasible])
            for count, c in rungs.items():
                if count > start:  # up: after the rung below improved
                    c.follows = rungs[count // 2].id
                elif count == start // 2:  # the turn: from the start, unless the first step up improved
                    c.follows, c.when = rungs[start].id, "decided"
                    c.unless = rungs[start * 2].id if start * 2 in rungs else None
                elif count < start:  # further down: after the rung above improved
                    c.follows = rungs[count * 2].id
        return out

    def _buckets(self, module: LiftedModule, count: int) -> dict[int, list[list[str]]]:
        """Per group that can run ``count`` buckets: its buckets."""
        out = {}
        for g in module.lifted_groups:
            if GENERATED_KERNEL not in g.lookup_kernels:
                continue
            buckets = partition(module, g, count)
            if len(buckets) > 1 and _runs_in_buckets(g, buckets):
                out[g.index] = buckets
        return out

    def _pipelined(self, graph: SparseGraph, module: LiftedModule, count: int
                   ) -> tuple[dict[int, list[list[str]]], list[str]]:
        """Per group that can pipeline ``count`` buckets: its buckets; and why the others cannot."""
        out, reasons = {}, []
        exchanges = {g: e for e in module.schedule.outputs for g in e.groups}
        for g in module.lifted_groups:
            e = exchanges.get(g.index)
            why = ""
            if e is None or e.op != "all_to_all_single" or not module.pooled:
                why = "no pooled output all-to-all of its own to split"
            elif module.wire or module.schedule.wire:
                why = (f"its output all-to-all is quantized ({'TorchRec codecs' if module.wire else 'communication precision'}), "
                       f"which the pipeline's pieces do not apply")
            elif len(e.groups) > 1:
                why = f"its output all-to-all carries {e.label} together (aggregation)"
            elif GENERATED_KERNEL not in g.lookup_kernels:
                why = "no generated lookup kernel (pipelined buckets run one bucket per call): " + g.lookup_notes.get(
                    GENERATED_KERNEL, "none was built (the session builds them from the lift on)")
            elif {t.rank for t in g.tables} != set(range(graph.world_size)):
                why = "some rank holds none of its tables"
            elif len(g.output_blocks) != graph.world_size:
                why = "the graph records no output blocks per rank (lifted by an older version)"
            else:
                buckets = contiguous_partition(module, g, count)
                if len(buckets) > 1 and _runs_in_buckets(g, buckets):
                    out[g.index] = buckets
                    continue
                why = "no rank holds tables of two buckets"
            reasons.append(f"g{g.index} ({g.sharding_type}): {why}")
        return out, reasons

    def kernels_to_build(self, graph: SparseGraph) -> dict[str, list[Region]]:
        # (every rung but for its kernels: the buckets of a rung that cannot run are not built)
        out: dict[str, list[Region]] = {}
        for module in graph.modules:
            for role in self.roles:
                reasons, _, buckets = self._rung(graph, module, role)
                if reasons or (self.only is not None and role not in self.only):
                    continue
                for index, tables in buckets.items():
                    group = module.groups[index]
                    wanted = Region("lookup", [index], GENERATED_KERNEL, buckets=tables)
                    if (tables not in group.built_buckets and bucket_kernel(tables) not in group.lookup_notes
                            and wanted not in out.get(module.path, [])):
                        out.setdefault(module.path, []).append(wanted)
        return out

    def check(self, graph: SparseGraph, module: LiftedModule, role: str) -> tuple[list[str], dict[str, float]]:
        reasons, cost_inputs, buckets = self._rung(graph, module, role)
        if not reasons:
            for index, tables in buckets.items():
                group = module.groups[index]
                if tables not in group.built_buckets:
                    reasons.append(f"g{index} ({group.sharding_type}): no generated lookup kernel in these "
                                   f"{len(tables)} buckets: " + group.lookup_notes.get(
                                       bucket_kernel(tables), "not built yet (the session builds it off the training "
                                                              "thread for a sweep's next rung, once the group's one-bucket "
                                                              "kernel is there)"))
        return reasons, cost_inputs

    def _rung(self, graph: SparseGraph, module: LiftedModule, role: str
              ) -> tuple[list[str], dict[str, float], dict[int, list[list[str]]]]:
        """Why ``role`` cannot apply to ``module`` but for its kernels in buckets, its cost inputs,
        and per group, its buckets."""
        if _family(role) == PIPELINED:
            return self._check_pipelined(graph, module, _count(role))
        count = _count(role)
        buckets = self._buckets(module, count)
        reasons = []
        if graph.device != "cuda" and graph.threads_per_rank and max(graph.threads_per_rank) < 2:
            reasons = [f"every rank runs {max(graph.threads_per_rank)} intra-op thread (torch.get_num_threads()): "
                       f"buckets would run one after the other"]
        elif not buckets:
            reasons = [f"g{g.index} ({g.sharding_type}): " + (
                "no rank holds two of its tables" if GENERATED_KERNEL in g.lookup_kernels else
                "no generated lookup kernel (buckets run one): " + g.lookup_notes.get(
                    GENERATED_KERNEL, "none was built (the session builds them from the lift on)"))
                for g in module.lifted_groups]
        elif all(module.schedule.region("lookup", i).buckets == b and not _split(module, i) for i, b in buckets.items()):
            reasons = ["already scheduled"]
        workspace = workspace_bytes(graph, module, list(buckets), count)
        budget = graph.workspace_budget_bytes
        if not reasons and budget is not None and max(workspace) > budget:
            rank = max(range(len(workspace)), key=lambda r: workspace[r])
            reasons = [f"the buckets hold {human_bytes(workspace[rank])} more backward scratch at once on rank {rank} "
                       f"(a scratch per thread running one) than the workspace budget of {human_bytes(budget)} "
                       f"(workspace_budget_mb)"]
        return reasons, {"buckets": float(count), "groups": float(len(buckets)),
                         "touched_bytes": module.touched_bytes(list(buckets)), "workspace_bytes": max(workspace)}, buckets

    def _check_pipelined(self, graph: SparseGraph, module: LiftedModule, count: int
                         ) -> tuple[list[str], dict[str, float], dict[int, list[list[str]]]]:
        buckets, reasons = self._pipelined(graph, module, count)
        if graph.world_size == 1:
            reasons = ["one rank: no all-to-all to pipeline"]
        elif graph.device == "cuda":
            reasons = ["device tables: their buckets run on CUDA streams (the buckets rungs); a Triton lookup "
                       "runs all its buckets per call, so they are not pipelined with their all-to-alls"]
        elif buckets:
            reasons = []
            if all(module.schedule.region("lookup", i).buckets == b and _split(module, i) for i, b in buckets.items()):
                reasons = ["already scheduled"]
        workspace = [sum(w) for w in zip(*[_exchange_bytes(graph, module, module.groups[i]) for i in buckets])] \
            if buckets else [0.0]
        budget = graph.workspace_budget_bytes
        if not reasons and budget is not None and max(workspace) > budget:
            rank = max(range(len(workspace)), key=lambda r: workspace[r])
            reasons = [f"the buckets' all-to-all pieces hold {human_bytes(workspace[rank])} more on rank {rank} than "
                       f"the workspace budget of {human_bytes(budget)} (workspace_budget_mb)"]
        exchanged = sum(max(_exchange_bytes(graph, module, module.groups[i])) / 2 for i in buckets)
        return reasons, {"buckets": float(count), "groups": float(len(buckets)),
                         "touched_bytes": module.touched_bytes(list(buckets)), "exchanged_bytes": exchanged,
                         "workspace_bytes": max(workspace)}, buckets

    def rewrite(self, graph: SparseGraph, module: LiftedModule, candidate: Candidate) -> str:
        count, family = _count(candidate.role), _family(candidate.role)
        buckets = self._buckets(module, count) if family == CONCURRENT else self._pipelined(graph, module, count)[0]
        for index, groups in buckets.items():
            region = module.schedule.region("lookup", index)
            region.kernel = GENERATED_KERNEL
            region.buckets = groups
            for e in module.schedule.outputs:
                if e.groups == [index]:
                    e.split = [bucket_process_group(b) for b in range(len(groups))] if family == PIPELINED else []
        how = "concurrent buckets" if family == CONCURRENT else "pipelined buckets, each all-to-all on its own process group"
        return f"{module.path}: lookups of " + ", ".join(f"g{i} in {len(b)} {how}" for i, b in buckets.items())


def bucket_kernel(buckets: list[list[str]]) -> str:
    """The name of a group's generated kernel for its tables in ``buckets`` (where the graph's
    ``lookup_notes`` say why there is none)."""
    return f"{GENERATED_KERNEL} ({describe_buckets(buckets)})"


def _split(module: LiftedModule, group: int) -> bool:
    """Whether ``group``'s output all-to-all is split per bucket."""
    return any(e.split for e in module.schedule.outputs if group in e.groups)
