"""The JSON graph fixtures of the process-free pass and planner tests, and the reasons the
passes give on them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from lightning_sparselift.cost.priors import AlphaBeta
from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.cost.step_record import StepModelInputs, StepTimings
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.ir.graph import OutputBlock, TableShard
from lightning_sparselift.ir.schedule import GENERATED_KERNEL
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import ExecutionPlan, PlanFingerprint, Planner

FIXTURES = Path(__file__).parent / "fixtures" / "graphs"
EBC = "model.sparse_arch.embedding_bag_collection"
USER, ITEM = "model.user_ebc", "model.item_ebc"

NOTHING_TO_MERGE = ("{} output all-to-all bucket(s): nothing to merge (row-wise reduce-scatters and data-parallel "
                    "groups have no all-to-all)")
COMPUTED_INPUT = ("the module's input was not among the root forward's arguments in the captured steps (the model "
                  "computes it), so it cannot start before the model reaches the module")
NOT_IN_BATCH = "the module's input was not found in the training step's batch on every rank (the model builds it)"


def load(name: str) -> SparseGraph:
    return SparseGraph.from_dict(json.loads((FIXTURES / f"{name}.json").read_text()))


def generated(graph: SparseGraph) -> SparseGraph:
    """As the session marks it once every rank built every group's generated kernel, then the
    kernels in buckets subgraph parallelism's rungs run."""
    from lightning_sparselift.passes.subgraph_parallelism import SubgraphParallelism

    for module in graph.modules:
        for group in module.groups:
            group.lookup_kernels.append(GENERATED_KERNEL)
    for path, regions in SubgraphParallelism().kernels_to_build(graph).items():
        for region in regions:
            graph.module(path).groups[region.groups[0]].built_buckets.append(region.buckets)
    return graph


def four_tables_two_ranks(kernels: bool = True) -> SparseGraph:
    """Two ranks of one thread each; g0 (table-wise) holds t0, t1 on rank 0 and t2, t3 on rank 1
    (t_k's feature brings 4 * (k + 1) ids per step on each rank); g1 stays the column-wise t_c.
    ``kernels``: its generated kernels built (as :func:`generated` marks them), else none yet."""
    graph = load("table_and_column_wise_2ranks")
    graph.threads_per_rank = [1, 1]
    module = graph.module(EBC)
    group = module.groups[0]
    template = group.tables[0]
    group.tables = [TableShard(f"t{k}", k // 2, 100, 4, 0, 0, template.kernel, template.pooling, [f"f{k}"])
                    for k in range(4)]
    group.features = [f"f{k}" for k in range(4)]
    group.features_per_rank, group.dim_sum_per_rank = [2, 2], [8, 8]
    group.embedding_names, group.embedding_dims = list(group.features), [4] * 4
    group.output_blocks = [[OutputBlock(f"t{k}", 4) for k in (2 * r, 2 * r + 1)] for r in range(2)]
    for stats in module.ids_per_step:
        stats.update({f"f{k}": 4.0 * (k + 1) for k in range(4)})
    return generated(graph) if kernels else graph


def step_model(identity: SparseGraph, alpha_ms: float = 0.05, beta_ms_per_byte: float = 1e-5,
               bandwidth_bytes_per_ms: float = 1e5, window_ms: float = 1.0, cores: float = 1.0,
               step_ms: float = 100.0) -> StepModel:
    """A step-time model with hand-made inputs (default: 0.05 ms + 10 ns/byte per all-to-all,
    copies at 100 MB/s, i.e. copy_ms(n) = 2n / 1e5; 1 ms of dense compute before every module's
    call on every rank, longer than any all-to-all here)."""
    world = identity.world_size
    timings = StepTimings([step_ms] * world, {m.path: [window_ms] * world for m in identity.modules})
    link = AlphaBeta("all_to_all_single", f"world[{world}]", alpha_ms, beta_ms_per_byte, [])
    return StepModel(StepModelInputs(timings, [link], bandwidth_bytes_per_ms, cores), identity)


def unmeasured_plan(identity: SparseGraph, optimizations: list[str],
                    fingerprint: Optional[PlanFingerprint] = None, numerics: str = "exact") -> ExecutionPlan:
    """What a run with calibrate=False plans: every feasible candidate of ``optimizations`` applied
    and accepted, in the planner's order (``fingerprint``: the plan's; default: made up from the graph)."""
    planner = Planner(select_passes(optimizations, numerics), None, calibrate=False)
    if fingerprint is None:
        fingerprint = PlanFingerprint(identity.fingerprint(), "sharding", identity.world_size, "gloo", {},
                                      sorted(optimizations))
    plan = ExecutionPlan(fingerprint, identity)
    feasible, plan.decisions = planner.propose(identity)
    for candidate in feasible:
        plan.graph = planner.apply(plan.graph, candidate)
        plan.decisions.append(planner.decide(candidate, None))
    return plan


def plan_file_dict() -> dict:
    """A valid plan file's content: every candidate of aggregation and latency hiding on the
    two-rank table- and column-wise fixture."""
    return json.loads(json.dumps(unmeasured_plan(load("table_and_column_wise_2ranks"),
                                                 ["aggregation", "latency_hiding"]).to_dict()))
