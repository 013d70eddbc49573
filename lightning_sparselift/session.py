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
   the lifted (identity) graph, calibrated and installed the same way.

Every decision is the same on every rank: inputs are all-gathered, measurements reduced.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_sparselift.frontend.capture import SparseCapture, gather_captures
from lightning_sparselift.frontend.check import check_against_runtime
from lightning_sparselift.frontend.lift import LiftError, dense_parameter_bytes, lift
from lightning_sparselift.plan.planner import Planner, PlanningLoop
from lightning_sparselift.plan.types import ExecutionPlan, PlanFileError, PlanFingerprint
from lightning_sparselift.runtime import InstalledExecutor, install

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph


class SparseLiftSession:
    """Phases: ``capture`` (TorchRec's path, captured), ``plan`` (a planning round calibrates on
    the lifted executor), ``done`` (a plan installed, or TorchRec's path kept)."""

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
        self.identity: Optional[SparseGraph] = None  # the lifted graph before any pass
        self.plan: Optional[ExecutionPlan] = None  # the plan installed last
        self.loop: Optional[PlanningLoop] = None  # the planning round in progress
        self.fallback_reason: Optional[str] = None
        self.lift_seconds = 0.0
        self.plan_reused = False
        self.events: list[str] = []  # what happened, for the caller to report
        self._capture_step: Optional[ContextManager[None]] = None  # the captured step in progress
        self._in_step = False
        self._step_start = 0.0

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
            self._step_start = time.perf_counter()

    def end_step(self) -> bool:
        """After the step begun last (its forward, backward and optimizer step ran): record it and
        advance. True when this step finished a round: the plan is installed, or TorchRec's path
        kept (see :attr:`fallback_reason`)."""
        if not self._in_step:
            return False
        self._in_step = False
        if self.phase == "capture":
            self._leave_capture_step()
            if self.capture.steps < self.warmup_batches:
                return False
            start = time.perf_counter()
            self._lift_and_install()
            self.capture = None  # (kept while lifting: if the lift raises, abandon() keeps TorchRec's path)
            self.lift_seconds = time.perf_counter() - start
            if self.installed is None:
                self.phase = "done"
                return True
            self._plan(reuse_saved=True)
        elif self.phase == "plan":
            step_ms = (time.perf_counter() - self._step_start) * 1e3
            sparse_ms = self.installed.clock.take()
            self.installed.use(self.loop.incumbent)
            self.loop.feedback(step_ms, sparse_ms)
            if self.loop.done:
                self._finish()
        else:
            return False
        return self.phase == "done"

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

    def _leave_capture_step(self) -> None:
        step, self._capture_step = self._capture_step, None
        step.__exit__(None, None, None)

    # ------------------------------------------------------------------ rounds
    def plan_again(self, reason: str) -> None:
        """Start a new planning round from the lifted (identity) graph: the next steps calibrate
        the candidates on top of it as the first round did, and its plan is installed (and saved
        to ``plan_path``, which is not read: the round exists to measure again). Call it between
        steps, on every rank at the same step (the priors are measured with collectives)."""
        if self.phase != "done":
            raise RuntimeError(f"SparseLift cannot plan again ({reason}): the session is still in its {self.phase} "
                               f"phase")
        if self.installed is None:
            raise RuntimeError(f"SparseLift cannot plan again ({reason}): TorchRec's path is in use "
                               f"({self.fallback_reason})")
        if self._in_step:
            raise RuntimeError(f"SparseLift cannot plan again ({reason}) during a training step")
        self.events.append(f"planning again: {reason}")
        self.plan_reused = False
        self._plan(reuse_saved=False)

    def abandon(self, why: str) -> None:
        """Training stopped before the session finished: keep TorchRec's path (still capturing) or
        the incumbent plan (calibrating), recording the candidates left undecided; that plan is
        not saved (a later run should calibrate them)."""
        self._drop_step()
        if self.capture is not None:  # capturing, or the lift raised
            self.capture.remove()
            self.capture = None
            self.fallback_reason = f"{why} before the {self.warmup_batches} capture step(s) ended"
        elif self.loop is not None:
            loop, self.loop = self.loop, None
            loop.abandon(why)
            self.plan = loop.plan
            self.installed.use(loop.plan.graph)
            self.events.append(f"calibration incomplete ({why}); the plan so far stays installed and is not saved")
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
        self.identity = graph
        self.installed = install(graph, self.model, self.group, self.device)
        self.events.append(f"lifted {len(graph.modules)} sparse module(s) after {self.warmup_batches} captured "
                           f"step(s); lifted executor installed ({len(graph.collectives())} collectives per step)")

    # ------------------------------------------------------------------ plan
    def _fingerprint(self, graph: SparseGraph) -> PlanFingerprint:
        import lightning_sparselift
        from lightning_sparselift.lightning.checkpoint import plan_summary

        return PlanFingerprint(graph=graph.fingerprint(), sharding_plan=PlanFingerprint.hash(plan_summary(
            self.sharding_plan)), world_size=self.world, backend=graph.backend,
            versions={**graph.versions, "lightning_sparselift": lightning_sparselift.__version__},
            optimizations=self.optimizations)

    def _saved_plan(self, fingerprint: PlanFingerprint, identity: SparseGraph) -> Optional[ExecutionPlan]:
        """The plan at ``plan_path`` if every rank can use it, else None (with the reason). Its graph is
        rebuilt from ``identity`` (this run's lift): the file's own graph is only compared, never run."""
        from pathlib import Path

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

    def _plan(self, reuse_saved: bool) -> None:
        from lightning_sparselift.cost.priors import measure_priors

        start = time.perf_counter()
        fingerprint = self._fingerprint(self.identity)
        saved = self._saved_plan(fingerprint, self.identity) if reuse_saved else None
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
        self.loop = PlanningLoop(Planner(self.passes, priors, self.calibrate), fingerprint, self.identity, self.group,
                                 self.events)
        self.phase = "plan"
        self.loop.propose(since=start)
        if self.loop.done:
            self._finish()

    def _finish(self) -> None:
        loop, self.loop = self.loop, None
        plan = self.plan = loop.plan
        self.installed.use(plan.graph)
        self.phase = "done"
        saved = f"; saved to {self.plan_path}" if self.plan_path else ""
        if self.plan_path and self.rank == 0:
            error = plan.save_as_cache(self.plan_path)
            if error is not None:
                saved = f"; not saved to {self.plan_path}: {error}"
        self.events.append(f"plan installed: {len(plan.accepted)} of {len(plan.decisions)} candidate(s) accepted, "
                           f"{len(plan.graph.collectives())} collectives per step; calibration "
                           f"{plan.calibration_steps} steps / {plan.calibration_s:.2f} s" + saved)
