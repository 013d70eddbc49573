"""Mixed precision and half-precision tables through Trainer.fit on 2 ranks: the lifted executor
with every pass forced on trains bit-identically to TorchRec's path under the same precision."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from helpers import LIFTED, DumpLocalState, ExecutorReport, GraphReport, assert_same_dumps, load_dumps, tiny_data, trainer
from lightning_sparselift import SparseLiftStrategy
from user_models import PositionalKJT


def _fit(dm, folder: Path, precision: str, data_type: str, **strategy_kwargs) -> dict:
    L.seed_everything(0)
    model = PositionalKJT(dm.table_sizes, dm.feature_names, data_type=data_type)
    strategy = SparseLiftStrategy(start_method="fork", embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                  **strategy_kwargs)
    t = trainer(2, strategy, limit_val_batches=0, precision=precision,
                callbacks=[DumpLocalState(folder), ExecutorReport(folder), GraphReport(folder)])
    t.fit(model, dm)
    return {**json.loads((folder / "report0.json").read_text()), **json.loads((folder / "graph0.json").read_text())}


@pytest.mark.parametrize("data_type", ["FP32", "FP16"])
def test_bf16_mixed_trains_bit_identically_to_torchrec(data_type, tmp_path, data_cache):
    dm = tiny_data(data_cache, num_train=640)
    _fit(dm, tmp_path / "torchrec", "bf16-mixed", data_type, executor="torchrec")
    report = _fit(dm, tmp_path / "lifted", "bf16-mixed", data_type, calibrate=False)
    assert report["executor"] in LIFTED, report["fallback"]
    assert "latency_hiding:early_start@embeddings" in {c for c, ok, _ in report["decisions"] if ok}
    states = assert_same_dumps(tmp_path / "torchrec", tmp_path / "lifted")
    tables = [k for k in states[0] if "embedding_bags" in k and not k.startswith("optim/")]
    assert tables and all(states[0][k].dtype == getattr(torch, {"FP32": "float32", "FP16": "float16"}[data_type])
                          for k in tables)
    if data_type == "FP16":
        # TorchRec's planner would make the small tables data-parallel: the dense optimizer (Adam)
        # would then update them in fp16, whose state underflows to NaN
        kinds = {kind for tables in report["plan"].values() for kind in tables.values()}
        assert "data_parallel" not in kinds
        assert all(torch.isfinite(states[0][k].float()).all() for k in tables)
    else:  # autocast really ran the dense part in bf16: full precision trains to other weights
        _fit(dm, tmp_path / "full", "32-true", data_type, calibrate=False)
        full = load_dumps(tmp_path / "full", 2)[0]
        assert any(not torch.equal(full[k], states[0][k]) for k in states[0] if k.startswith("bottom."))
