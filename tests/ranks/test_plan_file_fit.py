"""A bad plan file does not stop training: one that cannot be decoded or has an older schema is
refused and training plans again (replacing it); one that cannot be written warns and training goes
on with the plan installed. What makes a file refused, in one process: tests/unit/test_plan_file.py."""

from __future__ import annotations

import json
import pickle

import lightning.pytorch as L
import pytest
import torch

from graph_fixtures import plan_file_dict
from helpers import LIFTED, RecordWarnings, tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.plan import ExecutionPlan


@pytest.mark.parametrize("bad", ["pickle", "older_schema", "unwritable"])
def test_training_goes_on_with_a_bad_plan_file(tmp_path, data_cache, bad):
    plan_path = tmp_path / "plan.json"
    if bad == "pickle":
        plan_path.write_bytes(pickle.dumps(plan_file_dict()))
    elif bad == "older_schema":  # what an earlier lightning_sparselift wrote
        plan_path.write_text(json.dumps({**plan_file_dict(), "schema": "sparselift-plan/1"}))
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
    assert rank0["executor"] in LIFTED
    saving = [w for w in rank0["warnings"] if "could not save the execution plan" in w]
    if bad != "unwritable":  # planned again and replaced the bad file
        assert not saving
        assert ExecutionPlan.load(plan_path).fingerprint.optimizations == ["aggregation"]
    else:
        assert len(saving) == 1 and str(plan_path) in saving[0] and "File exists" in saving[0]
