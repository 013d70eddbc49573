"""The JSON graph fixtures of the process-free pass and planner tests, and the reasons the
passes give on them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from lightning_sparselift.cost.priors import AlphaBeta
from lightning_sparselift.cost.step_model import StepModel, StepModelInputs, StepTimings
from lightning_sparselift.ir import SparseGraph
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
                    fingerprint: Optional[PlanFingerprint] = None) -> ExecutionPlan:
    """What a run with calibrate=False plans: every feasible candidate of ``optimizations`` applied
    and accepted, in the planner's order (``fingerprint``: the plan's; default: made up from the graph)."""
    planner = Planner(select_passes(optimizations), None, calibrate=False)
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
