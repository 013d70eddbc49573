"""The steady state's rules in one process: the verification's interleaving with settle steps,
drift findings and the drift watch on one rank, the records' text and JSON, the options' checks.
Through the strategy (rollback, drift re-plans, a reused plan checked): tests/ranks/test_steady_state.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Optional

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.plan.verification import (
    DriftEvent, DriftWatch, ModuleWorkload, PlanVerification, SteadyStateCheck, drift_findings, settle_steps_for,
)

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


def test_steady_state_options_are_checked():
    with pytest.raises(ValueError, match="verify_steps"):
        SparseLiftStrategy(verify_steps=-1)
    with pytest.raises(ValueError, match="drift_ratio"):
        SparseLiftStrategy(drift_ratio=1.0)
    with pytest.raises(ValueError, match="min_steps_between_replans"):
        SparseLiftStrategy(min_steps_between_replans=-5)
