"""``sparselift plan explain`` / ``sparselift plan diff`` on plan files built from the JSON graph
fixtures with the planner (no processes), plus one run through the installed entry point."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import ExecutionPlan, PlanFingerprint, Planner
from lightning_sparselift.plan.cli import BAD_FILE, DIFFERENT, IDENTICAL, diff, explain, main

from graph_fixtures import EBC, load, unmeasured_plan

ALL = ["aggregation", "latency_hiding"]
VERSIONS = {"torch": "2.13.0", "torchrec": "1.8.0"}


def _fingerprint(identity: SparseGraph, optimizations: list[str]) -> PlanFingerprint:
    return PlanFingerprint(identity.fingerprint(), "0123456789abcdef", identity.world_size, "gloo", dict(VERSIONS),
                           sorted(optimizations))


def _unmeasured(optimizations: list[str], fixture: str = "table_and_column_wise_2ranks") -> ExecutionPlan:
    identity = load(fixture)
    return unmeasured_plan(identity, optimizations, _fingerprint(identity, optimizations))


def _measured(measured_ms: dict[str, float]) -> ExecutionPlan:
    """A calibrated plan as the planning loop records it: each candidate's measured increment
    ``measured_ms[its role]`` (its observations, one pair per rank, as explain shows them), kept
    when negative. Made by hand: the calibration protocol is not what this tests."""
    plan = _unmeasured([])
    identity = plan.graph
    planner = Planner(select_passes(ALL), None, calibrate=False)
    feasible, plan.decisions = planner.propose(identity)
    for candidate in feasible:
        decision = planner.decide(candidate, None)
        decision.measured_ms = measured_ms[candidate.role]
        decision.accepted = decision.measured_ms < 0
        decision.reason = f"{'faster' if decision.accepted else 'not faster'}: {decision.measured_ms:+.3f} ms"
        decision.observations_ms = [[[10.0, 10.0 + decision.measured_ms]]] * 2  # per rank: [T0, T1] pairs
        plan.decisions.append(decision)
        if decision.accepted:
            plan.graph = planner.apply(plan.graph, candidate)
    plan.fingerprint.optimizations = sorted(ALL)
    plan.calibration_steps = 2 * len(feasible)
    return plan


def _save(plan: ExecutionPlan, path: Path) -> str:
    plan.save(path)
    return str(path)


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(list(argv), out, err)
    return status, out.getvalue(), err.getvalue()


def test_explain_shows_the_decisions_and_each_modules_schedule(tmp_path):
    plan = _unmeasured(ALL)
    path = _save(plan, tmp_path / "plan.json")
    status, out, err = _main("explain", path)
    assert (status, err) == (0, "")
    assert out == explain(ExecutionPlan.load(path)) + "\n"
    assert out.startswith(plan.explain() + "\n\n" + "SparseGraph (SRSV) v3: 2 rank(s), backend gloo")
    assert f"  ACCEPT     latency_hiding:next_batch@{EBC}: no prediction; accepted without calibration" in out
    assert ("  schedule: lookups at root_forward\n"
            "    input  g0+g1      bytes      issued previous_step on world\n") in out
    assert "    output g0+g1      all_to_all_single waited module_call on world\n" in out
    assert "5 collectives per step" in out


def test_identical_plans_diff_to_nothing_and_exit_0(tmp_path):
    a = _save(_unmeasured(ALL), tmp_path / "a.json")
    b = _save(_unmeasured(ALL), tmp_path / "b.json")
    assert _main("diff", a, b) == (IDENTICAL, f"plans {a} and {b} are identical\n", "")
    assert diff(ExecutionPlan.load(a), ExecutionPlan.load(b)).identical


def test_diff_names_fingerprint_fields_decisions_schedules_and_provenance(tmp_path):
    a = _save(_unmeasured(["aggregation"]), tmp_path / "aggregation.json")
    b = _save(_unmeasured(ALL), tmp_path / "all.json")
    status, out, err = _main("diff", a, b)
    assert (status, err) == (DIFFERENT, "")
    start = "latency_hiding: model.sparse_arch.embedding_bag_collection starts at the root forward"
    assert out.splitlines() == [
        f"--- A: {a}",
        f"+++ B: {b}",
        "fingerprint:",
        "  optimizations: ['aggregation'] -> ['aggregation', 'latency_hiding']",
        "decisions:",
        f"  + latency_hiding:early_start@{EBC} (only in B): ACCEPT, no prediction; accepted without calibration "
        "(calibrate=False)",
        f"  + latency_hiding:next_batch@{EBC} (only in B): ACCEPT, no prediction; accepted without calibration "
        "(calibrate=False)",
        "schedules:",
        f"  {EBC}: lookup_at: module_call -> root_forward",
        f"  {EBC}: input g0+g1: issue: module_call -> previous_step",
        "provenance:",
        f"  + {start} from args[0].sparse; its output and gradient all-to-alls overlap the dense compute in between",
        f"  + latency_hiding: {EBC} distributes the next batch's input (batch.sparse of the announced batch) during "
        "this step",
        "7 difference(s)",
    ]
    # and the other way round, from the identity plan: buckets merged, one removed per side
    identity = _unmeasured([])
    d = diff(identity, ExecutionPlan.load(a))
    assert d.sections["schedules"] == [
        f"{EBC}: input g0: only in A (packing per_tensor, issue module_call, process_group world)",
        f"{EBC}: input g1: only in A (packing per_tensor, issue module_call, process_group world)",
        f"{EBC}: input g0+g1: only in B (packing bytes, issue module_call, process_group world)",
        f"{EBC}: output g0: only in A (op all_to_all_single, wait module_call, split [], process_group world)",
        f"{EBC}: output g1: only in A (op all_to_all_single, wait module_call, split [], process_group world)",
        f"{EBC}: output g0+g1: only in B (op all_to_all_single, wait module_call, split [], process_group world)",
    ]


def test_diff_shows_changed_verdicts_and_measured_values():
    fast = _measured({"input": -5.0, "output": -5.0, "early_start": -5.0, "next_batch": -5.0})
    slow_output = _measured({"input": -5.0, "output": 2.0, "early_start": -5.0, "next_batch": -3.0})
    d = diff(fast, slow_output)
    assert d.sections["decisions"] == [
        f"~ aggregation:output@{EBC}: verdict: ACCEPT -> reject; measured: -5.000 ms -> +2.000 ms; observations (ms): "
        "[rank 0: -5.000; rank 1: -5.000] -> [rank 0: +2.000; rank 1: +2.000]",
        f"~ latency_hiding:next_batch@{EBC}: measured: -5.000 ms -> -3.000 ms; observations (ms): "
        "[rank 0: -5.000; rank 1: -5.000] -> [rank 0: -3.000; rank 1: -3.000]",
    ]
    assert f"{EBC}: output g0: only in B (op all_to_all_single, wait module_call, split [], process_group world)" in \
        d.sections["schedules"]
    assert d.sections["provenance"] == [f"- aggregation: output collectives of {EBC} merged (4 -> 2)"]
    assert "calibration" not in d.sections and "fingerprint" not in d.sections
    # a changed reason alone is shown
    renamed = ExecutionPlan.from_dict(json.loads(json.dumps(fast.to_dict())))
    renamed.decisions[0].reason = "faster, said differently"
    assert diff(fast, renamed).sections == {"decisions": [
        f"~ {fast.decisions[0].candidate}: reason: {fast.decisions[0].reason!r} -> 'faster, said differently'"]}
    from lightning_sparselift.plan.cli import _observations

    assert _observations([[[10.0, 9.0], [10.0, 12.5]], [[8.0, 8.0]]]) == "[rank 0: -1.000, +2.500; rank 1: +0.000]"


def test_diff_names_each_fingerprint_field_and_every_schedule_attribute(tmp_path):
    plan = _unmeasured(ALL)
    data = json.loads(json.dumps(plan.to_dict()))
    data["fingerprint"].update(backend="nccl", world_size=3, sharding_plan="fedcba9876543210")
    data["fingerprint"]["versions"] = {"torch": "2.14.0", "fbgemm_gpu": "1.9.0"}
    schedule = data["graph"]["modules"][0]["schedule"]
    schedule["inputs"][0].update(process_group="sparse_inputs", stream="input_stream", packing="per_tensor")
    schedule["outputs"][0].update(wait="root_forward")
    for region in schedule["regions"]:
        if region["name"] == "lookup" and region["groups"] == [1]:
            region["kernel"] = "fbgemm"
    data["graph"]["provenance"].reverse()
    data.update(calibration_steps=12, calibration_s=1.5)
    other = ExecutionPlan.from_dict(data)
    d = diff(plan, other)
    assert d.sections["fingerprint"] == [
        "sharding_plan: 0123456789abcdef -> fedcba9876543210",
        "world_size: 2 -> 3",
        "backend: gloo -> nccl",
        "versions.fbgemm_gpu: absent -> 1.9.0",
        "versions.torch: 2.13.0 -> 2.14.0",
        "versions.torchrec: 1.8.0 -> absent",
    ]
    assert d.sections["schedules"] == [
        f"{EBC}: input g0+g1: packing: bytes -> per_tensor; process_group: world -> sparse_inputs; "
        "stream: None -> input_stream",
        f"{EBC}: output g0+g1: wait: module_call -> root_forward",
        f"{EBC}: region lookup[g1]: kernel torchrec -> fbgemm",
    ]
    assert d.sections["provenance"][0].startswith("the same passes in another order: ")
    assert d.sections["calibration"] == ["calibration steps: 0 -> 12", "calibration time: 0.00 s -> 1.50 s"]
    assert "decisions" not in d.sections


def test_what_capture_saw_and_the_groups_layout_count_as_differences_too():
    plan = _unmeasured(ALL)
    data = json.loads(json.dumps(plan.to_dict()))
    module = data["graph"]["modules"][0]
    module["ids_per_step"][0]["a"] += 1.0
    module["batch_input"] = None
    module["groups"][1]["tables"][0]["kernel"] = "fused_uvm_caching"
    data["graph"]["dense_param_bytes"] += 4
    assert diff(plan, ExecutionPlan.from_dict(data)).sections == {"schedules": [
        f"{EBC}: sharding groups' tables differ",
        f"{EBC}: captured ids_per_step, batch_input differ",
        "graph dense_param_bytes differ",
    ]}


def test_diff_of_plans_for_other_modules(tmp_path):
    d = diff(_unmeasured(ALL), _unmeasured(ALL, "two_modules_2ranks"))
    assert d.sections["schedules"][:3] == [f"module {EBC}: only in A", "module model.user_ebc: only in B",
                                           "module model.item_ebc: only in B"]
    assert {line.split(" (only in")[0][:1] for line in d.sections["decisions"]} == {"-", "+"}


@pytest.mark.parametrize("content, message", [
    (b"{not json", "cannot read plan .* as UTF-8 JSON"),
    (json.dumps({"schema": "sparselift-plan/1"}).encode(), "written by another version of lightning_sparselift"),
    (json.dumps([1, 2]).encode(), r"not a sparselift-plan/3 plan \(a JSON array\)"),
])
def test_a_bad_file_exits_2_with_the_reason_and_no_traceback(tmp_path, content, message):
    good = _save(_unmeasured(ALL), tmp_path / "good.json")
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    for argv in (["explain", str(bad)], ["diff", good, str(bad)], ["diff", str(bad), good]):
        status, out, err = _main(*argv)
        assert (status, out) == (BAD_FILE, "")
        assert err.startswith("sparselift plan: error: ") and str(bad) in err and "Traceback" not in err
        assert err.count("\n") == 1 and re.search(message, err)
    status, out, err = _main("diff", good, str(tmp_path / "missing.json"))
    assert status == BAD_FILE and "missing.json" in err and "No such file" in err


@pytest.mark.slow  # (a new interpreter; make test runs the entry point in system/test_registry.py)
def test_the_sparselift_entry_point_runs_plan_diff(tmp_path):
    a = _save(_unmeasured(["aggregation"]), tmp_path / "a.json")
    b = _save(_unmeasured(ALL), tmp_path / "b.json")
    sparselift = Path(sys.executable).parent / "sparselift"
    assert sparselift.exists(), "the sparselift console script is installed with the package"
    run = subprocess.run([str(sparselift), "plan", "diff", a, b], capture_output=True, text=True, timeout=120)
    assert run.returncode == DIFFERENT, run.stderr
    assert run.stdout == diff(ExecutionPlan.load(a), ExecutionPlan.load(b), a, b).text() + "\n"
    assert run.stderr == ""
    run = subprocess.run([str(sparselift), "plan", "explain", str(tmp_path / "nope.json")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == BAD_FILE and "Traceback" not in run.stderr and "nope.json" in run.stderr
