"""The SparseLift compiler session, driven one training step at a time through its phases:
capture (TorchRec's path under :class:`~lightning_sparselift.frontend.capture.SparseCapture`) ->
lift (:mod:`.lifting`) -> plan (a reusable saved plan, :mod:`.plan_store`, or a planning round,
:class:`~lightning_sparselift.plan.planner.PlanningLoop`) -> install -> verify (:mod:`.verify`) ->
steady state (:mod:`.drift`); again from the lifted graph on :meth:`SparseLiftSession.plan_again`.

Call :meth:`~SparseLiftSession.begin_step` before every training step and
:meth:`~SparseLiftSession.end_step` once its forward, backward and optimizer step ran, also once
the session is done (the step announces the next batch to the executor): the strategy does it
from its hooks, the benchmark around its steps. Every decision is the same on every rank: inputs
are all-gathered, measurements reduced.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_sparselift.cost.decision import DecisionRule
from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.cost.step_record import StepTimings
from lightning_sparselift.frontend.capture import SparseCapture
from lightning_sparselift.options import SessionOptions
from lightning_sparselift.plan.loop import PlanningLoop
from lightning_sparselift.plan.planner import Planner
from lightning_sparselift.plan.types import ExecutionPlan, KernelBuild
from lightning_sparselift.plan.verification import DriftEvent, DriftWatch, PlanVerification
from lightning_sparselift.runtime import InstalledExecutor, install
from lightning_sparselift.runtime.update_guard import UpdateCheck, no_check
from lightning_sparselift.session import drift, kernel_builds, lifting, plan_store
from lightning_sparselift.session.compiler_time import CompilerTime
from lightning_sparselift.session.kernel_builds import KernelBuilds
from lightning_sparselift.session.ranks import gather
from lightning_sparselift.session.verify import PlanCheck, VerificationResult

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph

# ``capture``: TorchRec's path, captured; ``plan``: a planning round calibrates on the lifted
# executor; ``verify``: the installed plan is measured against the identity plan; ``done``: a plan
# installed, or TorchRec's path kept (the drift watch runs in ``verify`` and ``done``)
Phase = Literal["capture", "plan", "verify", "done"]
# steady-state steps between two logs of the compiler's share of the run (a LightningModule.log costs
# ~1 ms a metric here: at every drift check it was 0.1 ms a step for as long as training ran)
FRACTIONS_EVERY = 100


class SparseLiftSession:
    """The compiler driven one training step at a time through its :data:`Phase` s."""

    def __init__(self, model: nn.Module, sharding_plan: Any, module_paths: list[str], group: Any,
                 device: torch.device, options: SessionOptions = SessionOptions(), check_group: Any = None,
                 before_update: UpdateCheck = no_check) -> None:
        """``check_group``: a process group for the drift checks and the verification's exchange
        (default ``group``): a group of their own does not wait behind exchanges left in flight.
        ``before_update``: called in every lifted module's backward before anything is updated (it
        raises to stop the step; see :mod:`~lightning_sparselift.runtime.update_guard`)."""
        from lightning_sparselift.passes import select_passes

        if options.capture_steps < 1:
            raise ValueError("the lifted executor needs capture_steps >= 1: TorchRec builds its dists on the first "
                             "forward, and the lift is checked against them")
        self.options = options
        self.model, self.sharding_plan, self.paths = model, sharding_plan, module_paths
        self.group, self.device, self.before_update = group, device, before_update
        self.check_group = check_group if check_group is not None else group
        self.passes = select_passes(list(options.optimizations), options.numerics)
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.capture: Optional[SparseCapture] = SparseCapture(model, module_paths, self.rank, self.world)
        self.phase: Phase = "capture"
        self.installed: Optional[InstalledExecutor] = None
        self.identity: Optional[SparseGraph] = None  # the lifted graph before any pass
        self.timings: Optional[StepTimings] = None  # what the capture steps measured
        self.plan: Optional[ExecutionPlan] = None  # the plan installed last
        self.loop: Optional[PlanningLoop] = None  # the planning round in progress
        self.fallback_reason: Optional[str] = None
        self.lift_seconds, self.plan_reused = 0.0, False
        self.kernel_builds: list[KernelBuild] = []  # the generated kernels built since the lift, every rank's
        self.kernel_build_wait_s = 0.0  # the training thread's time spent waiting for them
        self._builds: Optional[KernelBuilds] = None  # those being built (one batch at a time)
        self._buckets_asked_on: Optional[SparseGraph] = None  # the graph kernels in buckets were last asked for
        self.kernel_wait_steps = 0  # training steps a planning round waited on for them (not calibration steps)
        self.time = CompilerTime()
        self.steps = 0  # training steps ended since the session began
        self.run_end = math.inf  # self.steps when training is expected to end (:meth:`expect`)
        self.torchrec_path_steps = 0  # of those after the lift, the ones a lifted module ran on TorchRec's path
        self._torchrec_calls = 0  # the executor's count of such calls when the step began
        # reported to the caller, which takes them (metrics: for the logger)
        self.events, self.warnings, self.metrics = [], [], {}
        # steady state
        self.verification: Optional[PlanVerification] = None  # the installed plan's last steady-state check
        self.verifications: list[PlanVerification] = []  # every steady-state check, in order
        self.drift_events: list[DriftEvent] = []
        self.trigger: Optional[DriftEvent] = None  # why the installed plan's round ran (None: the first one)
        self.rollbacks = 0
        self.watch: Optional[DriftWatch] = None
        self._check: Optional[PlanCheck] = None  # the steady-state check in progress
        self._round_started = 0  # self.steps when the last planning round began
        self._drift_noted = False  # a deferred / ignored drift was reported this round
        self._capture_step: Optional[ContextManager[None]] = None  # the captured step in progress
        self._in_step, self._step_start = False, 0.0  # (_step_start: a verify step's wall time)

    def expect(self, steps: float) -> None:
        """Training is expected to run ``steps`` more steps (``math.inf``: not known, e.g. an
        iterable loader without ``max_steps``): a planning round calibrates at most a share of what
        is left (:meth:`~lightning_sparselift.cost.decision.DecisionRule.for_run`)."""
        self.run_end = self.steps + steps

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
            self._torchrec_calls = self.installed.torchrec_calls()
            # (the model's concatenations are timed only while a design measures them)
            self.installed.clock.times_concatenations = self.phase == "plan" and self.loop.measures("layout_cpu")
        if self.phase == "plan":
            self.installed.use(self.loop.next_graph())
            self.installed.clock.start_step()
        elif self.phase == "verify":
            self.installed.use(self._check.next_graph())
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
            if self.capture.steps < self.options.capture_steps:
                return False
            return self._lift()
        # (a step a lifted module handed to TorchRec is not measured: the same graph runs again)
        on_torchrec = self.installed is not None and self.installed.torchrec_calls() > self._torchrec_calls
        if on_torchrec:
            self._ran_torchrec_path()
        if self.phase == "plan":
            regions = self.installed.clock.end_step()
            self.installed.use(self.loop.incumbent)
            if on_torchrec:
                return False
            self.kernel_wait_steps += self.loop.waiting
            self.loop.feedback(**regions)
            if self.steps % kernel_builds.CHECK_EVERY == 0:
                self._admit_builds(0.0)
                if self.loop is not None and self._build_buckets():  # (a rung accepted: the next one's kernel)
                    self.loop.admit(more=self.loop.expecting)
            if self.loop.done:
                self._finish()
                return True
            return False
        if self.installed is None:
            return False
        if self.phase == "verify":
            self.installed.use(self.plan.graph)
            if not on_torchrec and self._check.record((time.perf_counter() - self._step_start) * 1e3):
                self._verified(self._check.conclude())
        return self._watch_step()

    def _ran_torchrec_path(self) -> None:
        """The step ran TorchRec's path in a lifted module (every rank alike: they exchanged their
        batch sizes): counted, logged, warned about once."""
        self.torchrec_path_steps += 1
        self.metrics["sparselift/torchrec_path_steps"] = float(self.torchrec_path_steps)
        if self.torchrec_path_steps == 1:
            self.warnings.append(f"SparseLift: training step {self.steps} ran TorchRec's path: the ranks passed "
                                 f"different batch sizes (a short last batch, or per-rank batch sizes); such steps are "
                                 f"counted in sparselift/torchrec_path_steps, and calibration does not measure them")

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

    # ------------------------------------------------------------------ lift
    def _lift(self) -> bool:
        """The capture steps ended: lift, install, build the kernels, then plan. True when a plan
        was installed at once, or TorchRec's path kept."""
        start = time.perf_counter()
        lifted = lifting.lift_on_every_rank(self.capture, self.model, self.sharding_plan, self.paths, self.group,
                                            self.device, self.options.workspace_budget_bytes)
        self.timings = lifted.timings
        if lifted.graph is None:
            self.fallback_reason = lifted.fallback_reason
            self.events.append(f"could not lift the sparse path, keeping TorchRec's: {self.fallback_reason}")
        else:
            self._install(lifted.graph)
        self.capture = None  # (kept while lifting: if the lift raises, abandon() keeps TorchRec's path)
        self.lift_seconds = time.perf_counter() - start
        self.time.add(self.lift_seconds, self.lift_seconds)
        if self.installed is None:
            self.phase = "done"
            return True
        return self._plan(reuse_saved=True)

    def _install(self, graph: SparseGraph) -> None:
        self.installed = install(graph, self.model, self.group, self.device, self.options.reuse_buffers,
                                 self.options.numerics)
        self.installed.observe(self._observe)
        self.installed.guard_updates(self.before_update)
        if any(p.uses_generated_kernels for p in self.passes):
            self._builds = KernelBuilds(self.installed.build_generated)
        self.identity = graph
        self.events += lifting.describe(graph, self.options.capture_steps)

    def _admit_builds(self, wait_s: Optional[float]) -> None:
        """When every rank's kernel builds finished (waiting up to ``wait_s`` for this rank's; None:
        until they finish): record them in the lifted graph, let a planning round in progress
        propose their candidates and start the builds those imply (kernels in buckets). A
        collective: every rank calls it at the same step."""
        if self._builds is None:
            return
        if not self._builds.ready(self.group, wait_s):
            if self._builds.overdue and self.loop is not None and self.loop.expecting:
                self.loop.proceed(f"the generated kernels are still building after {kernel_builds.PATIENCE_S:.0f} s: "
                                  f"calibrating the other candidates meanwhile (the kernel candidates join the round if "
                                  f"they arrive before it ends)")
            return
        builds, self._builds = self._builds, None
        built = builds.collect(self.group)
        self.kernel_builds = self.kernel_builds + built
        self.kernel_build_wait_s += builds.waited_s
        for graph in self._marked_graphs():
            lifting.mark_generated(graph, built)
        self.events += lifting.describe_builds(built, self.world, builds.waited_s)
        self.metrics["sparselift/kernel_build_wait_s"] = self.kernel_build_wait_s
        if self.loop is not None:
            self.loop.plan.kernel_builds = self.kernel_builds
            self._build_buckets(awaited=builds.awaited)
            self.loop.admit(more=self._builds is not None and self._builds.awaited)

    def _marked_graphs(self) -> list[SparseGraph]:
        """The graphs that record what this machine built: the lifted graph and the planning
        round's (its incumbent may be the lifted graph: marking is idempotent)."""
        return [self.identity, *([] if self.loop is None else self.loop.graphs)]

    def _build_buckets(self, awaited: bool = False) -> bool:
        """Start building the lookup kernels in buckets the passes' candidates would run next on
        the graph being planned (see :func:`.kernel_builds.buckets_to_build`; rank 0's choice on
        every rank), unless a batch of builds runs or that graph was asked already: the
        candidates join the round once every rank has them, so no trial waits for a compiler.
        ``awaited``: the round waits for them, as for the lift's (a compile beside a design's
        steps made the demo's early start undecided: 10.3 ms of noise per pair against 8.9);
        a sweep's later rung is built while the round goes on. True when rungs were declined
        (a round that proposed already proposes again: their reasons say why). A collective:
        every rank calls it at the same step."""
        from lightning_sparselift.passes.subgraph_parallelism import bucket_kernel

        graph = self.identity if self.loop is None else self.loop.incumbent
        if self._builds is not None or graph is self._buckets_asked_on:
            return False
        self._buckets_asked_on = graph
        wanted = kernel_builds.buckets_asked(self.passes, graph)
        if not wanted:  # (the same on every rank: no collective)
            return False
        model = None if self.loop is None else self.loop.planner.model
        accepted = set() if self.loop is None else {d.candidate for d in self.loop.plan.accepted}
        wanted, declined = gather(kernel_builds.buckets_to_build(self.passes, graph, wanted, model, accepted),
                                  self.group)[0]
        for path, region, why in declined:
            for marked in self._marked_graphs():
                marked.module(path).groups[region.groups[0]].lookup_notes[bucket_kernel(region.buckets)] = why
        if wanted:
            installed = self.installed
            self._builds = KernelBuilds(lambda: installed.build_lookups(wanted), awaited=awaited)
            self.events.append(f"building {sum(map(len, wanted.values()))} generated lookup kernel(s) in buckets on "
                               f"a thread of their own: their candidates join the round once every rank has them")
        return bool(declined)

    # ------------------------------------------------------------------ plan
    def plan_again(self, reason: str, trigger: Optional[DriftEvent] = None) -> None:
        """Start a new planning round from the lifted (identity) graph: the next steps calibrate
        the candidates on top of it as the first round did, and its plan is installed (and saved
        to ``plan_path``, which is not read: the round exists to measure again). Call it between
        steps, on every rank at the same step (the step-time model's constants are measured with
        collectives). A steady-state check in progress is stopped (not judged)."""
        if self.phase == "verify" and not self._in_step:
            self._verified(self._check.stop(f"planning again ({reason})"))
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

    def _plan(self, reuse_saved: bool) -> bool:
        """Start a planning round (or install the saved plan); True when a plan was installed."""
        from lightning_sparselift.cost.priors import measure_priors, probe_sizes
        from lightning_sparselift.session.input_probe import measure_reference_inputs

        start = time.perf_counter()
        self.watch = None
        self._round_started = self.steps
        if self._waits_for_builds(reuse_saved):  # (else they are checked once, after the priors)
            self._admit_builds(None)
        fingerprint = plan_store.fingerprint(self.identity, self.sharding_plan, self.world, self.options.optimizations)
        saved = plan_store.reuse(self.options.plan_path, fingerprint, self.identity, self.passes,
                                 self.options.drift_ratio, self.group, self.steps) if reuse_saved else plan_store.Reuse()
        if saved.drift is not None:
            self.drift_events.append(saved.drift)
            self.trigger = saved.drift
        if saved.event is not None:
            self.events.append(saved.event)
        if saved.plan is not None:
            plan = self.plan = saved.plan
            plan.kernel_builds = self.kernel_builds
            self.plan_reused = True
            self.installed.use(plan.graph)
            plan.kernel_builds = plan.kernel_builds + lifting.bucket_builds(self.installed, self.group)
            self.events.append(f"reusing the plan at {self.options.plan_path} (no calibration): "
                               f"{len(plan.accepted)} optimization(s), {len(plan.graph.collectives())} collectives "
                               f"per step")
            reuse_s = time.perf_counter() - start
            self.time.add(reuse_s, reuse_s)
            self._steady(plan, saved.decided_on)
            return True
        model = None
        if self.passes and self.options.calibrate:
            sizes = probe_sizes([max(n.bytes_per_member) for n in self.identity.collectives()
                                 if n.op == "all_to_all_single"])
            model = StepModel.measure(measure_priors(self.group, self.device, sizes), self.timings, self.identity,
                                      measure_reference_inputs(self.identity, self.rank, self.device, self.group))
        # (from a warm cache the kernels load while the priors are measured: admitted now, the
        # first proposal has them and none is proposed again)
        self._admit_builds(0.0)
        if not self.options.calibrate:  # (a round without calibration applies its buckets at once: built first)
            self._build_buckets(awaited=True)
            self._admit_builds(None)
        planner = Planner(self.passes, model, self.options.calibrate, self._round_rule())
        self.loop = PlanningLoop(planner, fingerprint, self.identity, self.group, self.events)
        self.loop.plan.kernel_builds = self.kernel_builds
        self._build_buckets(awaited=True)  # (before the first proposal: the rungs it declines say why there)
        self.loop.expecting = self._builds is not None and self._builds.awaited
        if self.loop.expecting:
            self.events.append("the generated kernels are still building, on a thread of their own: calibration "
                               "starts once every rank has them (training goes on meanwhile)")
        self.phase = "plan"
        self.loop.propose(since=start)
        if self.loop.done:
            self._finish()
            return True
        return False

    def _round_rule(self) -> DecisionRule:
        """The decision rule of a round that starts now: its budget at most the rule's share of the
        training steps left (said in the events when that is the smaller)."""
        rule = self.options.decision_rule.for_run(self.run_end - self.steps)
        if rule.max_steps < self.options.decision_rule.max_steps:
            self.events.append(f"calibration budget: {rule.max_steps} steps ({rule.run_share:.0%} of the "
                               f"{self.run_end - self.steps:.0f} training steps left)")
        return rule

    def _waits_for_builds(self, reuse_saved: bool) -> bool:
        """Whether planning waits until the kernel builds finish. A saved plan is rebuilt with its
        kernels and a round without calibration applies them at once: both wait; a calibrating
        round admits them when they are there, so with no plan file to read (a first run, a fresh
        clone's demo) the training thread does not wait."""
        saved = reuse_saved and self.options.plan_path is not None and Path(self.options.plan_path).exists()
        return saved or not self.options.calibrate

    def _finish(self) -> None:
        loop, self.loop = self.loop, None
        plan = self.plan = loop.plan
        self.installed.use(plan.graph)
        plan.kernel_builds = plan.kernel_builds + lifting.bucket_builds(self.installed, self.group)
        self.phase = "done"
        saved = f"; saved to {self.options.plan_path}" if self.options.plan_path else ""
        if self.options.plan_path and self.rank == 0:
            error = plan.save_as_cache(self.options.plan_path)
            if error is not None:
                saved = f"; not saved to {self.options.plan_path}: {error}"
        self.events.append(f"plan installed: {len(plan.accepted)} of {len(plan.decisions)} candidate(s) accepted, "
                           f"{len(plan.graph.collectives())} collectives per step; calibration "
                           f"{plan.calibration_steps} steps / {plan.calibration_s:.2f} s" + saved)
        self.time.add(plan.planning_s + plan.calibration_s, plan.planning_s + (plan.calibration_excess_s or 0.0))
        self._steady(plan, self.identity)

    def abandon(self, why: str) -> None:
        """Training stopped before the session finished: keep TorchRec's path (still capturing) or
        the incumbent plan (calibrating), recording the candidates left undecided; that plan is
        not saved (a later run should calibrate them)."""
        self._drop_step()
        if self.capture is not None:  # capturing, or the lift raised
            self.capture.remove()
            self.capture = None
            self.fallback_reason = f"{why} before the {self.options.capture_steps} capture step(s) ended"
        elif self.loop is not None:
            loop, self.loop = self.loop, None
            loop.abandon(why)
            self.plan = loop.plan
            self.installed.use(loop.plan.graph)
            self.events.append(f"calibration incomplete ({why}); the plan so far stays installed and is not saved")
        elif self.phase == "verify":
            self._verified(self._check.stop(why))
        self.phase = "done"

    # ------------------------------------------------------------------ steady state
    def _steady(self, plan: ExecutionPlan, decided_on: SparseGraph) -> None:
        """``plan`` was installed, decided on ``decided_on``'s statistics: watch for drift from
        them and, when it is calibrated and not the identity plan, verify it."""
        plan.trigger = self.trigger
        self.verification = None
        self.watch = DriftWatch(decided_on, self.rank, self.world, self.options.drift_check_every,
                                self.options.drift_ratio)
        self._drift_noted = False
        self.metrics.update(self.time.metrics())
        if (not (self.options.verify_steps and self.options.calibrate)
                or plan.graph.fingerprint() == self.identity.fingerprint()):
            self.phase = "done"
            return
        self._check = PlanCheck(plan, self.identity, self.options.verify_steps, self.options.decision_rule,
                                self.check_group)
        self.phase = "verify"
        self.events.append(self._check.announcement())

    def _verified(self, result: VerificationResult) -> None:
        """The steady-state check ended (judged or stopped): record it, keep its plan."""
        self._check = None
        self.phase = "done"
        self.verification = result.verification
        self.verifications.append(result.verification)
        self.events.append(result.event)
        self.time.add(result.seconds, result.cost_s)
        if not result.judged:  # stopped: the plan stays, nothing to report
            return
        if result.verification.rolled_back:
            self.rollbacks += 1
            self.plan = result.plan
            self.installed.use(self.identity)
            self.warnings.append(result.warning)
        if self.options.plan_path and self.rank == 0:
            self.plan.save_as_cache(self.options.plan_path)
        self.metrics.update(result.metrics)
        self.metrics.update(self.time.metrics())

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
        if watch.steps % FRACTIONS_EVERY < watch.every:  # (the check at, or first after, each multiple)
            self.metrics.update(self.time.metrics())
        if not findings:
            return False
        response = drift.respond(findings, self.steps, self._round_started, self.options, self._drift_noted)
        if response is None:
            return False
        self.drift_events.append(response.event)
        if response.action == "warn":
            self._drift_noted = True
            self.warnings.append(f"SparseLift: {response.event.describe()}")
            return False
        if response.action == "defer":
            self._drift_noted = True
            self.events.append(response.event.describe())
            return False
        self.metrics.update(response.metrics(self.replans))
        self.identity = watch.live_graph(self.identity, self.check_group)
        self.plan_again(response.event.describe(), trigger=response.event)
        return self.loop is None

    @property
    def replans(self) -> int:
        """Planning rounds started because the workload drifted."""
        return sum(e.action.startswith("re-planned") for e in self.drift_events)

    # ------------------------------------------------------------------ report
    def explain(self) -> str:
        """The installed plan explained, then what happened to it in steady state (see :mod:`.explain`)."""
        from lightning_sparselift.session.explain import explain

        return explain(self)
