"""What the sparse path and the plan become at a world size that never ran here: the workload's
graph at that size (:mod:`.scaling`), the step-time model's inputs from a hardware profile
instead of capture steps, and the planner deciding by the model alone
(:meth:`~lightning_sparselift.plan.planner.Planner.choose_by_model`). One model: every prediction
here is :meth:`StepModel.predict <lightning_sparselift.cost.step_model.StepModel.predict>`, the
function the planner's predictions and ``explain()`` read at run time.

The rest of the step, which the step-time model takes as measured at run time, is priced from the
profile: the dense forward and backward from their counted FLOPs at the profile's dense throughput
plus a launch per dense kernel, and the dense optimizer as three passes over the dense parameters
(on a profile of this machine both are timed here, on its cores per rank); the dense gradients'
all-reduce (DDP overlaps it with the backward: only what outlasts the dense backward shows, and
where the ranks share cores its bytes at the profile's backend CPU per MB).
On a profile of this machine TorchRec's step is also timed at one rank (:mod:`.one_rank`): its
lookups scale the byte model's lookups of the module at every world size (as a run's captured
lookups scale them at run time), and what the step took beyond the model's parts at one rank
(TorchRec's host work per step) is added at every world size.
TorchRec's path is the identity plan's schedule (the lifted executor runs TorchRec's step as
TorchRec does), so its prediction is the identity plan's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.cost.step_record import StepModelInputs, StepPrediction, StepTimings
from lightning_sparselift.passes import select_passes
from lightning_sparselift.passes.registry import PASSES
from lightning_sparselift.plan.planner import Planner
from lightning_sparselift.plan.types import Decision
from lightning_sparselift.simulate.profile import HardwareProfile
from lightning_sparselift.simulate.scaling import scaled_graph

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph
    from lightning_sparselift.simulate.workload import Workload

_OPTIMIZER_PASSES = 3.0  # a dense optimizer step reads and writes the parameters and their state


@dataclass
class Stages:
    """A predicted step in the bench's stages (ms)."""

    sparse_forward: float
    other_forward: float
    sparse_backward: float
    other_backward: float
    host: float = 0.0  # TorchRec's host work beyond the model's parts (timed at one rank; else 0)

    @property
    def step(self) -> float:
        return self.sparse_forward + self.other_forward + self.sparse_backward + self.other_backward + self.host


@dataclass
class WorldPrediction:
    """One world size: the identity plan's (TorchRec's path) and the chosen plan's predicted step."""

    world: int
    batch_per_rank: int
    placement: dict[str, int]  # sharding type -> tables
    identity: Stages
    plan: Stages
    accepted: list[str]  # the chosen plan's candidates
    decisions: list[Decision] = field(default_factory=list)
    identity_model: Optional[StepPrediction] = None  # the step-time model's own parts
    plan_model: Optional[StepPrediction] = None
    collectives: list[dict] = field(default_factory=list)  # the identity plan's: role, op, bytes, predicted ms

    @property
    def speedup(self) -> float:
        return self.identity.step / self.plan.step if self.plan.step > 0 else float("nan")


@dataclass
class DenseStep:
    """The rest of the step on one rank (ms), from the profile."""

    forward: float
    backward: float
    all_reduce: float  # the dense gradients' all-reduce, all of it
    exposed_all_reduce: float  # what outlasts the dense backward, and its backend CPU on shared cores
    optimizer: float
    windows: dict[str, float]  # per sparse module: the dense forward before its call
    host: float = 0.0  # TorchRec's host work per step beyond the model's parts (timed at one rank)
    lookup_scale: dict[str, float] = field(default_factory=dict)  # per module: timed / byte model (one rank)


def dense_step(workload: Workload, graph: SparseGraph, profile: HardwareProfile, batch: int) -> DenseStep:
    if profile.device.dense == "timed":
        if workload.timed is None:
            raise ValueError(f"profile {profile.name!r} prices the dense step as timed on this machine; the workload "
                             f"was not timed (probe it with threads)")
        scale = batch / workload.batch_size  # (timed at the workload's batch)
        forward, backward = workload.timed.forward_ms * scale, workload.timed.backward_ms * scale
        windows = {p: workload.timed.window_ms.get(p, 0.0) * scale for p in workload.module_paths}
        optimizer = workload.timed.optimizer_ms
        if workload.one_rank is None:
            raise ValueError(f"profile {profile.name!r} prices TorchRec's step as timed at one rank on this machine; "
                             f"the workload was not timed there")
    else:
        launch = profile.device.launch_us / 1e3
        forward = profile.dense_ms(workload.forward_flops * batch) + workload.forward_kernels * launch
        backward = profile.dense_ms(workload.backward_flops * batch) + workload.backward_kernels * launch
        share = {p: f / workload.forward_flops if workload.forward_flops else 0.0
                 for p, f in workload.window_flops.items()}
        windows = {p: profile.dense_ms(workload.window_flops.get(p, 0.0) * batch)
                   + workload.forward_kernels * share.get(p, 0.0) * launch for p in workload.module_paths}
        optimizer = _OPTIMIZER_PASSES * 2 * workload.dense_param_bytes / profile.bandwidth_bytes_per_ms
    reduced = all_reduce_bytes(workload, graph)
    all_reduce = profile.all_reduce_ms(graph.world_size, reduced)
    # DDP overlaps the all-reduce with the backward: what outlasts it shows, and where the ranks
    # share the cores the backend's reduction takes the training thread's core meanwhile (its CPU
    # per MB, as the sparse path's collectives are charged; 0 on a profile with spare cores)
    backend = profile.backend_cpu_ms_per_mb * reduced / 1e6 if graph.world_size > 1 else 0.0
    return DenseStep(forward, backward, all_reduce, max(all_reduce - backward, 0.0) + backend, optimizer, windows)


def all_reduce_bytes(workload: Workload, graph: SparseGraph) -> int:
    """The bytes DDP all-reduces per step: the dense parameters' gradients and the data-parallel
    tables'."""
    replicated = sum(t.rows * t.dim * 4 for m in graph.modules for g in m.groups
                     if g.sharding_type == "data_parallel" for t in g.tables)
    return workload.dense_param_bytes + replicated


def rest_of_step(workload: Workload, graph: SparseGraph, profile: HardwareProfile, batch: int) -> DenseStep:
    """:func:`dense_step`, and on a profile of this machine what TorchRec's step timed at one rank
    adds to it."""
    dense = dense_step(workload, graph, profile, batch)
    if profile.device.dense == "timed":
        dense.lookup_scale, dense.host = one_rank_terms(workload, profile)
    return dense


def model_inputs(graph: SparseGraph, dense: DenseStep, profile: HardwareProfile) -> StepModelInputs:
    """The step-time model's inputs at ``graph``'s world size from ``profile``: the identity plan's
    step is the rest of the step plus the model's own sparse path of the identity plan."""
    world = graph.world_size
    link = profile.all_to_all(world, f"world[{world}]")
    collectives = graph.collectives()
    identity_bytes = [sum(n.bytes_per_member[r] for n in collectives) for r in range(world)]
    timings = StepTimings([0.0] * world, {p: [w] * world for p, w in dense.windows.items()}, {},
                          [b / 1e6 * profile.backend_cpu_ms_per_mb for b in identity_bytes])
    inputs = StepModelInputs(timings, [link], profile.bandwidth_bytes_per_ms, profile.device.concurrent_lookups,
                             launch_ms=profile.device.launch_us / 1e3)
    model = StepModel(inputs, graph)
    if dense.lookup_scale:  # TorchRec's lookups as timed at one rank, at this world size's bytes
        timings.lookup_ms = {p: [ms * dense.lookup_scale.get(p, 1.0) for ms in per_rank]
                             for p, per_rank in model.reference_lookup_ms(graph).items()}
    # (each prediction scales the lookups by the timings it reads then: those just set)
    sparse = model.predict(graph).sparse_ms
    rest = dense.forward + dense.backward + dense.exposed_all_reduce + dense.optimizer + dense.host
    timings.step_ms = [rest + sparse] * world
    return inputs


def one_rank_terms(workload: Workload, profile: HardwareProfile) -> tuple[dict[str, float], float]:
    """(per sparse module: TorchRec's lookups timed at one rank over the byte model's, TorchRec's
    step timed at one rank beyond the model's prediction of it, which holds the dense step as
    timed, the lookups as timed and the copies as modelled)."""
    timed = workload.one_rank
    graph = scaled_graph(workload, 1, workload.batch_size, profile)
    dense = dense_step(workload, graph, profile, workload.batch_size)
    modelled = StepModel(model_inputs(graph, dense, profile), graph).reference_lookup_ms(graph)
    dense.lookup_scale = {p: timed.lookup_ms[p] / ms[0] for p, ms in modelled.items()
                          if ms[0] > 0 and timed.lookup_ms.get(p, 0.0) > 0}
    return dense.lookup_scale, timed.step_ms - model_inputs(graph, dense, profile).timings.step_ms[0]


def workload_threads(profile: HardwareProfile) -> Optional[int]:
    """The threads to time a workload's dense step on for ``profile`` (None: it is not timed)."""
    return max(1, round(profile.device.concurrent_lookups)) if profile.device.dense == "timed" else None


def simulate_world(workload: Workload, world: int, batch_per_rank: int, profile: HardwareProfile,
                   optimizations: Optional[list[str]] = None, numerics: str = "exact") -> WorldPrediction:
    graph = scaled_graph(workload, world, batch_per_rank, profile)
    dense = rest_of_step(workload, graph, profile, batch_per_rank)
    model = StepModel(model_inputs(graph, dense, profile), graph)
    planner = Planner(select_passes(optimizations or sorted(PASSES), numerics), model, calibrate=False)
    identity = model.predict(graph)
    chosen, decisions = planner.choose_by_model(graph, identity.step_ms)
    plan = model.predict(chosen)
    placement: dict[str, int] = {}
    for m in graph.modules:
        for g in m.groups:
            placement[g.sharding_type] = placement.get(g.sharding_type, 0) + len({t.table for t in g.tables})
    collectives = [{"id": n.id, "op": n.op, "bytes_per_member": max(n.bytes_per_member, default=0),
                    "predicted_ms": model.link(n.process_group).predict_ms(max(n.bytes_per_member, default=0))}
                   for n in graph.collectives() if n.issue != "ddp_backward"]
    return WorldPrediction(world, batch_per_rank, placement, _stages(identity, dense), _stages(plan, dense),
                           [d.candidate for d in decisions if d.accepted], decisions, identity, plan, collectives)


def _stages(p: StepPrediction, dense: DenseStep) -> Stages:
    return Stages(p.sparse_forward_ms, dense.forward, p.sparse_backward_ms,
                  dense.backward + dense.exposed_all_reduce + dense.optimizer, dense.host)
