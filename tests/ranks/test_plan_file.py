"""Plan files are a cache: one that cannot be decoded, does not match the schema, or whose graph is
not what its accepted candidates give on this run's lifted graph under the selected optimizations
is refused with a PlanFileError saying why, and training plans again; a plan file that cannot be
written warns and training goes on with the plan installed."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from helpers import tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import ExecutionPlan, PlanFileError, PlanFingerprint, Planner

ALL = ["aggregation", "latency_hiding"]
MODULE = "model.sparse_arch.embedding_bag_collection"
IDENTITY = Path(__file__).resolve().parents[1] / "fixtures" / "graphs" / "table_and_column_wise_2ranks.json"


def _identity_graph() -> SparseGraph:
    """Two ranks, one module with a table-wise and a column-wise group whose input is in the batch:
    every candidate of both passes is feasible."""
    return SparseGraph.from_dict(json.loads(IDENTITY.read_text()))


def _plan(identity: SparseGraph, optimizations: list[str]) -> ExecutionPlan:
    """What the warmup plans with calibrate=False: every feasible candidate of ``optimizations`` applied."""
    planner = Planner(select_passes(optimizations), None, calibrate=False)
    fingerprint = PlanFingerprint(identity.fingerprint(), "sharding", 2, "gloo", {}, sorted(optimizations))
    plan = ExecutionPlan(fingerprint, identity)
    feasible, plan.decisions = planner.propose(identity)
    for candidate in feasible:
        plan.graph = planner.apply(plan.graph, candidate)
        plan.decisions.append(planner.decide(candidate, None))
    return plan


def _rebuild(plan: ExecutionPlan, identity: SparseGraph, optimizations: list[str]) -> SparseGraph:
    return Planner(select_passes(optimizations), None, calibrate=False).rebuild(plan, identity)


def test_a_saved_plan_loads_and_rebuilds_on_the_same_graph(tmp_path):
    identity = _identity_graph()
    plan = _plan(identity, ALL)
    assert len(plan.accepted) == 4  # aggregation input/output, early start, next batch
    plan.save(tmp_path / "plan.json")
    loaded = ExecutionPlan.load(tmp_path / "plan.json")
    assert loaded.to_dict() == json.loads(json.dumps(plan.to_dict()))
    assert _rebuild(loaded, identity, ALL).fingerprint() == plan.graph.fingerprint()
    # schema 2: the graph (version 2) carries each module's schedule; the step's nodes are derived, not saved
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert (saved["schema"], saved["graph"]["version"]) == ("sparselift-plan/2", 3)
    assert "nodes" not in saved["graph"]
    (module,) = saved["graph"]["modules"]
    assert "schedules" not in module and "aggregated" not in module
    assert module["schedule"] == {"lookup_at": "root_forward", "inputs": [
        {"groups": [0, 1], "packing": "bytes", "issue": "previous_step", "process_group": "world", "stream": None}],
        "outputs": [{"groups": [0, 1], "op": "all_to_all_single", "wait": "module_call", "process_group": "world",
                     "stream": None, "split": []}], "regions": identity.to_dict()["modules"][0]["schedule"]["regions"]}
    assert loaded.graph.collectives() == plan.graph.collectives()


def _valid_plan_dict() -> dict:
    return json.loads(json.dumps(_plan(_identity_graph(), ALL).to_dict()))


def _edited(edit) -> bytes:
    data = _valid_plan_dict()
    edit(data)
    return json.dumps(data).encode()


@pytest.mark.parametrize("content, match", [
    (b"[]", r"^not a sparselift-plan/2 plan \(a JSON array\)$"),
    (b"null", r"^not a sparselift-plan/2 plan \(a JSON null\)$"),
    (b'"plan"', r"^not a sparselift-plan/2 plan \(a JSON string\)$"),
    (b'{"graph": {}}', r"^not a sparselift-plan/2 plan \(schema None\)$"),
    (_edited(lambda d: d.update(schema="sparselift-plan/1")),
     r"^the plan has schema sparselift-plan/1, written by another version of lightning_sparselift; this version "
     r"reads sparselift-plan/2$"),
    (pickle.dumps({"schema": "sparselift-plan/2"}), "cannot read plan .* as UTF-8 JSON"),
    (b'{"schema": "sparselift-plan/2", "graph": \xff}', "cannot read plan .* as UTF-8 JSON"),
    (b"[" * 100_000, "cannot read plan .* as UTF-8 JSON"),
    (b'{"schema": "sparselift-plan/2", "graph": []}', r"ExecutionPlan: missing key\(s\) \['fingerprint'\]"),
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
    (_edited(lambda d: d.update(priors={})), r"priors: Priors: missing key\(s\)"),
], ids=["array", "null", "string", "no-schema", "old-schema", "pickle", "not-utf8", "too-deep", "graph-only",
        "graph-as-array", "extra-key", "wrong-item-type", "string-for-object", "bool-for-int", "graph-version",
        "v1-module-fields", "v1-graph-nodes", "schedule-point", "schedule-op", "decision-type",
        "missing-fingerprint-key", "priors-shape"])
def test_plan_files_that_cannot_be_decoded_are_plan_file_errors(tmp_path, content, match):
    (tmp_path / "plan.json").write_bytes(content)
    with pytest.raises(PlanFileError, match=match):
        ExecutionPlan.load(tmp_path / "plan.json")


def test_a_forged_module_path_is_refused():
    identity = _identity_graph()
    plan = _plan(identity, ALL)
    plan.graph.modules[0].path = "../../../../etc/passwd"
    with pytest.raises(PlanFileError, match=r"it has modules \['\.\./\.\./\.\./\.\./etc/passwd'\]; this run's graph has"):
        _rebuild(plan, identity, ALL)


def test_a_graph_with_passes_the_run_did_not_select_is_refused():
    identity = _identity_graph()
    aggregation_only = _plan(identity, ["aggregation"])
    # the graph carries latency hiding's rewrites, the decisions and fingerprint say aggregation only
    aggregation_only.graph = _plan(identity, ALL).graph
    with pytest.raises(PlanFileError, match=r"it has the passes applied \[.*'latency_hiding: .*\]; they give "
                                            r"\['aggregation: [^\]]*'\]$"):
        _rebuild(aggregation_only, identity, ["aggregation"])
    # decisions that accept a candidate of an unselected pass, or of an unselected role of a selected one
    with pytest.raises(PlanFileError, match=f"accepts latency_hiding:early_start@{MODULE}, which is not a feasible"):
        _rebuild(_plan(identity, ALL), identity, ["aggregation"])
    with pytest.raises(PlanFileError, match=f"accepts latency_hiding:next_batch@{MODULE}, which is not a feasible"):
        _rebuild(_plan(identity, ["latency_hiding"]), identity, ["latency_hiding:early_start"])


def test_an_accepted_candidate_counts_once():
    identity = _identity_graph()
    plan = _plan(identity, ["aggregation"])
    plan.decisions.append(plan.accepted[0])
    with pytest.raises(PlanFileError, match="or is accepted twice"):
        _rebuild(plan, identity, ["aggregation"])


def test_a_failed_save_leaves_no_partial_file(tmp_path):
    (tmp_path / "plan.json").mkdir()
    with pytest.raises(IsADirectoryError):
        _plan(_identity_graph(), ALL).save(tmp_path / "plan.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


class RecordWarnings(L.Callback):
    """Saves the warnings each rank raised during training and which executor it ended on."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_start(self, trainer, pl_module):
        self._recording = warnings.catch_warnings(record=True)
        self._caught = self._recording.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, pl_module):
        self._recording.__exit__(None, None, None)
        torch.save({"executor": trainer.strategy.executor_in_use,
                    "warnings": [str(w.message) for w in self._caught]},
                   self.folder / f"rank{trainer.global_rank}.pt")


@pytest.mark.parametrize("bad", ["pickle", "older_schema", "unwritable"])
def test_training_goes_on_with_a_bad_plan_file(tmp_path, data_cache, bad):
    plan_path = tmp_path / "plan.json"
    if bad == "pickle":
        plan_path.write_bytes(pickle.dumps(_valid_plan_dict()))
    elif bad == "older_schema":  # what an earlier lightning_sparselift wrote
        plan_path.write_text(json.dumps({**_valid_plan_dict(), "schema": "sparselift-plan/1"}))
    else:  # a regular file where the plan's folder should be (unwritable even for root)
        (tmp_path / "file").write_text("")
        plan_path = tmp_path / "file" / "plan.json"
    dm = tiny_data(data_cache, num_train=384)  # 6 steps on 2 ranks: 3 captured, 3 on the plan
    L.seed_everything(0)
    strategy = SparseLiftStrategy(start_method="fork", optimizations=["aggregation"], calibrate=False,
                                  plan_path=str(plan_path))
    t = trainer(2, strategy, callbacks=[RecordWarnings(tmp_path)], limit_val_batches=0)
    t.fit(tiny_model(dm), dm)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert rank0["executor"] == "sparselift"
    saving = [w for w in rank0["warnings"] if "could not save the execution plan" in w]
    if bad != "unwritable":  # planned again and replaced the bad file
        assert not saving
        assert ExecutionPlan.load(plan_path).fingerprint.optimizations == ["aggregation"]
    else:
        assert len(saving) == 1 and str(plan_path) in saving[0] and "File exists" in saving[0]
