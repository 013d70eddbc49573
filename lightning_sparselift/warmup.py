"""The SparseLift loop, driven one training step at a time: capture -> lift -> calibrate -> plan
-> install. Wrap every training step (forward, backward, optimizer step) in :meth:`step` (also
after the warmup: it announces the next batch to the executor) and call :meth:`after_step` after
it while the loop runs; the Lightning callback and the benchmark's bare loop both do.

1. capture: the first ``warmup_batches`` steps run TorchRec's path under
   :class:`~lightning_sparselift.capture.SparseCapture`;
2. lift: every rank lifts the graph, checks it against TorchRec's modules and compares
   fingerprints; any rank that cannot lift makes every rank keep TorchRec's path; the lifted
   executor is installed with the identity plan;
3. plan: a saved plan for the same setup (``plan_path``) whose graph is what its accepted
   candidates give on this run's graph is installed without calibration; otherwise (any problem
   with the file is logged) the planner proposes the selected passes' candidates, each is
   calibrated on real training steps (its pass's protocol) and kept if it makes the measured
   region faster on the slowest rank;
4. the final plan is installed for the rest of training and saved to ``plan_path`` (a failed
   write warns: the file is a cache).

Every decision is the same on every rank: inputs are all-gathered, measurements reduced.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_sparselift.capture import SparseCapture, gather_captures
from lightning_sparselift.cost.calibration import Calibrator
from lightning_sparselift.lift import LiftError, SparseGraph, check_against_runtime, dense_parameter_bytes, lift
from lightning_sparselift.plan.types import ExecutionPlan, PlanFileError, PlanFingerprint
from lightning_sparselift.runtime import InstalledExecutor, install


class SparseLiftWarmup:
    def __init__(self, model: nn.Module, sharding_plan: Any, module_paths: list[str], warmup_batches: int,
                 group: Any, device: torch.device, optimizations: Optional[list[str]] = None, calibrate: bool = True,
                 plan_path: Optional[str] = None) -> None:
        from lightning_sparselift.passes import select_passes

        if warmup_batches < 1:
            raise ValueError("the lifted executor needs warmup_batches >= 1: TorchRec builds its dists on the first "
                             "forward, and the lift is checked against them")
        self.model, self.sharding_plan, self.paths = model, sharding_plan, module_paths
        self.warmup_batches, self.group, self.device = warmup_batches, group, device
        self.passes = select_passes(optimizations or [])
        self.optimizations = sorted(optimizations or [])
        self.calibrate, self.plan_path = calibrate, plan_path
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.capture: Optional[SparseCapture] = SparseCapture(model, module_paths, self.rank, self.world)
        self.phase = "capture"
        self.installed: Optional[InstalledExecutor] = None
        self.plan: Optional[ExecutionPlan] = None
        self.fallback_reason: Optional[str] = None
        self.lift_seconds = 0.0
        self.plan_reused = False
        self.events: list[str] = []  # what happened, for the caller to report
        self._planner: Any = None
        self._queue: list[Any] = []  # feasible candidates still to calibrate
        self._calibrator: Optional[Calibrator] = None
        self._trial: Optional[SparseGraph] = None
        self._incumbent: Optional[SparseGraph] = None
        self._calibration_start = 0.0

    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def calibration_progress(self) -> Optional[tuple[int, int]]:
        """(steps calibrated, steps planned) while calibrating."""
        if self.phase != "calibrate" or self.plan is None:
            return None
        done_in_current = self._calibrator.recorded if self._calibrator is not None else 0
        remaining = sum(self._planner.passes[c.pass_name].protocol.steps for c in self._queue) - done_in_current
        return self.plan.calibration_steps, self.plan.calibration_steps + remaining

    # ------------------------------------------------------------------ per step
    def step(self, batch: Any = None, next_batch: Any = None) -> Any:
        """The context of one training step on ``batch`` (as the loop passes it to the model's
        step); ``next_batch`` is the batch the following step will train on, if the loop knows it
        (the ``next_batch`` schedule needs it). Call it for every step, also once done."""
        if self.phase == "capture":
            return self.capture.step(batch, next_batch)
        if self.installed is not None:
            self.installed.announce(next_batch)
        if self.phase == "calibrate":
            return self._calibration_step()
        return nullcontext()

    @contextmanager
    def _calibration_step(self) -> Iterator[None]:
        uses_candidate = self._calibrator.next_uses_candidate()
        self.installed.use(self._trial if uses_candidate else self._incumbent)
        self.installed.clock.take()
        start = time.perf_counter()
        yield
        whole_step_ms = (time.perf_counter() - start) * 1e3
        sparse_ms = self.installed.clock.take()
        self._calibrator.record(whole_step_ms if self._calibrator.protocol.region == "step" else sparse_ms)
        self.installed.use(self._incumbent)
        self.plan.calibration_steps += 1

    def after_step(self) -> bool:
        """Advance the loop after a wrapped step; True when this step finished the warmup (the
        final plan is installed, or TorchRec's path kept)."""
        if self.phase == "capture":
            if self.capture.steps < self.warmup_batches:
                return False
            start = time.perf_counter()
            self._lift_and_install()
            self.lift_seconds = time.perf_counter() - start
            if self.installed is None:
                self.phase = "done"
                return True
            self._plan()
        elif self.phase == "calibrate" and self._calibrator.done:
            self._decide()
        return self.phase == "done"

    # ------------------------------------------------------------------ lift
    def _all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _lift_and_install(self) -> None:
        capture, self.capture = self.capture, None
        capture.remove()
        captures = gather_captures(capture.result(), self.group)
        errors = [e for errors in self._all_gather(capture.errors()) for e in errors]
        graph, status = None, None
        if not errors:
            try:
                graph = lift(self.model, self.sharding_plan, self.paths, captures, self.group, self.device,
                             dense_parameter_bytes(self.model, self.paths))
                check_against_runtime(graph, self.model)
                status = graph.fingerprint()
            except LiftError as error:
                status = f"error: {error}"
        statuses = self._all_gather(status)
        errors += sorted({s[len("error: "):] for s in statuses if s and s.startswith("error: ")})
        if errors:
            self.fallback_reason = "; ".join(sorted(set(errors)))
            self.events.append(f"could not lift the sparse path, keeping TorchRec's: {self.fallback_reason}")
            return
        if len(set(statuses)) > 1:
            raise RuntimeError(f"ranks lifted different sparse graphs (fingerprints by rank: {statuses}); they would "
                               f"issue different collectives. Check that every rank runs the same model and sharding "
                               f"plan with the same input features.")
        self.installed = install(graph, self.model, self.group, self.device)
        self.events.append(f"lifted {len(graph.modules)} sparse module(s) after {self.warmup_batches} captured "
                           f"step(s); lifted executor installed ({len(graph.collectives())} collectives per step)")

    # ------------------------------------------------------------------ plan
    def _fingerprint(self, graph: SparseGraph) -> PlanFingerprint:
        import lightning_sparselift
        from lightning_sparselift.checkpoint import plan_summary

        return PlanFingerprint(graph=graph.fingerprint(), sharding_plan=PlanFingerprint.hash(plan_summary(
            self.sharding_plan)), world_size=self.world, backend=graph.backend,
            versions={**graph.versions, "lightning_sparselift": lightning_sparselift.__version__},
            optimizations=self.optimizations)

    def _saved_plan(self, fingerprint: PlanFingerprint, identity: SparseGraph) -> Optional[ExecutionPlan]:
        """The plan at ``plan_path`` if every rank can use it, else None (with the reason). Its graph is
        rebuilt from ``identity`` (this run's lift): the file's own graph is only compared, never run."""
        from pathlib import Path

        from lightning_sparselift.plan.planner import Planner

        try:
            if not self.plan_path or not Path(self.plan_path).exists():
                status: Any = "missing"
            else:
                plan = ExecutionPlan.load(self.plan_path)
                plan.check(fingerprint)
                plan.graph = Planner(self.passes, None, calibrate=False).rebuild(plan, identity)
                status = plan.graph.fingerprint()
        except PlanFileError as error:
            status = f"error: {error}"
        except Exception as error:  # still only a cache miss, and every rank must reach the all-gather below
            status = f"error: {type(error).__name__}: {error}"
        statuses = self._all_gather(status)
        if all(s == "missing" for s in statuses):
            return None
        if len(set(statuses)) == 1 and not statuses[0].startswith("error: "):
            return plan
        reasons = sorted({s for s in statuses if s.startswith("error: ") or s == "missing"})
        self.events.append(f"not reusing the plan at {self.plan_path} ({'; '.join(reasons) or 'ranks read different plans'}); "
                           f"planning again")
        return None

    def _plan(self) -> None:
        from lightning_sparselift.cost.priors import measure_priors
        from lightning_sparselift.plan.planner import Planner

        start = time.perf_counter()
        identity = self.installed.graph
        fingerprint = self._fingerprint(identity)
        saved = self._saved_plan(fingerprint, identity)
        if saved is not None:
            self.plan = saved
            self.plan_reused = True
            self.installed.use(saved.graph)
            self.phase = "done"
            self.events.append(f"reusing the plan at {self.plan_path} (no calibration): "
                               f"{len(saved.accepted)} optimization(s), {len(saved.graph.collectives())} collectives "
                               f"per step")
            return
        priors = measure_priors(self.group, self.device) if self.passes and self.calibrate else None
        self._planner = Planner(self.passes, priors, self.calibrate)
        self.plan = ExecutionPlan(fingerprint, identity, priors=priors.to_dict() if priors else None)
        self._incumbent = identity
        feasible, rejected = self._planner.propose(identity)
        self.plan.decisions.extend(rejected)
        if not self.calibrate:
            for candidate in feasible:
                self._incumbent = self._planner.apply(self._incumbent, candidate)
                self.plan.decisions.append(self._planner.decide(candidate, None))
            feasible = []
        self._queue = feasible
        self.plan.planning_s += time.perf_counter() - start
        self._calibration_start = time.perf_counter()
        self._next_candidate()

    def _next_candidate(self) -> None:
        if not self._queue:
            self._finish()
            return
        candidate = self._queue[0]
        protocol = self._planner.passes[candidate.pass_name].protocol
        self._trial = self._planner.apply(self._incumbent, candidate)
        self._calibrator = Calibrator(candidate.id, protocol)
        self.phase = "calibrate"
        predicted = self._planner.predict_ms(candidate)
        self.events.append(f"calibrating {candidate.id} ({protocol.steps} steps; predicted "
                           f"{predicted:+.3f} ms)" if predicted is not None else f"calibrating {candidate.id}")

    def _decide(self) -> None:
        candidate = self._queue.pop(0)
        measurement = self._calibrator.measurement(self.group)
        decision = self._planner.decide(candidate, measurement)
        self.plan.decisions.append(decision)
        if decision.accepted:
            self._incumbent = self._trial
        self.events.append(f"{candidate.id}: measured {measurement.increment_ms:+.3f} ms -> "
                           f"{'accepted' if decision.accepted else 'rejected'}")
        self._calibrator, self._trial = None, None
        self._next_candidate()

    def abandon(self, why: str) -> None:
        """Training stopped before the loop finished: keep the incumbent plan, record the
        candidates left undecided (the plan is not saved: a later run should calibrate them)."""
        if self.phase == "capture":
            self.capture.remove()
            self.capture = None
            self.fallback_reason = f"{why} before the {self.warmup_batches} capture step(s) ended"
        elif self.phase == "calibrate":
            from lightning_sparselift.plan.types import Decision

            for candidate in self._queue:
                self.plan.decisions.append(Decision(candidate.id, candidate.pass_name, candidate.module,
                                                    candidate.role, True, [], self._planner.predict_ms(candidate),
                                                    None, None, False, f"not calibrated: {why}"))
            self._queue = []
            self.plan.graph = self._incumbent
            self.installed.use(self._incumbent)
            self.events.append(f"calibration incomplete ({why}); the plan so far stays installed and is not saved")
        self.phase = "done"

    def _finish(self) -> None:
        plan = self.plan
        plan.calibration_s = time.perf_counter() - self._calibration_start if plan.calibration_steps else 0.0
        plan.graph = self._incumbent
        self.installed.use(self._incumbent)
        self.phase = "done"
        saved = f"; saved to {self.plan_path}" if self.plan_path else ""
        if self.plan_path and self.rank == 0:
            error = plan.save_as_cache(self.plan_path)
            if error is not None:
                saved = f"; not saved to {self.plan_path}: {error}"
        self.events.append(f"plan installed: {len(plan.accepted)} of {len(plan.decisions)} candidate(s) accepted, "
                           f"{len(plan.graph.collectives())} collectives per step; calibration "
                           f"{plan.calibration_steps} steps / {plan.calibration_s:.2f} s" + saved)
