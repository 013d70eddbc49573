"""Subgraph parallelism: a group's table-local lookup work split into G buckets of tables that run
concurrently, forward (pooling) and backward (the fused update) alike.

Each table's lookups, gradient accumulation and update touch only that table's rows and write
only its features' output columns, so buckets of whole tables are independent: a generated
kernel runs its buckets on the OpenMP threads torch uses, each with the arithmetic of the
one-bucket kernel, so results stay bit-identical. (fbgemm's reference kernel is one call over all of a module's tables; it cannot be
split, so the buckets' lookups run the generated kernel.)

Feasibility: some rank runs more than one intra-op thread (``torch.get_num_threads()`` when
captured: the buckets run on torch's OpenMP team, so with one thread they would run one after the
other), a group has a generated kernel on every rank (see the codegen pass) and some rank holds
at least two of its tables. Partitioning: each table weighs the ids its features bring per
step times its dim (what its pooling and update touch, from capture); tables, heaviest first,
go to the bucket whose load is least on the ranks holding a shard of them (a table sharded over
ranks is in one bucket everywhere, so the schedule names buckets by table, the same on all
ranks). Buckets that get no table on a rank are skipped there.

The candidates are the rungs of a sweep, G = 2, 4, 8: each rung is tried only after the one
before it was accepted (``Candidate.follows``), measured against it, so the sweep stops at the
first G that does not improve. Planning starts from the plan without buckets (G = 1), so the sweep
goes up from there. Calibration: one warmup pair, then paired observations of the lookup regions'
*wall* time (the training thread's CPU time would not see the work moved to other threads),
mirrored as the code generation's. Ranks with more threads than cores (e.g. two ranks of two
threads on two cores) are where the measurement rejects the buckets.
"""

from __future__ import annotations

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.cost.priors import Priors
from lightning_sparselift.ir import LiftedModule, SparseGraph
from lightning_sparselift.ir.graph import ShardingGroup
from lightning_sparselift.ir.schedule import GENERATED_KERNEL
from lightning_sparselift.passes.base import Candidate, OptimizationPass

BUCKET_COUNTS = (2, 4, 8)


def _role(count: int) -> str:
    return f"buckets{count}"


def _count(role: str) -> int:
    return int(role.removeprefix("buckets"))


def _table_weights(module: LiftedModule, group: ShardingGroup) -> dict[str, float]:
    """Per table: ids per step (all members' batches) times its dim; the dim alone when capture
    recorded no features for it."""
    out: dict[str, float] = {}
    for t in group.tables:
        ids = sum(m.get(f, 0.0) for m in module.ids_per_step for f in t.features)
        out[t.table] = max(out.get(t.table, 0.0), (ids if t.features else 1.0) * t.dim)
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


def _runs_in_buckets(group: ShardingGroup, buckets: list[list[str]]) -> bool:
    """Whether some rank holds tables of two buckets (else the buckets change nothing)."""
    bucket_of = {n: b for b, names in enumerate(buckets) for n in names}
    per_rank: dict[object, set] = {}
    for t in group.tables:
        per_rank.setdefault(t.rank, set()).add(bucket_of[t.table])
    return any(len(b) > 1 for b in per_rank.values())


class SubgraphParallelism(OptimizationPass):
    name = "subgraph_parallelism"
    roles = tuple(_role(g) for g in BUCKET_COUNTS)
    protocol = CalibrationProtocol(warmup_pairs=1, measured_pairs=2, region="lookup_wall", settle_steps=0,
                                   mirrored=True)
    uses_generated_kernels = True
    runs_after = ("codegen",)

    def candidates(self, graph: SparseGraph) -> list[Candidate]:
        out = super().candidates(graph)
        for c in out:
            count = _count(c.role)
            if count != BUCKET_COUNTS[0]:
                c.follows = f"{self.name}:{_role(count // 2)}@{c.module}"
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

    def check(self, graph: SparseGraph, module: LiftedModule, role: str) -> tuple[list[str], dict[str, float]]:
        count = _count(role)
        buckets = self._buckets(module, count)
        reasons = []
        if graph.threads_per_rank and max(graph.threads_per_rank) < 2:
            reasons = [f"every rank runs {max(graph.threads_per_rank)} intra-op thread (torch.get_num_threads()): "
                       f"buckets would run one after the other"]
        elif not buckets:
            reasons = [f"g{g.index} ({g.sharding_type}): " + (
                "no rank holds two of its tables" if GENERATED_KERNEL in g.lookup_kernels else
                "no generated lookup kernel (buckets run one): " + g.lookup_notes.get(
                    GENERATED_KERNEL, "none was built (the session builds them before planning)"))
                for g in module.lifted_groups]
        elif all(module.schedule.region("lookup", i).buckets == b for i, b in buckets.items()):
            reasons = ["already scheduled"]
        return reasons, {"buckets": float(count), "groups": float(len(buckets)),
                         "touched_bytes": module.touched_bytes(list(buckets))}

    def predict_ms(self, candidate: Candidate, priors: Priors) -> float:
        # the lookups' compute C (forward reads, backward reads and writes the touched rows) over
        # G buckets, as if each had a core of its own (the measurement says whether it has): C/G
        # after C/(G/2) at the rung before
        compute = 2 * priors.lookup.copy_ms(candidate.cost_inputs["touched_bytes"])
        return -compute / candidate.cost_inputs["buckets"]

    def rewrite(self, graph: SparseGraph, module: LiftedModule, candidate: Candidate) -> str:
        count = _count(candidate.role)
        buckets = self._buckets(module, count)
        for index, groups in buckets.items():
            region = module.schedule.region("lookup", index)
            region.kernel = GENERATED_KERNEL
            region.buckets = groups
        return (f"{module.path}: lookups of " + ", ".join(f"g{i} in {len(b)} concurrent buckets"
                                                          for i, b in buckets.items()))
