"""The session's phases in one process: the ranks' agreement on a plan file (typed outcomes), the
plan file read on one rank, the steady-state check's verdicts, the response to drift, and the
session stepping through verification with a fake executor. Through the strategy on 2 ranks:
tests/ranks/test_steady_state.py, tests/ranks/test_session.py, tests/ranks/test_plan_file_fit.py."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sparselift.options import SessionOptions
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import ExecutionPlan, PlanFingerprint
from lightning_sparselift.plan.verification import Finding
from lightning_sparselift.session import SparseLiftSession, drift, plan_store
from lightning_sparselift.session.plan_store import PlanFileOutcome
from lightning_sparselift.session.verify import PlanCheck

from graph_fixtures import load, unmeasured_plan

USABLE, MISSING = PlanFileOutcome("usable", "abc"), PlanFileOutcome("missing")


def test_plan_file_agreement_from_every_ranks_outcome():
    assert plan_store.agree([MISSING, MISSING]) == plan_store.PlanFileAgreement(False)
    assert plan_store.agree([USABLE, USABLE]).reuse
    drifted = PlanFileOutcome("drifted", "f1 longer; batch size 8")
    assert plan_store.agree([drifted, drifted]) == plan_store.PlanFileAgreement(False, ["f1 longer", "batch size 8"])
    # any disagreement plans again, naming every rank's reason
    mixed = plan_store.agree([USABLE, MISSING, PlanFileOutcome("unusable", "bad JSON"), drifted])
    assert not mixed.reuse and mixed.drift is None
    assert mixed.reason == "error: bad JSON; missing; workload drift on some ranks: f1 longer; batch size 8"
    assert plan_store.agree([USABLE, PlanFileOutcome("usable", "other")]).reason == "ranks read different plans"


def test_a_plan_file_is_read_rebuilt_or_refused_on_one_rank(tmp_path):
    identity = load("table_and_column_wise_2ranks")
    optimizations = ["aggregation", "latency_hiding"]
    plan = unmeasured_plan(identity, optimizations)
    assert plan.accepted, "the fixture should have feasible candidates"
    path = tmp_path / "plan.json"
    passes = select_passes(optimizations)

    assert plan_store.read(str(path), plan.fingerprint, identity, passes, 5.0).outcome == MISSING
    plan.save(path)
    reading = plan_store.read(str(path), plan.fingerprint, identity, passes, 5.0)
    assert reading.outcome == PlanFileOutcome("usable", plan.graph.fingerprint())
    assert reading.plan.graph.fingerprint() == plan.graph.fingerprint() and reading.decided_on is not None

    other = PlanFingerprint(**{**vars(plan.fingerprint), "world_size": 3})
    refused = plan_store.read(str(path), other, identity, passes, 5.0).outcome
    assert refused.kind == "unusable" and "world_size" in refused.detail

    path.write_text("{not json")
    assert plan_store.read(str(path), plan.fingerprint, identity, passes, 5.0).outcome.kind == "unusable"


def test_drift_is_warned_about_deferred_or_planned_again_once_per_round():
    findings = [Finding("ebc", "f1", "bag_length", 40.0, 4.0, "f1 bags 10x longer")]
    replan = drift.respond(findings, step=600, round_started=0, options=SessionOptions(), noted=False)
    assert replan.action == "replan" and replan.event.findings == ["f1 bags 10x longer"]
    assert replan.metrics(1)["sparselift/drift/step"] == 600.0
    defer = drift.respond(findings, step=100, round_started=0, options=SessionOptions(), noted=False)
    assert defer.action == "defer" and "deferred to step 500" in defer.event.action
    assert drift.respond(findings, step=100, round_started=0, options=SessionOptions(), noted=True) is None
    off = SessionOptions(replan_on_drift=False)
    assert drift.respond(findings, step=600, round_started=0, options=off, noted=False).action == "warn"
    assert drift.respond(findings, step=600, round_started=0, options=off, noted=True) is None


def _window(check: PlanCheck, plan_ms: float, identity_ms: float) -> Any:
    result = None
    while result is None:
        ms = plan_ms if check.next_graph() is check.plan.graph else identity_ms
        if check.record(ms):
            result = check.conclude()
    return result


@pytest.mark.parametrize("plan_ms, rolled_back", [(12.0, True), (8.0, False)])
def test_the_steady_state_check_keeps_a_faster_plan_and_rolls_back_a_slower_one(plan_ms, rolled_back):
    identity = load("table_and_column_wise_2ranks")
    plan = unmeasured_plan(identity, ["aggregation", "latency_hiding"])
    rule = SessionOptions().decision_rule
    result = _window(PlanCheck(plan, identity, 40, rule, None), plan_ms, 10.0)
    assert result.judged and result.verification.rolled_back is rolled_back
    assert result.verification.verdict == ("slower" if rolled_back else "faster")
    assert plan.verification is result.verification
    if rolled_back:
        assert result.plan.graph is identity and result.plan.accepted == [] and result.warning
        assert result.plan.verification is result.verification
        assert all("rolled back by the steady-state check" in d.reason for d in result.plan.decisions)
    else:
        assert result.plan is plan and result.warning is None
    assert result.metrics["sparselift/verify/rolled_back"] == float(rolled_back)
    assert json.dumps(result.metrics)  # plain numbers for the logger

    stopped = PlanCheck(plan, identity, 40, rule, None).stop("planning again")
    assert not stopped.judged and stopped.verification.verdict == "incomplete" and stopped.plan is plan


class _FakeExecutor:
    """What the session asks of an installed executor in steady state."""

    def __init__(self) -> None:
        self.used: list[Any] = []
        self.torchrec_path_calls = 0

    def announce(self, batch: Any) -> None:
        pass

    def torchrec_calls(self) -> int:
        return self.torchrec_path_calls

    @property
    def clock(self) -> Any:  # a calibration step's regions, all 10 ms
        return types.SimpleNamespace(start_step=lambda: None, end_step=lambda: {
            "step_ms": 10.0, "sparse_ms": 10.0, "lookup_ms": 10.0, "lookup_wall_ms": 10.0, "step_cpu_ms": 10.0,
            "input_ms": 10.0, "exchange_cpu_ms": 10.0})

    def use(self, graph: Any) -> None:
        self.used.append(graph)

    def take_bucket_builds(self) -> list:
        return []


@pytest.mark.parametrize("plan_ms, rolled_back", [(12.0, True), (8.0, False)])
def test_a_session_verifies_its_plan_on_training_steps_and_keeps_the_verdict(monkeypatch, tmp_path, plan_ms,
                                                                              rolled_back):
    identity = load("table_and_column_wise_2ranks")
    plan = unmeasured_plan(identity, ["aggregation", "latency_hiding"])
    options = SessionOptions(verify_steps=16, drift_check_every=10_000, plan_path=str(tmp_path / "plan.json"))
    session = SparseLiftSession(nn.Linear(1, 1), None, [], None, None, options)
    session.capture = None
    executor = session.installed = _FakeExecutor()
    session.identity, session.plan, session.phase = identity, plan, "done"
    session._steady(plan, identity)  # as after a planning round
    assert session.phase == "verify"

    clock = {"now": 0.0}
    import lightning_sparselift.session.driver as driver
    monkeypatch.setattr(driver, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    while session.phase == "verify":
        session.begin_step()
        clock["now"] += (plan_ms if executor.used[-1] is plan.graph else 10.0) / 1e3
        session.end_step()
    assert session.rollbacks == int(rolled_back) and len(session.verifications) == 1
    assert executor.used[-1] is (identity if rolled_back else plan.graph)
    assert session.plan.graph is executor.used[-1]
    assert bool(session.warnings) is rolled_back
    assert session.metrics["sparselift/verify/rolled_back"] == float(rolled_back)
    saved = ExecutionPlan.load(options.plan_path)  # rank 0 saves the verdict with the plan
    assert saved.verification.rolled_back is rolled_back


def test_planning_again_needs_an_installed_plan():
    session = SparseLiftSession(nn.Linear(1, 1), None, [], None, torch.device("cpu"), SessionOptions(capture_steps=1))
    with pytest.raises(RuntimeError, match="still in its capture phase"):
        session.plan_again("too early")
    session.abandon("stopped")
    with pytest.raises(RuntimeError, match="TorchRec's path is in use"):
        session.plan_again("nothing lifted")


def test_steps_on_torchrecs_path_are_counted_logged_and_warned_about_once():
    identity = load("table_and_column_wise_2ranks")
    session = SparseLiftSession(nn.Linear(1, 1), None, [], None, torch.device("cpu"),
                                SessionOptions(drift_check_every=10_000))
    session.capture = None
    executor = session.installed = _FakeExecutor()
    session.identity, session.phase = identity, "done"
    session.plan = unmeasured_plan(identity, [])
    for uneven in (False, True, False, True, True):
        session.begin_step()
        executor.torchrec_path_calls += uneven  # (the module's call handed the step to TorchRec)
        session.end_step()
        executor.torchrec_path_calls += 1  # an evaluation call between steps: not a training step
    assert session.torchrec_path_steps == 3
    assert session.metrics["sparselift/torchrec_path_steps"] == 3.0
    assert len(session.warnings) == 1 and "training step 2 ran TorchRec's path" in session.warnings[0]
    assert "3 training step(s) ran TorchRec's path" in session.explain()


def test_calibration_does_not_measure_a_step_on_torchrecs_path():
    from lightning_sparselift.plan import Planner
    from lightning_sparselift.plan.loop import PlanningLoop

    identity = load("table_and_column_wise_2ranks")
    session = SparseLiftSession(nn.Linear(1, 1), None, [], None, torch.device("cpu"), SessionOptions())
    session.capture = None
    executor = session.installed = _FakeExecutor()
    session.identity = identity
    planner = Planner(select_passes(["latency_hiding:early_start"]), None, True, SessionOptions().decision_rule)
    session.loop = PlanningLoop(planner, unmeasured_plan(identity, []).fingerprint, identity, None, session.events)
    session.loop.propose()
    session.phase = "plan"
    progress = [session.calibration_progress[0]]
    for uneven in (False, True, True, False):
        session.begin_step()
        executor.torchrec_path_calls += uneven
        session.end_step()
        progress.append(session.calibration_progress[0])
    assert progress == [0, 1, 1, 1, 2]  # the two steps on TorchRec's path left the calibration where it was
    began = executor.used[0::2]  # (each step uses its graph, then the incumbent again between steps)
    assert began[1] is began[2] is began[3]  # the graph of step 2 ran again in steps 3 and 4


def test_the_strategy_says_calibrating_until_its_executor_runs_a_plan():
    from lightning_sparselift import SparseLiftStrategy

    strategy = SparseLiftStrategy()
    assert strategy.executor_in_use == "torchrec"  # before the first fit
    session = strategy._sessions.session = SparseLiftSession(nn.Linear(1, 1), None, [], None, torch.device("cpu"),
                                                             SessionOptions())
    assert strategy.executor_in_use == "torchrec"  # capturing on TorchRec's path
    session.installed, session.phase = _FakeExecutor(), "plan"
    assert strategy.executor_in_use == "calibrating" and strategy.execution_plan is None
    session.phase = "verify"
    assert strategy.executor_in_use == "sparselift"


def _planning_while_building(optimizations: tuple[str, ...], release: Any, identity: Any = None,
                             buckets_release: Any = None) -> SparseLiftSession:
    """A session in its planning round whose kernel builds take until ``release`` is set (its
    kernels in buckets: until ``buckets_release`` is)."""
    from lightning_sparselift.plan import Planner
    from lightning_sparselift.plan.loop import PlanningLoop
    from lightning_sparselift.session.kernel_builds import KernelBuilds

    identity = identity or load("table_and_column_wise_2ranks")

    class Building(_FakeExecutor):
        def __init__(self) -> None:
            super().__init__()
            self.bucket_requests: list[dict] = []

        def build_generated(self) -> list:
            release.wait(30)
            return [{"module": m.path, "group": g.index, "note": "", "seconds": 5.0, "cached": False}
                    for m in identity.modules for g in m.lifted_groups]

        def build_lookups(self, regions: dict) -> list:
            self.bucket_requests.append(regions)
            buckets_release.wait(30)
            return [{"module": path, "group": r.groups[0], "buckets": len(r.buckets), "tables": r.buckets, "note": "",
                     "seconds": 5.0, "cached": False} for path, wanted in regions.items() for r in wanted]

    options = SessionOptions(optimizations=optimizations, verify_steps=0)
    session = SparseLiftSession(nn.Linear(1, 1), None, [], None, torch.device("cpu"), options)
    session.capture, session.identity = None, identity
    session.installed = Building()
    session._builds = KernelBuilds(session.installed.build_generated)
    session.loop = PlanningLoop(Planner(session.passes, None, True, options.decision_rule),
                                unmeasured_plan(identity, []).fingerprint, identity, None, session.events)
    session.loop.expecting = True
    session.loop.propose()
    session.phase = "plan"
    return session


def test_kernel_candidates_join_the_round_once_every_ranks_background_builds_are_done():
    import threading

    from lightning_sparselift.session.kernel_builds import CHECK_EVERY

    release = threading.Event()
    session = _planning_while_building(("codegen:lookup", "latency_hiding:early_start",
                                        "subgraph_parallelism:buckets2"), release)
    assert session.loop.trials == []  # no design starts without the kernel candidates
    (buckets,) = [d for d in session.loop.plan.decisions if ":buckets2@" in d.candidate]
    assert all("none was built" in r for r in buckets.reasons)
    for _ in range(20):  # training goes on, on the incumbent: no calibration step
        session.begin_step()
        session.end_step()
    assert session.phase == "plan" and session._builds is not None and session.loop.plan.calibration_steps == 0
    assert session.kernel_wait_steps == 20
    release.set()
    session._builds._thread.join(5)
    for _ in range(CHECK_EVERY):
        session.begin_step()
        session.end_step()
    assert session._builds is None
    assert sorted(c.id.split("@")[0] for c in session.loop.trials) == ["codegen:lookup", "latency_hiding:early_start"]
    assert any(e.startswith("admitted 1 candidate(s) now feasible: codegen:lookup@") for e in session.events)
    # a candidate still infeasible once the kernels are there says why now, not "none was built"
    (buckets,) = [d for d in session.loop.plan.decisions if ":buckets2@" in d.candidate]
    assert not buckets.feasible and buckets.reasons == ["g0 (table_wise): no rank holds two of its tables",
                                                        "g1 (column_wise): no rank holds two of its tables"]
    assert any("on a thread of their own; training waited 0.00 s for them" in e for e in session.events)
    while session.phase == "plan":
        session.begin_step()
        session.end_step()
    assert {d.candidate.split("@")[0] for d in session.plan.decisions if d.feasible} == {
        "latency_hiding:early_start", "codegen:lookup"}


def test_kernels_in_buckets_are_built_off_the_training_thread_and_their_candidates_join_when_every_rank_has_them():
    """Pipelined buckets run a kernel of their own: built on the session's thread once the group's
    one-bucket kernel is there, while training goes on; no trial waits for a compiler."""
    import threading

    from graph_fixtures import EBC, four_tables_two_ranks
    from lightning_sparselift.session.kernel_builds import CHECK_EVERY

    release, buckets_release = threading.Event(), threading.Event()
    release.set()
    session = _planning_while_building(("codegen:lookup", "subgraph_parallelism:pipelined2"), release,
                                       four_tables_two_ranks(kernels=False), buckets_release)
    # a step that runs the generated lookup takes 5 ms, others 10: the lookup kernel is accepted
    generated = lambda: any(r.kernel == "generated" for m in session.installed.used[-1].modules  # noqa: E731
                            for r in m.schedule.regions if r.name == "lookup")
    type(session.installed).clock = property(lambda self: types.SimpleNamespace(start_step=lambda: None, end_step=lambda: {
        k: 5.0 if generated() else 10.0 for k in ("step_ms", "sparse_ms", "lookup_ms", "lookup_wall_ms", "step_cpu_ms",
                                                  "input_ms", "exchange_cpu_ms")}))
    (pipelined,) = [d for d in session.loop.plan.decisions if ":pipelined2@" in d.candidate]
    assert any("none was built" in r for r in pipelined.reasons)
    session._builds._thread.join(5)
    while not session.installed.bucket_requests:  # (the one-bucket kernels admitted at the next check)
        session.begin_step()
        session.end_step()
    # the buckets' kernel is building: the round waits for it, as for the lift's (a compile beside a
    # design's steps adds to their noise); training goes on on the incumbent
    (wanted,) = session.installed.bucket_requests
    assert [(r.groups, r.buckets) for r in wanted[EBC]] == [([0], [["t0", "t2"], ["t1", "t3"]])]
    assert any(e.startswith("building 1 generated lookup kernel(s) in buckets") for e in session.events)
    (pipelined,) = [d for d in session.loop.plan.decisions if ":pipelined2@" in d.candidate]
    assert not pipelined.feasible and pipelined.reasons == [
        "g0 (table_wise): no generated lookup kernel in these 2 buckets: not built yet (the session builds it off "
        "the training thread for a sweep's next rung, once the group's one-bucket kernel is there)"]
    assert session.loop.trials == [] and session.loop.expecting
    buckets_release.set()
    session._builds._thread.join(5)
    for _ in range(CHECK_EVERY):
        session.begin_step()
        session.end_step()
    assert session._builds is None and session.loop.plan.calibration_steps == 0
    assert [c.id.split("@")[0] for c in session.loop.trials] == ["codegen:lookup"]
    assert session.identity.module(EBC).groups[0].built_buckets == [[["t0", "t2"], ["t1", "t3"]]]
    assert any(e.startswith("admitted 1 candidate(s) now feasible: subgraph_parallelism:pipelined2@")
               for e in session.events)
    assert [b.tables for b in session.kernel_builds if b.buckets > 1] == [[["t0", "t2"], ["t1", "t3"]]]
    assert session.metrics["sparselift/kernel_build_wait_s"] < 1.0
    while session.phase == "plan":
        session.begin_step()
        session.end_step()
    decisions = {d.candidate.split("@")[0]: d for d in session.plan.decisions}
    assert decisions["codegen:lookup"].accepted
    # (measured on the incumbent the lookup kernel's design became: it has the kernels in buckets too)
    assert decisions["subgraph_parallelism:pipelined2"].measured_ms is not None


def test_a_round_stops_waiting_for_builds_past_the_patience_and_admits_them_when_they_come(monkeypatch):
    import threading

    from lightning_sparselift.session import kernel_builds
    from lightning_sparselift.session.kernel_builds import CHECK_EVERY

    monkeypatch.setattr(kernel_builds, "PATIENCE_S", 0.0)
    release = threading.Event()  # (a compile that does not return until the test says so)
    session = _planning_while_building(("codegen:lookup", "latency_hiding:early_start"), release)
    assert session.loop.trials == []
    for _ in range(CHECK_EVERY):
        session.begin_step()
        session.end_step()
    # past the patience: the round calibrates what it has, the builds go on
    assert [c.id.split("@")[0] for c in session.loop.trials] == ["latency_hiding:early_start"]
    assert any("still building after 0 s: calibrating the other candidates" in e for e in session.events)
    assert session._builds is not None and session.kernel_wait_steps == CHECK_EVERY
    release.set()
    session._builds._thread.join(5)
    while session.phase == "plan" and session._builds is not None:
        session.begin_step()
        session.end_step()
    assert any(e.startswith("admitted 1 candidate(s) now feasible: codegen:lookup@") for e in session.events)
    while session.phase == "plan":
        session.begin_step()
        session.end_step()
    assert {d.candidate.split("@")[0] for d in session.plan.decisions if d.feasible} == {
        "latency_hiding:early_start", "codegen:lookup"}


def test_a_session_calibrating_says_so():
    from lightning_sparselift.plan import Planner
    from lightning_sparselift.plan.loop import PlanningLoop

    identity = load("table_and_column_wise_2ranks")
    session = SparseLiftSession(nn.Linear(1, 1), None, [], None, torch.device("cpu"), SessionOptions())
    session.capture = None
    session.installed = _FakeExecutor()
    session.identity = identity
    planner = Planner(select_passes(["latency_hiding:early_start"]), None, True, SessionOptions().decision_rule)
    session.loop = PlanningLoop(planner, unmeasured_plan(identity, []).fingerprint, identity, None, session.events)
    session.loop.propose()
    session.phase = "plan"
    session.begin_step()
    session.end_step()
    lines = session.explain().splitlines()
    assert lines[0] == "SparseLift session calibrating (no plan installed yet)"
    assert lines[1].startswith("calibrating: 1 step(s) so far, about ")
    assert lines[2] == "  measuring  latency_hiding:early_start@model.sparse_arch.embedding_bag_collection: no look yet"
    while session.loop is not None:  # (every step takes 10 ms on both arms: no change, rejected)
        session.begin_step()
        session.end_step()
    assert session.explain().startswith("ExecutionPlan") and "reject" in session.explain()


def test_planning_waits_for_the_kernel_builds_only_when_a_saved_plan_or_no_calibration_needs_them(tmp_path):
    plan_path = tmp_path / "plan.json"

    def wait(reuse_saved: bool = True, **options) -> bool:
        session = SparseLiftSession(nn.Linear(1, 1), None, [], None, torch.device("cpu"), SessionOptions(**options))
        return session._waits_for_builds(reuse_saved)

    # a first run (no plan file yet): calibration admits the kernels once built, training goes on
    assert wait(plan_path=str(plan_path)) is False and wait() is False
    plan_path.write_text("{}")
    assert wait(plan_path=str(plan_path)) is True  # the saved plan may need them
    assert wait(reuse_saved=False, plan_path=str(plan_path)) is False  # planning again: not read
    assert wait(calibrate=False) is True  # applied at once


def test_the_compilers_share_of_the_run_is_logged_every_fractions_every_steady_steps():
    from lightning_sparselift.session.driver import FRACTIONS_EVERY

    identity = load("table_and_column_wise_2ranks")
    plan = unmeasured_plan(identity, ["aggregation", "latency_hiding"])
    options = SessionOptions(verify_steps=0, drift_check_every=10, replan_on_drift=False)
    session = SparseLiftSession(nn.Linear(1, 1), None, [], None, None, options)
    session.capture = None
    session.installed = _FakeExecutor()
    session.identity, session.plan, session.phase = identity, plan, "done"
    session._steady(plan, identity)
    assert session.phase == "done" and session.watch is not None
    assert "sparselift/cost_fraction" in session.metrics  # (once installed)
    session.metrics.clear()
    logged = []
    for step in range(1, 3 * FRACTIONS_EVERY + 1):
        session.begin_step()
        session.end_step()
        if "sparselift/cost_fraction" in session.metrics:
            logged.append(step)
        session.metrics.clear()  # (what the strategy's connector does once it logged them)
    assert logged == [FRACTIONS_EVERY, 2 * FRACTIONS_EVERY, 3 * FRACTIONS_EVERY]
