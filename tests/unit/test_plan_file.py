"""Plan files are a cache: one that cannot be decoded, does not match the schema, or whose graph is
not what its accepted candidates give on this run's lifted graph under the selected optimizations
is refused with a PlanFileError saying why. Through the strategy on 2 ranks (training plans again,
an unwritable file warns): tests/ranks/test_plan_file_fit.py."""

from __future__ import annotations

import json
import pickle

import pytest

from graph_fixtures import load, plan_file_dict, unmeasured_plan
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import ExecutionPlan, PlanFileError, Planner

ALL = ["aggregation", "latency_hiding"]
MODULE = "model.sparse_arch.embedding_bag_collection"


def _identity_graph() -> SparseGraph:
    """Two ranks, one module with a table-wise and a column-wise group whose input is in the batch:
    every candidate of both passes is feasible."""
    return load("table_and_column_wise_2ranks")


def _rebuild(plan: ExecutionPlan, identity: SparseGraph, optimizations: list[str]) -> SparseGraph:
    return Planner(select_passes(optimizations), None, calibrate=False).rebuild(plan, identity)


def test_a_saved_plan_loads_and_rebuilds_on_the_same_graph(tmp_path):
    identity = _identity_graph()
    plan = unmeasured_plan(identity, ALL)
    assert len(plan.accepted) == 4  # aggregation input/output, early start, next batch
    plan.save(tmp_path / "plan.json")
    loaded = ExecutionPlan.load(tmp_path / "plan.json")
    assert loaded.to_dict() == json.loads(json.dumps(plan.to_dict()))
    assert _rebuild(loaded, identity, ALL).fingerprint() == plan.graph.fingerprint()
    # schema 2: the graph (version 2) carries each module's schedule; the step's nodes are derived, not saved
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert (saved["schema"], saved["graph"]["version"]) == ("sparselift-plan/3", 3)
    assert "nodes" not in saved["graph"]
    (module,) = saved["graph"]["modules"]
    assert "schedules" not in module and "aggregated" not in module
    assert module["schedule"] == {"lookup_at": "root_forward", "inputs": [
        {"groups": [0, 1], "packing": "bytes", "issue": "previous_step", "process_group": "world", "stream": None}],
        "outputs": [{"groups": [0, 1], "op": "all_to_all_single", "wait": "module_call", "process_group": "world",
                     "stream": None, "split": []}], "regions": identity.to_dict()["modules"][0]["schedule"]["regions"], "wire": {}}
    assert loaded.graph.collectives() == plan.graph.collectives()


def _edited(edit) -> bytes:
    data = plan_file_dict()
    edit(data)
    return json.dumps(data).encode()


@pytest.mark.parametrize("content, match", [
    (b"[]", r"^not a sparselift-plan/3 plan \(a JSON array\)$"),
    (b"null", r"^not a sparselift-plan/3 plan \(a JSON null\)$"),
    (b'"plan"', r"^not a sparselift-plan/3 plan \(a JSON string\)$"),
    (b'{"graph": {}}', r"^not a sparselift-plan/3 plan \(schema None\)$"),
    (_edited(lambda d: d.update(schema="sparselift-plan/2")),
     r"^the plan has schema sparselift-plan/2, written by another version of lightning_sparselift; this version "
     r"reads sparselift-plan/3$"),
    (pickle.dumps({"schema": "sparselift-plan/3"}), "cannot read plan .* as UTF-8 JSON"),
    (b'{"schema": "sparselift-plan/3", "graph": \xff}', "cannot read plan .* as UTF-8 JSON"),
    (b"[" * 100_000, "cannot read plan .* as UTF-8 JSON"),
    (b'{"schema": "sparselift-plan/3", "graph": []}', r"ExecutionPlan: missing key\(s\) \['fingerprint'\]"),
    (_edited(lambda d: d.update(graph=[])), "malformed plan: graph: expected an object, got array"),
    (_edited(lambda d: d.update(junk=1)), r"malformed plan: ExecutionPlan: unknown key\(s\) \['junk'\]"),
    (_edited(lambda d: d["graph"]["modules"][0]["groups"][0].update(features_per_rank=["1", 1])),
     r"graph.modules\[0\].groups\[0\].features_per_rank\[0\]: expected an integer, got string '1'"),
    (_edited(lambda d: d["graph"]["modules"][0].update(schedule="early_start")),
     r"graph.modules\[0\].schedule: expected an object, got string"),
    (_edited(lambda d: d["graph"].update(world_size=True)), "graph.world_size: expected an integer, got boolean"),
    (_edited(lambda d: d["graph"].update(version=1)), "malformed plan: graph: sparse graph version 1 is not 3$"),
    # what version 1 graphs had: the pass flags and layout notes per module, the step's nodes
    (_edited(lambda d: d["graph"]["modules"][0].update(schedules=["early_start"], aggregated=[])),
     r"graph.modules\[0\]: LiftedModule: unknown key\(s\) \['aggregated', 'schedules'\]"),
    (_edited(lambda d: d["graph"].update(nodes=[])), r"malformed plan: graph: SparseGraph: unknown key\(s\) \['nodes'\]"),
    (_edited(lambda d: d["graph"]["modules"][0]["schedule"]["inputs"][0].update(issue="later")),
     r"graph.modules\[0\].schedule.inputs\[0\].issue: expected one of \['previous_step', .*\], got 'later'"),
    (_edited(lambda d: d["graph"]["modules"][0]["schedule"]["outputs"][0].update(op="all_gather")),
     r"graph.modules\[0\].schedule.outputs\[0\].op: expected one of \['all_to_all_single', 'reduce_scatter'\]"),
    (_edited(lambda d: d["decisions"][0].update(accepted="yes")), r"decisions\[0\].accepted: expected a boolean"),
    (_edited(lambda d: d["fingerprint"].pop("graph")), r"fingerprint: PlanFingerprint: missing key\(s\) \['graph'\]"),
    (_edited(lambda d: d.update(step_model={"inputs": {}})), r"step_model: StepModelRecord: missing key\(s\)"),
], ids=["array", "null", "string", "no-schema", "old-schema", "pickle", "not-utf8", "too-deep", "graph-only",
        "graph-as-array", "extra-key", "wrong-item-type", "string-for-object", "bool-for-int", "graph-version",
        "v1-module-fields", "v1-graph-nodes", "schedule-point", "schedule-op", "decision-type",
        "missing-fingerprint-key", "step-model-shape"])
def test_plan_files_that_cannot_be_decoded_are_plan_file_errors(tmp_path, content, match):
    (tmp_path / "plan.json").write_bytes(content)
    with pytest.raises(PlanFileError, match=match):
        ExecutionPlan.load(tmp_path / "plan.json")


def test_a_forged_module_path_is_refused():
    identity = _identity_graph()
    plan = unmeasured_plan(identity, ALL)
    plan.graph.modules[0].path = "../../../../etc/passwd"
    with pytest.raises(PlanFileError, match=r"it has modules \['\.\./\.\./\.\./\.\./etc/passwd'\]; this run's graph has"):
        _rebuild(plan, identity, ALL)


def test_a_graph_with_passes_the_run_did_not_select_is_refused():
    identity = _identity_graph()
    aggregation_only = unmeasured_plan(identity, ["aggregation"])
    # the graph carries latency hiding's rewrites, the decisions and fingerprint say aggregation only
    aggregation_only.graph = unmeasured_plan(identity, ALL).graph
    with pytest.raises(PlanFileError, match=r"it has the passes applied \[.*'latency_hiding: .*\]; they give "
                                            r"\['aggregation: [^\]]*'\]$"):
        _rebuild(aggregation_only, identity, ["aggregation"])
    # decisions that accept a candidate of an unselected pass, or of an unselected role of a selected one
    with pytest.raises(PlanFileError, match=f"accepts latency_hiding:early_start@{MODULE}, which is not a feasible"):
        _rebuild(unmeasured_plan(identity, ALL), identity, ["aggregation"])
    with pytest.raises(PlanFileError, match=f"accepts latency_hiding:next_batch@{MODULE}, which is not a feasible"):
        _rebuild(unmeasured_plan(identity, ["latency_hiding"]), identity, ["latency_hiding:early_start"])


def test_an_accepted_candidate_counts_once():
    identity = _identity_graph()
    plan = unmeasured_plan(identity, ["aggregation"])
    plan.decisions.append(plan.accepted[0])
    with pytest.raises(PlanFileError, match="or is accepted twice"):
        _rebuild(plan, identity, ["aggregation"])


def test_a_failed_save_leaves_no_partial_file(tmp_path):
    (tmp_path / "plan.json").mkdir()
    with pytest.raises(IsADirectoryError):
        unmeasured_plan(_identity_graph(), ALL).save(tmp_path / "plan.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_bad_plan_files_are_refused(tmp_path):
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(PlanFileError, match="cannot read plan"):
        ExecutionPlan.load(tmp_path / "garbage.json")
    (tmp_path / "other.json").write_text('{"schema": "something-else"}')
    with pytest.raises(PlanFileError, match="not a sparselift-plan/3 plan"):
        ExecutionPlan.load(tmp_path / "other.json")
    (tmp_path / "partial.json").write_text('{"schema": "sparselift-plan/3", "fingerprint": {}}')
    with pytest.raises(PlanFileError, match="malformed plan"):
        ExecutionPlan.load(tmp_path / "partial.json")
