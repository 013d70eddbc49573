"""Plans that stay right in steady state: the installed plan is checked against the identity plan
on interleaved training steps and rolled back when slower; the workload is watched, and the
session plans again (bit-identical to TorchRec throughout) when it drifts from what the plan was
decided on; a reused plan file is checked against the live statistics the same way."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Optional

import lightning.pytorch as L
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from helpers import ONE_LOOK, DumpLocalState, assert_same_dumps, tiny_data, tiny_model, trainer
from lightning_sparselift import CriteoDataModule, SparseLiftStrategy
from lightning_sparselift.data import RecBatch, ResumableLoader, _identity
from lightning_sparselift.plan.verification import (
    DriftEvent, DriftWatch, ModuleWorkload, PlanVerification, SteadyStateCheck, drift_findings, settle_steps_for,
)


# ---------------------------------------------------------------------------- units
def test_steady_state_check_alternates_with_settle_steps():
    check = SteadyStateCheck(steps=16, settle_steps=0)
    assert (check.measured_pairs, check.planned) == (7, 16)
    uses = []
    for i in range(check.planned):
        uses.append(check.next_uses_candidate())
        check.record(float(i))
    assert uses == [False, True] * 8 and check.done
    assert check.pairs() == [[float(i), float(i + 1)] for i in range(2, 16, 2)]  # warmup pair left out

    check = SteadyStateCheck(steps=8, settle_steps=1)  # too few steps: 1 warmup + 7 measured pairs at least
    assert (check.measured_pairs, check.planned) == (7, 32)
    uses = []
    for i in range(check.planned):
        uses.append(check.next_uses_candidate())
        check.record(float(i))
    assert uses == [False, False, True, True] * 8
    assert check.pairs() == [[5.0 + 4 * k, 7.0 + 4 * k] for k in range(7)]  # the second step of each run


def _workload(mean: float, p99: float, batch: list[int], ids: Optional[float] = None) -> dict[str, ModuleWorkload]:
    total = ids if ids is not None else mean * sum(batch)
    return {"ebc": ModuleWorkload({"a": total, "b": 64.0}, {"a": mean, "b": 1.0}, {"a": p99, "b": 1.0}, batch)}


def test_drift_findings():
    reference = _workload(1.0, 1.0, [32, 32])
    assert drift_findings(reference, _workload(4.9, 0.0, [32, 32]), 5.0) == []
    (grew,) = drift_findings(reference, _workload(50.0, 0.0, [32, 32]), 5.0)
    assert grew.kind == "bag_length" and grew.feature == "a" and "mean bag length 50.00 > 5 x the p99 1.00" in grew.text
    (shrank,) = drift_findings(_workload(20.0, 40.0, [32, 32]), _workload(2.0, 0.0, [32, 32]), 5.0)
    assert shrank.kind == "ids_per_step" and "< 1/5" in shrank.text
    (batch,) = drift_findings(reference, _workload(1.0, 0.0, [64, 64]), 5.0)
    assert batch.kind == "batch_size" and "[64, 64]" in batch.text


EBC = "model.sparse_arch.embedding_bag_collection"


def _kjt(lengths_a: list[int], lengths_b: list[int], per_key: bool = True) -> KeyedJaggedTensor:
    lengths = torch.tensor(lengths_a + lengths_b, dtype=torch.int32)
    values = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    if per_key:
        return KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=values, lengths=lengths)
    return KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths)


def test_drift_watch_on_one_rank():
    from graph_fixtures import load

    graph = load("table_wise_1rank")  # features a, b; batch 8; planned for 8 and 12 ids per step, p99 3
    watch = DriftWatch(graph, rank=0, world=1, every=2, ratio=5.0)
    for _ in range(2):
        watch.observe(EBC, _kjt([1] * 8, [2] * 4 + [1] * 4))
        due = watch.end_step()
    assert due
    findings, live = watch.check(None, torch.device("cpu"))
    assert findings == [] and live[EBC].ids_per_step == {"a": 8.0, "b": 12.0}
    assert live[EBC].batch_size_per_rank == [8]
    # a KJT without length_per_key (summed on the device instead) with bags 50x longer
    kjt = _kjt([50] * 8, [2] * 4 + [1] * 4, per_key=False)
    assert kjt.length_per_key_or_none() is None
    for _ in range(2):
        watch.observe(EBC, kjt)
        due = watch.end_step()
    assert due
    (finding,) = watch.check(None, torch.device("cpu"))[0]
    assert (finding.feature, finding.kind, finding.live, finding.reference) == ("a", "bag_length", 50.0, 3.0)
    live_graph = watch.live_graph(graph, None)
    module = live_graph.module(EBC)
    assert module.ids_per_step == [{"a": 400.0, "b": 12.0}] and module.length_percentiles["a"]["p99"] == 50.0
    assert graph.module(EBC).ids_per_step == [{"a": 8.0, "b": 12.0}]  # the reference is not changed
    # another batch size in every call of a window is drift; in some calls only (a short last batch) not
    watch.observe(EBC, _kjt([1] * 4, [1] * 4))
    watch.observe(EBC, _kjt([1] * 8, [2] * 4 + [1] * 4))
    watch.end_step(), watch.end_step()
    assert watch.check(None, torch.device("cpu"))[0] == []
    for _ in range(2):
        watch.observe(EBC, _kjt([1] * 4, [3] * 4))
        watch.end_step()
    (finding,) = watch.check(None, torch.device("cpu"))[0]
    assert finding.kind == "batch_size" and "batch size per rank [4], planned for [8]" in finding.text


def test_settle_steps_follow_the_next_batch_schedule():
    from types import SimpleNamespace

    from graph_fixtures import load

    assert settle_steps_for(load("table_wise_1rank")) == 0
    ahead = SimpleNamespace(modules=[SimpleNamespace(schedule=SimpleNamespace(input_issue="previous_step"))])
    assert settle_steps_for(ahead) == 1


def test_verification_record_describes_itself():
    v = PlanVerification(16, 0, 7, 0, 0.95, -1.0, -2.0, 3.5, [2.0, 5.0], 0.4, 10.0, "slower", True,
                         [[10.0, 13.5]] * 7)
    text = v.describe()
    assert "measured +3.500 ms" in text and "+35.0%" in text and "predicted -1.000 ms, calibrated -2.000 ms" in text
    assert "ROLLED BACK" in text and v.relative_change == pytest.approx(0.35)
    from lightning_sparselift.typed_json import decode

    assert decode(PlanVerification, json.loads(json.dumps(asdict(v)))) == v
    event = DriftEvent(40, ["ebc feature a: mean bag length 50.00 > 5 x the p99 1.00 ..."],
                       {"ebc/a/bag_length": 50.0, "ebc/a/bag_length/planned": 1.0}, "re-planned on the live statistics")
    assert decode(DriftEvent, json.loads(json.dumps(asdict(event)))) == event
    assert event.describe().startswith("workload drift at step 40: ebc feature a")


# ---------------------------------------------------------------------------- through the strategy
class SaveSession(L.Callback):
    """Per rank at the end of fit: the session's steady-state record and the metrics."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        s = trainer.strategy.session
        torch.save({"verifications": s.verifications, "drift": s.drift_events, "rollbacks": s.rollbacks,
                    "explain": s.explain(), "graph": trainer.strategy.sparse_graph.to_dict(),
                    "identity": s.identity.to_dict(), "plan_accepted": [d.candidate for d in s.plan.accepted],
                    "reasons": [d.reason for d in s.plan.decisions], "trigger": s.trigger,
                    "fraction": s.calibration_fraction,
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   self.folder / f"session{trainer.global_rank}.pt")


def _slow_when_not_identity(delay_s: float):
    """A ModuleExecutor.__call__ that sleeps while its module runs any schedule but the identity one."""
    from lightning_sparselift.runtime.executor import ModuleExecutor

    original = ModuleExecutor.__call__

    def call(self, features):
        if self.schedule != self.spec.schedule:
            time.sleep(delay_s)
        return original(self, features)
    return call


def test_a_slower_installed_plan_is_rolled_back(tmp_path, data_cache, monkeypatch):
    from lightning_sparselift.ir import SparseGraph
    from lightning_sparselift.plan import ExecutionPlan
    from lightning_sparselift.runtime.executor import ModuleExecutor

    plan_path = tmp_path / "plan.json"
    # a plan with aggregation applied, unmeasured (calibrate=False)
    dm = tiny_data(data_cache, num_train=384)  # 6 steps
    L.seed_everything(0)
    t = trainer(2, SparseLiftStrategy(start_method="fork", optimizations=["aggregation"], calibrate=False,
                                      plan_path=str(plan_path)), limit_val_batches=0)
    t.fit(tiny_model(dm), dm)
    assert len(ExecutionPlan.load(plan_path).accepted) == 1

    # reused with calibration on: the steady-state check runs it against the identity plan, and the
    # executor sleeps 20 ms in every step of a non-identity schedule (forked ranks inherit the patch)
    monkeypatch.setattr(ModuleExecutor, "__call__", _slow_when_not_identity(0.02))
    dm = tiny_data(data_cache, num_train=1856)  # 29 steps: 3 captured, 24 checking, 2 after
    L.seed_everything(0)
    strategy = SparseLiftStrategy(start_method="fork", optimizations=["aggregation"], plan_path=str(plan_path),
                                  verify_steps=24)
    t = trainer(2, strategy, callbacks=[SaveSession(tmp_path)], limit_val_batches=0)
    t.fit(tiny_model(dm), dm)
    for rank in range(2):
        info = torch.load(tmp_path / f"session{rank}.pt", weights_only=False)
        (v,) = info["verifications"]
        assert v.verdict == "slower" and v.rolled_back and v.pairs + v.outliers == 11 and v.steps == 24
        assert v.measured_ms > 10 and v.interval_ms[0] > 0  # the 20 ms sleep, beyond noise
        assert v.calibrated_ms is None  # a reused plan: no calibration on this run
        assert info["rollbacks"] == 1 and info["plan_accepted"] == []
        assert any("rolled back by the steady-state check" in r for r in info["reasons"])
        # the identity plan runs again
        identity = SparseGraph.from_dict(info["identity"])
        assert SparseGraph.from_dict(info["graph"]).fingerprint() == identity.fingerprint()
        assert "ROLLED BACK" in info["explain"] and "verification 1:" in info["explain"]
        assert "costing the run" in info["explain"]
    metrics = torch.load(tmp_path / "session0.pt", weights_only=False)["metrics"]
    assert metrics["sparselift/verify/rolled_back"] == 1 and metrics["sparselift/verify/verdict"] == 1
    assert metrics["sparselift/verify/measured_ms"] > 10
    assert 0 < metrics["sparselift/calibration_fraction"] < 1
    # what the compiler cost: the lift, and the check's 8 steps on the plan rolled back (~20 ms each
    # beyond the identity plan's), less than the check's whole window
    assert 0 < metrics["sparselift/cost_fraction"] < metrics["sparselift/calibration_fraction"]
    assert [k for k in metrics if k.endswith("/accepted")] and all(
        metrics[k] == 0 for k in metrics if k.endswith("/accepted"))  # the rolled-back decisions, logged again
    # the plan file now holds the rolled-back (identity) plan
    saved = ExecutionPlan.load(plan_path)
    assert saved.accepted == [] and "rolled back" in " ".join(d.reason for d in saved.decisions)


class DriftingData(CriteoDataModule):
    """The tiny data, except that from the ``drift_from``-th batch each rank loads on, feature
    ``feature``'s bags hold ``factor`` ids instead of one."""

    def __init__(self, *args, drift_from: int, feature: int = 2, factor: int = 50, **kwargs):
        super().__init__(*args, **kwargs)
        self.drift = (drift_from, feature, factor)

    def train_dataloader(self):
        loader = super().train_dataloader()
        return ResumableLoader(_Drifting(loader.dataset, *self.drift, self.table_sizes[self.drift[1]]),
                               sampler=loader.sampler, batch_size=None, collate_fn=_identity)


class _Drifting(torch.utils.data.Dataset):
    def __init__(self, base, start: int, feature: int, factor: int, rows: int):
        self.base, self.start, self.feature, self.factor, self.rows = base, start, feature, factor, rows
        self.fetched = 0

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        batch, n = self.base[index], self.fetched
        self.fetched += 1
        if n < self.start:
            return batch
        kjt = batch.sparse
        keys, size = kjt.keys(), kjt.stride()
        lengths = kjt.lengths().view(len(keys), size).clone()
        values = list(torch.split(kjt.values(), kjt.length_per_key()))
        lengths[self.feature] *= self.factor
        count = int(lengths[self.feature].sum())
        values[self.feature] = (torch.arange(count, dtype=torch.int64) * 7919 + n * 31) % self.rows
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=lengths.reshape(-1))
        return RecBatch(batch.dense, sparse, batch.labels, batch.weights)


def test_drift_replans_once_and_stays_bit_identical_to_torchrec(tmp_path, data_cache):
    """After 30 steps, feature cat_2's bags grow from 1 to 50 ids: the run plans again once, on
    the live statistics, and ends with the same tables and weights as TorchRec's path."""
    from lightning_sparselift.ir import SparseGraph

    steps = 80
    for executor in ("torchrec", "sparselift"):
        L.seed_everything(0)
        dm = DriftingData(batch_size=32, num_train=steps * 64, num_val=300, num_test=300,
                          rows_per_feature=[40, 40, 300, 300, 1000, 7], cache_dir=str(data_cache), seed=3,
                          drift_from=30)
        folder = tmp_path / executor
        folder.mkdir()
        # each round ends within 12 steps
        strategy = SparseLiftStrategy(start_method="fork", executor=executor, optimizations=["aggregation"],
                                      verify_steps=0, min_steps_between_replans=20, **ONE_LOOK)
        callbacks = [DumpLocalState(folder)] + ([SaveSession(folder)] if executor == "sparselift" else [])
        t = trainer(2, strategy, callbacks=callbacks, limit_val_batches=0)
        t.fit(tiny_model(dm), dm)
    assert_same_dumps(tmp_path / "torchrec", tmp_path / "sparselift")
    for rank in range(2):
        info = torch.load(tmp_path / "sparselift" / f"session{rank}.pt", weights_only=False)
        (event,) = info["drift"]
        assert event.action == "re-planned on the live statistics" and event.step > 30
        (finding,) = event.findings
        assert "feature cat_2: mean bag length" in finding and "p99 1.00" in finding
        key = next(k for k in event.statistics if k.endswith("cat_2/bag_length"))
        assert event.statistics[key] > 5 and event.statistics[key + "/planned"] == 1.0
        assert info["trigger"] == event  # the installed plan's round ran because of it
        # the new round decided on the live statistics
        module = SparseGraph.from_dict(info["identity"]).modules[0]
        assert module.length_percentiles["cat_2"]["p99"] == 50.0
        assert all(stats["cat_2"] == 50 * 32 for stats in module.ids_per_step)
        assert "workload drift at step" in info["explain"] and "planned because of" in info["explain"]
    metrics = torch.load(tmp_path / "sparselift" / "session0.pt", weights_only=False)["metrics"]
    assert metrics["sparselift/drift/replans"] == 1


def test_a_reused_plan_is_checked_against_the_live_statistics(tmp_path, data_cache):
    """A plan file decided on one-hot bags is not reused when this run's captured bags are 50x longer."""
    plan_path = tmp_path / "plan.json"
    for run, drift_from in (("first", 10_000), ("second", 0)):
        L.seed_everything(0)
        dm = DriftingData(batch_size=32, num_train=384, num_val=300, num_test=300,
                          rows_per_feature=[40, 40, 300, 300, 1000, 7], cache_dir=str(data_cache), seed=3,
                          drift_from=drift_from)
        folder = tmp_path / run
        folder.mkdir()
        strategy = SparseLiftStrategy(start_method="fork", optimizations=["aggregation"], calibrate=False,
                                      plan_path=str(plan_path))
        t = trainer(2, strategy, callbacks=[SaveSession(folder)], limit_val_batches=0)
        t.fit(tiny_model(dm), dm)
    info = torch.load(tmp_path / "second" / "session0.pt", weights_only=False)
    (event,) = info["drift"]
    assert event.action == f"the plan at {plan_path} is not reused"
    assert "feature cat_2: mean bag length 50.00 > 5 x the p99 1.00" in event.findings[0]
    assert info["metrics"]["sparselift/plan_reused"] == 0


def test_steady_state_options_are_checked():
    with pytest.raises(ValueError, match="verify_steps"):
        SparseLiftStrategy(verify_steps=-1)
    with pytest.raises(ValueError, match="drift_ratio"):
        SparseLiftStrategy(drift_ratio=1.0)
    with pytest.raises(ValueError, match="min_steps_between_replans"):
        SparseLiftStrategy(min_steps_between_replans=-5)
