"""Plan files are a cache: one that cannot be decoded, does not match the schema, or whose graph is
not what its accepted candidates give on this run's lifted graph under the selected optimizations
is refused with a PlanFileError saying why, and training plans again; a plan file that cannot be
written warns and training goes on with the plan installed."""

from __future__ import annotations

import json
import pickle
import warnings

import lightning.pytorch as L
import pytest
import torch

from helpers import tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.lift import LiftedModule, ShardingGroup, SparseGraph, TableShard, _step_nodes
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import ExecutionPlan, PlanFileError, PlanFingerprint, Planner

ALL = ["aggregation", "latency_hiding"]
MODULE = "model.sparse_arch.embedding_bag_collection"


def _identity_graph() -> SparseGraph:
    """Two ranks, one module with a table-wise and a column-wise group whose input is in the batch:
    every candidate of both passes is feasible."""
    table_wise = ShardingGroup(0, "table_wise", ["a", "b"], [1, 1], [], [4, 4], [], ["a", "b"], [4, 4],
                               [TableShard("t_a", 0, 10, 4, 0, 0, "fused", "SUM"),
                                TableShard("t_b", 1, 10, 4, 0, 0, "fused", "SUM")])
    column_wise = ShardingGroup(1, "column_wise", ["c", "c"], [1, 1], [], [2, 2], [], ["c", "c"], [2, 2],
                                [TableShard("t_c", 0, 10, 2, 0, 0, "fused", "SUM"),
                                 TableShard("t_c", 1, 10, 2, 0, 2, "fused", "SUM")])
    batch_path = [["arg", 0], ["attr", "sparse"]]
    module = LiftedModule(MODULE, ["a", "b", "c"], False, "int64", "int64", [], [table_wise, column_wise], [8, 8],
                          [{"a": 8.0, "b": 8.0, "c": 8.0}] * 2, {k: {"p50": 1.0} for k in "abc"},
                          root_input=batch_path, batch_input=batch_path)
    return SparseGraph(2, "gloo", [module], _step_nodes([module], 2, 1024), 1024, {"torch": torch.__version__})


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


def _valid_plan_dict() -> dict:
    return json.loads(json.dumps(_plan(_identity_graph(), ALL).to_dict()))


def _edited(edit) -> bytes:
    data = _valid_plan_dict()
    edit(data)
    return json.dumps(data).encode()


@pytest.mark.parametrize("content, match", [
    (b"[]", r"not a sparselift-plan/1 plan \(a JSON array\)"),
    (b"null", r"not a sparselift-plan/1 plan \(a JSON null\)"),
    (b'"plan"', r"not a sparselift-plan/1 plan \(a JSON string\)"),
    (pickle.dumps({"schema": "sparselift-plan/1"}), "cannot read plan .* as UTF-8 JSON"),
    (b'{"schema": "sparselift-plan/1", "graph": \xff}', "cannot read plan .* as UTF-8 JSON"),
    (b"[" * 100_000, "cannot read plan .* as UTF-8 JSON"),
    (b'{"schema": "sparselift-plan/1", "graph": []}', r"ExecutionPlan: missing key\(s\) \['fingerprint'\]"),
    (_edited(lambda d: d.update(graph=[])), "malformed plan: graph: expected an object, got array"),
    (_edited(lambda d: d.update(junk=1)), r"malformed plan: ExecutionPlan: unknown key\(s\) \['junk'\]"),
    (_edited(lambda d: d["graph"]["modules"][0]["groups"][0].update(features_per_rank=["1", 1])),
     r"graph.modules\[0\].groups\[0\].features_per_rank\[0\]: expected an integer, got string '1'"),
    (_edited(lambda d: d["graph"]["modules"][0].update(schedules="early_start")),
     r"graph.modules\[0\].schedules: expected an array, got string"),
    (_edited(lambda d: d["graph"].update(world_size=True)), "graph.world_size: expected an integer, got boolean"),
    (_edited(lambda d: d["graph"].update(version=2)), "graph: sparse graph version 2 is not 1"),
    (_edited(lambda d: d["graph"]["nodes"][0].update(kind="compute")), r"graph.nodes\[0\]: matches no alternative"),
    (_edited(lambda d: d["decisions"][0].update(accepted="yes")), r"decisions\[0\].accepted: expected a boolean"),
    (_edited(lambda d: d["fingerprint"].pop("graph")), r"fingerprint: PlanFingerprint: missing key\(s\) \['graph'\]"),
    (_edited(lambda d: d.update(priors={})), r"priors: Priors: missing key\(s\)"),
], ids=["array", "null", "string", "pickle", "not-utf8", "too-deep", "graph-only", "graph-as-array", "extra-key",
        "wrong-item-type", "string-for-list", "bool-for-int", "graph-version", "node-kind", "decision-type",
        "missing-fingerprint-key", "priors-shape"])
def test_plan_files_that_cannot_be_decoded_are_plan_file_errors(tmp_path, content, match):
    (tmp_path / "plan.json").write_bytes(content)
    with pytest.raises(PlanFileError, match=match):
        ExecutionPlan.load(tmp_path / "plan.json")


def test_a_forged_module_path_is_refused():
    identity = _identity_graph()
    plan = _plan(identity, ALL)
    plan.graph.modules[0].path = "../../../../etc/passwd"
    with pytest.raises(PlanFileError, match=r"it has \.\./\.\./\.\./\.\./etc/passwd aggregated"):
        _rebuild(plan, identity, ALL)


def test_a_graph_with_passes_the_run_did_not_select_is_refused():
    identity = _identity_graph()
    aggregation_only = _plan(identity, ["aggregation"])
    # the graph carries latency hiding's schedules, the decisions and fingerprint say aggregation only
    aggregation_only.graph = _plan(identity, ALL).graph
    with pytest.raises(PlanFileError, match=r"schedules \['early_start', 'next_batch'\]; they give .* schedules \[\]"):
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


@pytest.mark.parametrize("bad", ["pickle", "unwritable"])
def test_training_goes_on_with_a_bad_plan_file(tmp_path, data_cache, bad):
    plan_path = tmp_path / "plan.json"
    if bad == "pickle":
        plan_path.write_bytes(pickle.dumps(_valid_plan_dict()))
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
    if bad == "pickle":  # planned again and replaced the bad file
        assert not saving
        assert ExecutionPlan.load(plan_path).fingerprint.optimizations == ["aggregation"]
    else:
        assert len(saving) == 1 and str(plan_path) in saving[0] and "File exists" in saving[0]
