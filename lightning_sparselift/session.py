"""The SparseLift compiler session, driven one training step at a time: capture -> lift -> plan
-> install, and again from the lifted graph when asked (:meth:`SparseLiftSession.plan_again`).

Call :meth:`~SparseLiftSession.begin_step` before every training step and
:meth:`~SparseLiftSession.end_step` once its forward, backward and optimizer step ran, also once
the session is done (the step announces the next batch to the executor). ``SparseLiftStrategy``
does it from its hooks, the benchmark's bare loop around its steps.

1. capture: the first ``warmup_batches`` steps run TorchRec's path under
   :class:`~lightning_sparselift.frontend.capture.SparseCapture`;
2. lift: every rank lifts the graph, checks it against TorchRec's modules and compares
   fingerprints; any rank that cannot lift makes every rank keep TorchRec's path; the lifted
   executor is installed with the identity plan;
3. plan: a saved plan for the same setup (``plan_path``) whose graph is what its accepted
   candidates give on this run's graph is installed without calibration; otherwise (any problem
   with the file is logged) a planning round
   (:class:`~lightning_sparselift.plan.planner.PlanningLoop`) proposes the selected passes'
   candidates and calibrates each on real training steps (its pass's protocol), keeping it if it
   makes the measured region faster on the slowest rank;
4. install: the round's plan runs from then on and is saved to ``plan_path`` (a failed write
   warns: the file is a cache). :meth:`~SparseLiftSession.plan_again` starts another round from
   the lifted (identity) graph, calibrated and installed the same way;
5. verify (``verify_steps``): a calibrated plan that differs from the identity plan is measured
   against it on a window of interleaved real training steps
   (:class:`~lightning_sparselift.plan.verification.SteadyStateCheck`); slower beyond noise, the
   identity plan is installed instead (rolled back, with the numbers logged);
6. steady state: every ``drift_check_every`` steps the ranks compare the workload of the lifted
   modules' calls with the statistics the plan was decided on
   (:class:`~lightning_sparselift.plan.verification.DriftWatch`); when it moved beyond
   ``drift_ratio`` (e.g. bags longer than ``drift_ratio`` x the planned p99, another batch size)
   the session plans again from the live statistics, at most once per
   ``min_steps_between_replans`` steps. A reused plan file is checked against this run's captured
   statistics the same way before it is installed.

Every decision is the same on every rank: inputs are all-gathered, measurements reduced.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_sparselift._version import __version__
from lightning_sparselift.frontend.capture import SparseCapture, gather_captures
from lightning_sparselift.frontend.check import check_against_runtime
from lightning_sparselift.frontend.lift import LiftError, dense_parameter_bytes, lift
from lightning_sparselift.options import SessionOptions
from lightning_sparselift.plan.planner import Planner, PlanningLoop
from lightning_sparselift.plan.types import ExecutionPlan, KernelBuild, PlanFileError, PlanFingerprint
from lightning_sparselift.plan.verification import (
    DriftEvent, DriftWatch, PlanVerification, SteadyStateCheck, drift_findings,
    finding_statistics, settle_steps_for, workload_of,
)
from lightning_sparselift.runtime import InstalledExecutor, install
from lightning_sparselift.runtime.update_guard import UpdateCheck, no_check
from lightning_sparselift.sharding import plan_summary

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph


def mark_generated(graph: SparseGraph, builds: list[KernelBuild]) -> None:
    """Record in ``graph`` which groups have a generated lookup kernel, and which modules a consumer
    layout kernel and an input kernel, on every rank (``builds``: all ranks'), and why the others
    have none."""
    from lightning_sparselift.ir.schedule import CONSUMER_KERNEL, GENERATED_KERNEL, INPUT_KERNEL_GROUP, \
        OUTPUT_KERNEL_GROUP

    def record(module_path: str, group: int, name: str, kernels: list[str], notes: dict[str, str]) -> None:
        ranks = [b for b in builds if b.module == module_path and b.group == group]
        failed = [f"rank {b.rank}: {b.note}" for b in ranks if b.note]
        if failed:
            notes[name] = "; ".join(failed)
        elif ranks and name not in kernels:
            kernels.append(name)

    for module in graph.modules:
        record(module.path, OUTPUT_KERNEL_GROUP, CONSUMER_KERNEL, module.output_kernels, module.output_notes)
        record(module.path, INPUT_KERNEL_GROUP, GENERATED_KERNEL, module.input_kernels, module.input_notes)
        for group in module.lifted_groups:
            record(module.path, group.index, GENERATED_KERNEL, group.lookup_kernels, group.lookup_notes)


class SparseLiftSession:
    """Phases: ``capture`` (TorchRec's path, captured), ``plan`` (a planning round calibrates on
    the lifted executor), ``verify`` (the installed plan is measured against the identity plan),
    ``done`` (a plan installed, or TorchRec's path kept; the drift watch runs in ``verify`` and
    ``done``)."""

    def __init__(self, model: nn.Module, sharding_plan: Any, module_paths: list[str], group: Any,
                 device: torch.device, options: SessionOptions = SessionOptions(), check_group: Any = None,
                 before_update: UpdateCheck = no_check) -> None:
        """``check_group``: a process group for the drift checks and the verification's exchange
        (default ``group``): a group of their own does not wait behind exchanges left in flight.
        ``before_update``: called in every lifted module's backward before anything is updated (it
        raises to stop the step; see :mod:`~lightning_sparselift.runtime.update_guard`)."""
        from lightning_sparselift.passes import select_passes

        if options.warmup_batches < 1:
            raise ValueError("the lifted executor needs warmup_batches >= 1: TorchRec builds its dists on the first "
                             "forward, and the lift is checked against them")
        self.options = options
        self.model, self.sharding_plan, self.paths = model, sharding_plan, module_paths
        self.group, self.device, self.before_update = group, device, before_update
        self.passes = select_passes(list(options.optimizations))
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.capture: Optional[SparseCapture] = SparseCapture(model, module_paths, self.rank, self.world)
        self.phase = "capture"
        self.installed: Optional[InstalledExecutor] = None
        self.identity: Optional[SparseGraph] = None  # the lifted graph before any pass
        self.plan: Optional[ExecutionPlan] = None  # the plan installed last
        self.loop: Optional[PlanningLoop] = None  # the planning round in progress
        self.fallback_reason: Optional[str] = None
        self.lift_seconds = 0.0
        self.plan_reused = False
        self.events: list[str] = []  # what happened, for the caller to report
        self._capture_step: Optional[ContextManager[None]] = None  # the captured step in progress
        self._in_step = False
        self._step_start = self._step_cpu_start = 0.0
        # steady state: verification and drift
        self.check_group = check_group if check_group is not None else group
        self.steps = 0  # training steps ended since the session began
        self.started = time.perf_counter()
        self.overhead_s = 0.0  # lift, planning, calibration and verification time of the phases finished
        # what those phases cost the run: the compiler's own work (lift with its kernel builds,
        # planning) and the calibration and verification steps' excess over the installed plan
        # (those steps trained; only their excess is lost)
        self.cost_s = 0.0
        self.verification: Optional[PlanVerification] = None  # the installed plan's last steady-state check
        self.verifications: list[PlanVerification] = []  # every steady-state check, in order
        self.drift_events: list[DriftEvent] = []
        self.trigger: Optional[DriftEvent] = None  # why the installed plan's round ran (None: the first one)
        self.rollbacks = 0
        self.metrics: dict[str, float] = {}  # logger metrics not reported yet (the caller takes them)
        self.warnings: list[str] = []  # warnings not reported yet
        self.watch: Optional[DriftWatch] = None
        self._check: Optional[SteadyStateCheck] = None  # the steady-state check in progress
        self._verify_start = 0.0
        self._round_started = 0  # self.steps when the last planning round began
        self._drift_noted: Optional[str] = None  # the deferred / ignored drift already reported
        self._decided_on: Optional[SparseGraph] = None  # a reused plan file's graph (its statistics)
        self.kernel_builds: list[KernelBuild] = []  # the generated kernels built before planning, every rank's

    @property
    def done(self) -> bool:
        """Nothing left to do on later steps (until :meth:`plan_again`)."""
        return self.phase == "done"

    @property
    def calibration_progress(self) -> Optional[tuple[int, int]]:
        """(steps calibrated, steps planned) while a planning round calibrates."""
        return self.loop.progress if self.loop is not None else None

    # ------------------------------------------------------------------ per step
    def begin_step(self, batch: Any = None, next_batch: Any = None) -> None:
        """Before a training step on ``batch`` (as the loop passes it to the model's step);
        ``next_batch`` is the batch the following step will train on, if the loop knows it (the
        ``next_batch`` schedule needs it)."""
        self._drop_step()
        self._in_step = True
        if self.phase == "capture":
            self._capture_step = self.capture.step(batch, next_batch)
            self._capture_step.__enter__()
            return
        if self.installed is not None:
            self.installed.announce(next_batch)
        if self.phase == "plan":
            self.installed.use(self.loop.next_graph())
            self.installed.clock.take()
            self.installed.clock.take_lookup()
            self.installed.clock.take_input()
            self._step_start, self._step_cpu_start = time.perf_counter(), time.thread_time()
        elif self.phase == "verify":
            self.installed.use(self.plan.graph if self._check.next_uses_candidate() else self.identity)
            self._step_start = time.perf_counter()

    def end_step(self) -> bool:
        """After the step begun last (its forward, backward and optimizer step ran): record it and
        advance. True when this step finished a round: the plan is installed, or TorchRec's path
        kept (see :attr:`fallback_reason`). What the steady state brings later (a steady-state
        check's result, a rollback, drift) comes through :attr:`events`, :attr:`warnings` and
        :attr:`metrics`."""
        if not self._in_step:
            return False
        self._in_step = False
        self.steps += 1
        if self.phase == "capture":
            self._leave_capture_step()
            if self.capture.steps < self.options.warmup_batches:
                return False
            start = time.perf_counter()
            self._lift_and_install()
            self.capture = None  # (kept while lifting: if the lift raises, abandon() keeps TorchRec's path)
            self.lift_seconds = time.perf_counter() - start
            self.overhead_s += self.lift_seconds
            self.cost_s += self.lift_seconds
            if self.installed is None:
                self.phase = "done"
                return True
            return self._plan(reuse_saved=True)
        if self.phase == "plan":
            step_ms = (time.perf_counter() - self._step_start) * 1e3
            # (on CUDA the training thread's clock misses the device's work: the step's wall time)
            step_cpu_ms = (time.thread_time() - self._step_cpu_start) * 1e3 if self.device.type == "cpu" else step_ms
            sparse_ms, (lookup_ms, lookup_wall_ms) = self.installed.clock.take(), self.installed.clock.take_lookup()
            self.installed.use(self.loop.incumbent)
            self.loop.feedback(step_ms, sparse_ms, lookup_ms, lookup_wall_ms, step_cpu_ms,
                               self.installed.clock.take_input())
            if self.loop.done:
                self._finish()
                return True
            return False
        if self.installed is None:
            return False
        if self.phase == "verify":
            step_ms = (time.perf_counter() - self._step_start) * 1e3
            self.installed.use(self.plan.graph)
            self._check.record(step_ms)
            if self._check.done:
                self._conclude_verification()
        return self._watch_step()

    def _drop_step(self) -> None:
        """Close a step begun but never ended: it did not train (Lightning skips the batch when
        the LightningModule's ``on_train_batch_start`` returns -1, or the step raised). A captured
        step still counts; a calibration step is not measured."""
        if not self._in_step:
            return
        self._in_step = False
        if self.phase == "capture":
            self._leave_capture_step()
        elif self.phase == "plan":
            self.installed.use(self.loop.incumbent)
        elif self.phase == "verify":
            self.installed.use(self.plan.graph)

    def _leave_capture_step(self) -> None:
        step, self._capture_step = self._capture_step, None
        step.__exit__(None, None, None)

    # ------------------------------------------------------------------ rounds
    def plan_again(self, reason: str, trigger: Optional[DriftEvent] = None) -> None:
        """Start a new planning round from the lifted (identity) graph: the next steps calibrate
        the candidates on top of it as the first round did, and its plan is installed (and saved
        to ``plan_path``, which is not read: the round exists to measure again). Call it between
        steps, on every rank at the same step (the priors are measured with collectives). A
        steady-state check in progress is stopped (not judged)."""
        if self.phase == "verify" and not self._in_step:
            self._stop_verification(f"planning again ({reason})")
        if self.phase != "done":
            raise RuntimeError(f"SparseLift cannot plan again ({reason}): the session is still in its {self.phase} "
                               f"phase")
        if self.installed is None:
            raise RuntimeError(f"SparseLift cannot plan again ({reason}): TorchRec's path is in use "
                               f"({self.fallback_reason})")
        if self._in_step:
            raise RuntimeError(f"SparseLift cannot plan again ({reason}) during a training step")
        self.events.append(f"planning again: {reason}")
        # (subgraph parallelism's sweep starts from the buckets of the plan in use)
        self.identity.incumbent_buckets = self.plan.graph.lookup_buckets() if self.plan is not None else {}
        self.plan_reused = False
        self.trigger = trigger
        self._plan(reuse_saved=False)

    def explain(self) -> str:
        """The installed plan explained, then what happened to it in steady state: its steady-state
        checks, rollbacks, workload drift and re-planning, and what the compiler cost so far."""
        if self.plan is None:
            return f"SparseLift session in its {self.phase} phase" + (
                f"; TorchRec's path kept: {self.fallback_reason}" if self.fallback_reason else "")
        lines = [self.plan.explain()]
        if self.trigger is not None:
            lines.append(f"planned because of the workload drift at step {self.trigger.step} ({self.trigger.action})"
                         if self.trigger in self.drift_events else f"planned because of {self.trigger.describe()}")
        lines += [f"verification {i + 1}: {v.describe()}" for i, v in enumerate(self.verifications)]
        lines += [f"drift: {e.describe()}" for e in self.drift_events]
        lines.append(f"compiler time so far: {self.overhead_s:.2f} s ({self.calibration_fraction:.2%} of "
                     f"{time.perf_counter() - self.started:.1f} s, {self.steps} training steps; the calibration steps "
                     f"trained), costing the run {self.cost_s:.2f} s ({self.cost_fraction:.2%}: lift, planning and the "
                     f"trial steps' excess over the installed plan); {self.rollbacks} rollback(s), {self.replans} "
                     f"re-plan(s) on drift")
        return "\n".join(lines)

    @property
    def replans(self) -> int:
        """Planning rounds started because the workload drifted."""
        return sum(e.action.startswith("re-planned") for e in self.drift_events)

    def _share(self, seconds: float) -> float:
        """``seconds`` as a fraction of the time since the session began."""
        elapsed = time.perf_counter() - self.started
        return seconds / elapsed if elapsed > 0 else 0.0

    @property
    def calibration_fraction(self) -> float:
        """Lift, planning, calibration and steady-state verification time as a fraction of the time
        since the session began (the phases finished so far)."""
        return self._share(self.overhead_s)

    @property
    def cost_fraction(self) -> float:
        """What the compiler cost the run (:attr:`cost_s`) as a fraction of the time since the
        session began."""
        return self._share(self.cost_s)

    def _report_shares(self) -> None:
        self.metrics["sparselift/calibration_fraction"] = self.calibration_fraction
        self.metrics["sparselift/cost_fraction"] = self.cost_fraction

    def abandon(self, why: str) -> None:
        """Training stopped before the session finished: keep TorchRec's path (still capturing) or
        the incumbent plan (calibrating), recording the candidates left undecided; that plan is
        not saved (a later run should calibrate them)."""
        self._drop_step()
        if self.capture is not None:  # capturing, or the lift raised
            self.capture.remove()
            self.capture = None
            self.fallback_reason = f"{why} before the {self.options.warmup_batches} capture step(s) ended"
        elif self.loop is not None:
            loop, self.loop = self.loop, None
            loop.abandon(why)
            self.plan = loop.plan
            self.installed.use(loop.plan.graph)
            self.events.append(f"calibration incomplete ({why}); the plan so far stays installed and is not saved")
        elif self.phase == "verify":
            self._stop_verification(why)
        self.phase = "done"

    # ------------------------------------------------------------------ lift
    def _all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _lift_and_install(self) -> None:
        capture = self.capture
        capture.remove()
        captures = gather_captures(capture.result(), self.group)
        # a module whose captured input cannot be lifted (on any rank) keeps TorchRec's path
        failed: dict[str, str] = {}
        for rank_errors in self._all_gather(capture.errors()):
            for path, error in rank_errors.items():
                failed.setdefault(path, error)
        remaining = [p for p in self.paths if p not in failed]  # (the same on every rank: gathered)
        graph, status = None, None
        if remaining:
            try:
                graph = lift(self.model, self.sharding_plan, remaining, captures, self.group, self.device,
                             dense_parameter_bytes(self.model, self.paths))
                graph.not_lifted.update(failed)
                graph.workspace_budget_bytes = self.options.workspace_budget_bytes
                check_against_runtime(graph, self.model)
                status = graph.fingerprint()
            except LiftError as error:
                status = f"error: {error}"
        statuses = self._all_gather(status)
        errors = sorted({s[len("error: "):] for s in statuses if s and s.startswith("error: ")})
        if errors or not remaining:
            self.fallback_reason = "; ".join(sorted(set(failed.values())) + errors)
            self.events.append(f"could not lift the sparse path, keeping TorchRec's: {self.fallback_reason}")
            return
        if len(set(statuses)) > 1:
            raise RuntimeError(f"ranks lifted different sparse graphs (fingerprints by rank: {statuses}); they would "
                               f"issue different collectives. Check that every rank runs the same model and sharding "
                               f"plan with the same input features.")
        self.installed = install(graph, self.model, self.group, self.device, self.options.reuse_buffers,
                                 self.options.numerics)
        self.installed.observe(self._observe)
        self.installed.guard_updates(self.before_update)
        if any(p.uses_generated_kernels for p in self.passes):
            self._build_kernels(graph)
        self.identity = graph
        self.events.append(f"lifted {len(graph.modules)} sparse module(s) after {self.options.warmup_batches} captured "
                           f"step(s); lifted executor installed ({len(graph.collectives())} collectives per step)")
        self.events += [f"kept on TorchRec's path: module {path}: {why}" for path, why in graph.not_lifted.items()]
        self.events += [f"kept on TorchRec's path: {m.path} group {g.index}: {g.not_lifted}"
                        for m in graph.modules for g in m.groups if g.not_lifted]

    def _build_kernels(self, graph: SparseGraph) -> None:
        """Build every group's generated lookup kernel, every consumer layout and input kernel on every rank
        (compile time stays out of the timed steps) and record in ``graph`` which groups and modules
        have one on all ranks: the codegen pass proposes only those, so every rank plans alike."""
        builds = self.kernel_builds = [KernelBuild(rank=rank, **b) for rank, ranks in enumerate(self._all_gather(
            self.installed.build_generated())) for b in ranks]
        mark_generated(graph, builds)
        built = [b for b in builds if not b.note]
        if built:
            self.events.append(f"generated kernels (lookups, output layouts, input sides): {len(built)} built on {self.world} "
                               f"rank(s), {sum(b.cached for b in built)} from the cache, "
                               f"{max(b.seconds for b in built):.2f} s at most per kernel")

    # ------------------------------------------------------------------ plan
    def _fingerprint(self, graph: SparseGraph) -> PlanFingerprint:
        return PlanFingerprint(graph=graph.fingerprint(), sharding_plan=PlanFingerprint.hash(plan_summary(
            self.sharding_plan)), world_size=self.world, backend=graph.backend,
            versions={**graph.versions, "lightning_sparselift": __version__},
            optimizations=list(self.options.optimizations))

    def _saved_plan(self, fingerprint: PlanFingerprint, identity: SparseGraph) -> Optional[ExecutionPlan]:
        """The plan at ``plan_path`` if every rank can use it, else None (with the reason). Its graph is
        rebuilt from ``identity`` (this run's lift): the file's own graph is only compared, never run."""
        from pathlib import Path

        findings: list = []
        try:
            if not self.options.plan_path or not Path(self.options.plan_path).exists():
                status: Any = "missing"
            else:
                plan = ExecutionPlan.load(self.options.plan_path)
                plan.check(fingerprint)
                decided_on = plan.graph  # the file's graph: the statistics the plan was decided on
                plan.graph = Planner(self.passes, None, calibrate=False).rebuild(plan, identity)
                status = plan.graph.fingerprint()
                findings = drift_findings(workload_of(decided_on), workload_of(identity), self.options.drift_ratio)
                if findings:
                    status = "drift: " + "; ".join(f.text for f in findings)
        except PlanFileError as error:
            status = f"error: {error}"
        except Exception as error:  # still only a cache miss, and every rank must reach the all-gather below
            status = f"error: {type(error).__name__}: {error}"
        statuses = self._all_gather(status)
        if all(s == "missing" for s in statuses):
            return None
        if len(set(statuses)) == 1 and statuses[0].startswith("drift: "):
            event = DriftEvent(self.steps, statuses[0][len("drift: "):].split("; "),
                               finding_statistics(findings), f"the plan at {self.options.plan_path} is not reused")
            self.drift_events.append(event)
            self.trigger = event
            self.events.append(f"not reusing the plan at {self.options.plan_path}: it was decided on other workload "
                               f"statistics than this run's captured ones ({statuses[0][len('drift: '):]}); "
                               f"planning again")
            return None
        if len(set(statuses)) == 1 and not statuses[0].startswith("error: "):
            self._decided_on = decided_on
            return plan
        reasons = sorted({s for s in statuses if s.startswith("error: ") or s == "missing"})
        if any(s.startswith("drift: ") for s in statuses):
            reasons.append("workload drift on some ranks: " + "; ".join(sorted({s[len("drift: "):] for s in statuses
                                                                               if s.startswith("drift: ")})))
        self.events.append(f"not reusing the plan at {self.options.plan_path} ({'; '.join(reasons) or 'ranks read different plans'}); "
                           f"planning again")
        return None

    def _plan(self, reuse_saved: bool) -> bool:
        """Start a planning round (or install the saved plan); True when a plan was installed."""
        from lightning_sparselift.cost.priors import measure_priors

        start = time.perf_counter()
        self.watch = None
        self._round_started = self.steps
        fingerprint = self._fingerprint(self.identity)
        saved = self._saved_plan(fingerprint, self.identity) if reuse_saved else None
        if saved is not None:
            self.plan = saved
            saved.kernel_builds = self.kernel_builds
            self.plan_reused = True
            self.installed.use(saved.graph)
            self._record_bucket_builds(saved)
            self.events.append(f"reusing the plan at {self.options.plan_path} (no calibration): "
                               f"{len(saved.accepted)} optimization(s), {len(saved.graph.collectives())} collectives "
                               f"per step")
            reuse_s = time.perf_counter() - start
            self.overhead_s += reuse_s
            self.cost_s += reuse_s
            self._steady(saved, self._decided_on)
            return True
        priors = measure_priors(self.group, self.device) if self.passes and self.options.calibrate else None
        planner = Planner(self.passes, priors, self.options.calibrate, self.options.decision_rule)
        self.loop = PlanningLoop(planner, fingerprint, self.identity, self.group, self.events)
        self.loop.plan.kernel_builds = self.kernel_builds
        self.phase = "plan"
        self.loop.propose(since=start)
        if self.loop.done:
            self._finish()
            return True
        return False

    def _record_bucket_builds(self, plan: ExecutionPlan) -> None:
        """Add to ``plan`` the kernels in buckets every rank built for it or its trials (every rank
        installs a plan at the same step)."""
        plan.kernel_builds = plan.kernel_builds + [KernelBuild(rank=rank, **b) for rank, ranks in enumerate(
            self._all_gather(self.installed.take_bucket_builds())) for b in ranks]

    def _finish(self) -> None:
        loop, self.loop = self.loop, None
        plan = self.plan = loop.plan
        self.installed.use(plan.graph)
        self._record_bucket_builds(plan)
        self.phase = "done"
        saved = f"; saved to {self.options.plan_path}" if self.options.plan_path else ""
        if self.options.plan_path and self.rank == 0:
            error = plan.save_as_cache(self.options.plan_path)
            if error is not None:
                saved = f"; not saved to {self.options.plan_path}: {error}"
        self.events.append(f"plan installed: {len(plan.accepted)} of {len(plan.decisions)} candidate(s) accepted, "
                           f"{len(plan.graph.collectives())} collectives per step; calibration "
                           f"{plan.calibration_steps} steps / {plan.calibration_s:.2f} s" + saved)
        self.overhead_s += plan.planning_s + plan.calibration_s
        self.cost_s += plan.planning_s + (plan.calibration_excess_s or 0.0)
        self._steady(plan, self.identity)

    # ------------------------------------------------------------------ steady state
    def _steady(self, plan: ExecutionPlan, decided_on: SparseGraph) -> None:
        """``plan`` was installed, decided on ``decided_on``'s statistics: watch for drift from
        them and, when it is calibrated and not the identity plan, verify it."""
        plan.trigger = self.trigger
        self.verification = None
        self.watch = DriftWatch(decided_on, self.rank, self.world, self.options.drift_check_every,
                                self.options.drift_ratio)
        self._drift_noted = None
        self._report_shares()
        if (not (self.options.verify_steps and self.options.calibrate)
                or plan.graph.fingerprint() == self.identity.fingerprint()):
            self.phase = "done"
            return
        self._check = SteadyStateCheck(self.options.verify_steps, settle_steps_for(plan.graph))
        self._verify_start = time.perf_counter()
        self.phase = "verify"
        self.events.append(f"verifying the plan against the identity plan on {self._check.planned} interleaved training "
                           f"steps ({self._check.measured_pairs} measured pairs, settle "
                           f"{self._check.settle_steps})")

    def _stop_verification(self, why: str) -> None:
        check, self._check = self._check, None
        self.overhead_s += time.perf_counter() - self._verify_start
        self.verification = PlanVerification(check.recorded, check.settle_steps, 0, 0,
                                             self.options.decision_rule.confidence, self._predicted(self.plan),
                                             self._calibrated(self.plan), None, None, None, None, "incomplete",
                                             False, note=f"stopped: {why}")
        self.verifications.append(self.verification)
        self.plan.verification = self.verification
        self.events.append(f"steady-state check stopped after {check.recorded} of {check.planned} steps ({why}); the "
                           f"plan stays installed")
        self.phase = "done"

    @staticmethod
    def _predicted(plan: ExecutionPlan) -> Optional[float]:
        accepted = plan.accepted
        return sum(d.predicted_ms for d in accepted) if accepted and all(
            d.predicted_ms is not None for d in accepted) else None

    @staticmethod
    def _calibrated(plan: ExecutionPlan) -> Optional[float]:
        accepted = plan.accepted
        return sum(d.measured_ms for d in accepted) if accepted and all(
            d.measured_ms is not None for d in accepted) else None

    def _conclude_verification(self) -> None:
        """The window ran: judge the pairs (the same on every rank), keep or roll back."""
        from statistics import median

        from lightning_sparselift.cost.calibration import judge_pairs

        check, self._check = self._check, None
        measurement = judge_pairs(check.pairs(), self.check_group, self.options.decision_rule, 1)
        e = measurement.estimate
        slowest = [[max(rank[i][0] for rank in measurement.observations_ms),
                    max(rank[i][1] for rank in measurement.observations_ms)]
                   for i in range(len(measurement.observations_ms[0]))]
        plan = self.plan
        finite = e.increment_ms == e.increment_ms  # not NaN
        verification = PlanVerification(
            check.planned, check.settle_steps, e.pairs, e.outliers, self.options.decision_rule.confidence,
            self._predicted(plan), self._calibrated(plan), e.increment_ms if finite else None,
            list(e.interval_ms), e.noise_ms, median(t0 for t0, _ in slowest) if slowest else None, e.verdict,
            e.verdict == "slower", slowest)
        self.verification = verification
        self.verifications.append(verification)
        plan.verification = verification
        self.phase = "done"
        summary = verification.describe()
        if verification.rolled_back:
            self.rollbacks += 1
            why = (f"rolled back by the steady-state check: the plan's step was {e.increment_ms:+.3f} ms "
                   f"[{e.interval_ms[0]:+.3f}, {e.interval_ms[1]:+.3f}] vs the identity plan")
            rolled = dataclasses.replace(plan, graph=self.identity, decisions=[
                dataclasses.replace(d, accepted=False, reason=f"{why} (calibration: {d.reason})") if d.accepted else d
                for d in plan.decisions])
            self.plan = rolled
            self.installed.use(self.identity)
            self.warnings.append(f"SparseLift rolled back to the identity plan: the installed plan "
                                 f"({', '.join(d.candidate for d in plan.accepted)}) was slower than the identity "
                                 f"plan in steady state: {summary}")
        self.events.append(summary)
        if self.options.plan_path and self.rank == 0:
            self.plan.save_as_cache(self.options.plan_path)
        self.overhead_s += time.perf_counter() - self._verify_start
        if finite:  # half the window ran the plan not kept, each step off by the measured change
            self.cost_s += check.planned / 2 * (e.increment_ms if verification.rolled_back else -e.increment_ms) / 1e3
        m = self.metrics
        for key, value in (("predicted_ms", verification.predicted_ms), ("calibrated_ms", verification.calibrated_ms),
                           ("measured_ms", verification.measured_ms), ("noise_ms", verification.noise_ms),
                           ("identity_step_ms", verification.identity_step_ms)):
            if value is not None:
                m[f"sparselift/verify/{key}"] = float(value)
        low, high = verification.interval_ms or [None, None]
        if low is not None and abs(low) != float("inf"):
            m["sparselift/verify/low_ms"], m["sparselift/verify/high_ms"] = float(low), float(high)
        m["sparselift/verify/pairs"] = float(verification.pairs)
        m["sparselift/verify/verdict"] = {"faster": -1.0, "undecided": 0.0, "slower": 1.0}[e.verdict]
        m["sparselift/verify/rolled_back"] = float(verification.rolled_back)
        self._report_shares()

    def _observe(self, path: str, features: Any) -> None:
        if self.watch is not None and self.phase in ("verify", "done"):
            self.watch.observe(path, features)

    def _watch_step(self) -> bool:
        """A steady-state step ended: every ``drift_check_every`` steps, compare the workload with
        what the plan was decided on (a collective: every rank checks at the same step). True when
        drift made a new plan installed at once (a round without calibration)."""
        watch = self.watch
        if watch is None or not watch.end_step():
            return False
        findings, _live = watch.check(self.check_group, self.device)
        self._report_shares()
        if not findings:
            return False
        texts = [f.text for f in findings]
        statistics = finding_statistics(findings)
        key = "; ".join(texts)
        if not self.options.replan_on_drift:
            if self._drift_noted is None:
                self._drift_noted = key
                event = DriftEvent(self.steps, texts, statistics, "not re-planned (replan_on_drift=False)")
                self.drift_events.append(event)
                self.warnings.append(f"SparseLift: {event.describe()}")
            return False
        allowed_at = self._round_started + self.options.min_steps_between_replans
        if self.steps < allowed_at:
            if self._drift_noted is None:
                self._drift_noted = key
                event = DriftEvent(self.steps, texts, statistics, f"re-planning deferred to step {allowed_at} "
                                                                  f"(min_steps_between_replans)")
                self.drift_events.append(event)
                self.events.append(event.describe())
            return False
        event = DriftEvent(self.steps, texts, statistics, "re-planned on the live statistics")
        self.drift_events.append(event)
        self.metrics["sparselift/drift/replans"] = float(self.replans)
        self.metrics["sparselift/drift/step"] = float(self.steps)
        self.metrics.update({f"sparselift/drift/{k}": v for k, v in statistics.items()})
        live = watch.live_graph(self.identity, self.check_group)
        self.identity = live
        self.plan_again(event.describe(), trigger=event)
        return self.loop is None
