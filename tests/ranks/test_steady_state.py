"""Plans that stay right in steady state, through the strategy: the installed plan is checked
against the identity plan on interleaved training steps and rolled back when slower; the session
plans again (bit-identical to TorchRec throughout) when the workload drifts from what the plan was
decided on; a reused plan file is checked against the live statistics the same way. The rules
themselves: tests/unit/test_steady_state_rules.py."""

from __future__ import annotations

import time

import lightning.pytorch as L
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from helpers import ONE_LOOK, DumpLocalState, assert_same_dumps, tiny_data, tiny_model, trainer
from lightning_sparselift import CriteoDataModule, SparseLiftStrategy
from lightning_sparselift.data import RecBatch
from lightning_sparselift.data.loading import ResumableLoader, _identity

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
                    "fraction": s.time.calibration_fraction,
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
