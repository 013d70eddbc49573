"""``sparselift``: the model as ``SparseLiftStrategy`` installs it, in a bare loop; its ablations
(the planner limited to some passes, or other strategy options); and what both it and the
``Trainer.fit`` system (``sparselift-lightning``, run by the runner) share."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lightning_sparselift.bench.measure import StageTimer
from lightning_sparselift.bench.systems.base import BenchEnv, LoopSystem, build_sharded
from lightning_sparselift.cost.decision import DecisionRule

if TYPE_CHECKING:
    from lightning_sparselift.runtime.install import InstalledExecutor


class SparseLift(LoopSystem):
    """The model as ``SparseLiftStrategy`` installs it, in a bare loop (no Lightning): TorchRec's
    path for the strategy's ``capture_steps`` captured steps, then the lifted executor."""

    name = "sparselift"

    def __init__(self, env: BenchEnv, strategy_kwargs: Optional[dict[str, Any]] = None):
        super().__init__(env)
        from lightning_sparselift import SparseLiftStrategy

        self.strategy = SparseLiftStrategy(**{**bench_strategy_kwargs(env), **(strategy_kwargs or {})})
        self._position = 0

    def setup(self) -> None:
        from lightning_sparselift.session import SparseLiftSession

        s = self.strategy
        self.model, self.optimizer, wrapped, paths = build_sharded(self.env, s.validate_inputs, s.sharding_types,
                                                                   s.embedding_optimizer, qcomms_config=s.qcomms_config)
        self.session = (SparseLiftSession(wrapped, self.model.plan, paths, dist.group.WORLD, torch.device("cpu"),
                                          s.session_options)
                        if s.executor == "sparselift" else None)
        self._timed_sharded(wrapped, self.optimizer)

    def step(self, step: int) -> None:
        # a continuous stream of batches (as TorchRec's pipelines read theirs), so the batch
        # announced as next is the one the next call trains on, across the runner's blocks
        position, self._position = self._position, self._position + 1
        if self.session is None:
            return super().step(position)
        self.session.begin_step(self.env.local_batch(position), self.env.local_batch(position + 1))
        super().step(position)
        if self.session.end_step():  # the plan is installed (or TorchRec's path kept)
            if self.session.installed is None:
                raise RuntimeError(f"sparselift: the sparse path could not be lifted: {self.session.fallback_reason}")
            time_early_starts(self.session.installed, self.timer)

    @property
    def ready(self) -> bool:
        return self.session is None or self.session.done

    def report(self) -> dict[str, Any]:
        return session_report(self.session)


class SparseLiftQComm(SparseLift):
    """``sparselift`` with TorchRec's quantized communication, as ``torchrec-qcomm`` runs it."""

    name = "sparselift-qcomm"

    def __init__(self, env: BenchEnv) -> None:
        from lightning_sparselift.bench.systems.torchrec import qcomms_config

        super().__init__(env, {"qcomms_config": qcomms_config()})


class SparseLiftFast(SparseLift):
    """``sparselift`` under ``numerics="fast"``: the communication-precision pass may send the
    output all-to-alls as BF16 (calibrated like every candidate)."""

    name = "sparselift-fast"

    def __init__(self, env: BenchEnv) -> None:
        super().__init__(env, {"numerics": "fast"})


def session_report(session: Any) -> dict[str, Any]:
    """What a SparseLift session lifted, planned and verified (the bare loop's and the Lightning
    system's alike)."""
    if session is None or session.installed is None:
        return {"executor": "torchrec"}
    graph, plan = session.installed.graph, session.plan
    return {"executor": "sparselift", "lift_s": session.lift_seconds, "graph_fingerprint": graph.fingerprint(),
            "graph_collectives_per_step": len(graph.collectives()), "graph_explain": graph.explain(),
            "calibration_s": plan.calibration_s, "calibration_steps": plan.calibration_steps,
            "calibration_excess_s": plan.calibration_excess_s, "cost_s": session.time.cost_s,
            "planning_s": plan.planning_s, "plan_explain": plan.explain(),
            "plan_decisions": [asdict(d) for d in plan.decisions],
            "kernel_builds": [asdict(b) for b in plan.kernel_builds],
            "predicted_change_ms": plan.predicted_change_ms, "measured_change_ms": plan.measured_change_ms,
            # the step-time model's inputs and predictions, and the graphs it predicted (recorded inputs
            # of its error table: benchmarks/step_model_error.py)
            "step_model": asdict(plan.step_model) if plan.step_model is not None else None,
            "identity_graph": session.identity.to_dict(), "plan_graph": plan.graph.to_dict(),
            # the steady-state check against the identity plan (predicted vs measured step change)
            "verification": asdict(session.verification) if session.verification else None,
            "verification_steps": sum(v.steps for v in session.verifications),
            "kernel_wait_steps": session.kernel_wait_steps}


def time_early_starts(installed: InstalledExecutor, timer: StageTimer) -> None:
    """Count latency hiding's early start (input dist, lookups, issuing the output all-to-all)
    as sparse forward in the stage breakdown: it runs before the sparse module's call, which is
    all the module hooks see."""
    installed.wrap_early_starts(timer.sparse_region)


def _ablation(name: str, optimizations: Optional[list[str]], doc: str, **options: Any) -> type[SparseLift]:
    """A ``sparselift`` system whose planner may use only ``optimizations`` (None: all), with
    other strategy ``options``."""
    def __init__(self, env: BenchEnv) -> None:
        SparseLift.__init__(self, env, {**({} if optimizations is None else {"optimizations": optimizations}),
                                        **options})

    return type(name, (SparseLift,), {"name": name, "__init__": __init__, "__doc__": doc})


ABLATIONS = [
    _ablation("sparselift-identity", [], "SparseLift's executor with the identity plan (no optimization pass)."),
    _ablation("sparselift-no-latency-hiding", ["aggregation", "codegen", "subgraph_parallelism"],
              "SparseLift without the latency-hiding pass."),
    _ablation("sparselift-no-aggregation", ["latency_hiding", "codegen", "subgraph_parallelism"],
              "SparseLift without the aggregation pass."),
    _ablation("sparselift-no-next-batch", ["aggregation", "latency_hiding:early_start", "codegen",
                                           "subgraph_parallelism"],
              "SparseLift without latency hiding's next-batch input distribution."),
    # (buckets run generated kernels: without code generation there is no subgraph parallelism either)
    _ablation("sparselift-no-codegen", ["aggregation", "latency_hiding"], "SparseLift without code generation."),
    _ablation("sparselift-no-subgraph", ["aggregation", "latency_hiding", "codegen"],
              "SparseLift without subgraph parallelism."),
    _ablation("sparselift-no-output-layout", ["aggregation", "latency_hiding", "codegen:lookup", "subgraph_parallelism"],
              "SparseLift without code generation's output layout (the model's concatenation copies)."),
    _ablation("sparselift-fresh-buffers", None, "SparseLift allocating its per-step buffers every step.",
              reuse_buffers=False),
]


# every feasible candidate applied without measuring (calibrate=False), under each numerics: the
# side-by-side effect of what numerics="fast" adds, whatever calibration would decide. Both leave
# subgraph parallelism out: its pipelined buckets and the BF16 exchanges exclude each other, so
# the two would run other plans besides the wire
_FORCED = ["aggregation", "latency_hiding", "codegen"]
UNCALIBRATED = [
    _ablation("sparselift-uncalibrated", _FORCED, "SparseLift with every feasible candidate of aggregation, latency "
              "hiding and code generation applied (calibrate=False).", calibrate=False),
    _ablation("sparselift-fast-uncalibrated", [*_FORCED, "communication_precision"], "sparselift-uncalibrated under "
              "numerics='fast': the output all-to-alls also send BF16.", calibrate=False, numerics="fast"),
]


def bench_strategy_kwargs(env: BenchEnv) -> dict[str, Any]:
    """The strategy options of both sparselift systems."""
    return {
        # off: the systems compare sparse paths (TorchRec checks nothing); benchmarks/checks_cost.py measures the checks
        "validate_inputs": False,
        "embedding_optimizer": env.scenario.embedding_optimizer(),
        # capture inside the untimed warmup (the strategy's default is 3 steps)
        "capture_steps": max(1, min(3, env.warmup_steps)),
        # the rule's budget in both, whatever length the bench's schedule gives sparselift-lightning's fit
        "calibration_max_steps": DecisionRule.max_steps,
    }

