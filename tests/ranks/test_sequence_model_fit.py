"""The sequence model family through the strategy: training bit-identically to TorchRec's path
(the bags and the EmbeddingCollection lifted, every feasible pass applied), and the LightningCLI
config (target attention, the generator and the module's checks: tests/unit/test_sequence_model.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest

from helpers import DumpLocalState, ExecutorReport, GraphReport, LIFTED, assert_same_dumps, trainer
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.data import SequenceDataModule
from lightning_sparselift.models import SequenceRankingModule

ROOT = Path(__file__).resolve().parents[2]


def _data(cache: Path) -> SequenceDataModule:
    return SequenceDataModule(batch_size=64, num_train=64 * 2 * 12, num_val=256, num_test=256,
                              categorical_rows=[40, 300, 7], num_items=500, categories=10, mean_history=6,
                              max_history=20, cache_dir=str(cache), seed=2)


def test_trains_through_the_strategy_bit_identically_to_torchrecs_path(tmp_path, data_cache):
    dm = _data(data_cache)
    # table-wise bags: every pass has something to do; the item table row-wise
    types = {**{f"t_cat_{i}": "table_wise" for i in range(3)}, "t_items": "row_wise"}

    def fit(folder: Path, **kwargs) -> tuple[dict, dict]:
        L.seed_everything(0)
        model = SequenceRankingModule(dm.table_sizes, dm.feature_names, dm.num_dense, embedding_dim=8,
                                      item_embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
        strategy = SparseLiftStrategy(start_method="fork", sharding_types=types, calibrate=False,
                                      embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05}, **kwargs)
        t = trainer(2, strategy, limit_val_batches=0,
                    callbacks=[DumpLocalState(folder), ExecutorReport(folder), GraphReport(folder)])
        t.fit(model, dm)
        return (json.loads((folder / "report0.json").read_text()), json.loads((folder / "graph0.json").read_text()))

    fit(tmp_path / "torchrec", executor="torchrec")
    report, graph = fit(tmp_path / "lifted")
    assert report["executor"] in LIFTED and graph["not_lifted"] == {}
    assert sorted(graph["modules"]) == ["model.sparse_arch.bags", "model.sparse_arch.sequences"]
    assert graph["plan"]["model.sparse_arch.sequences"] == {"t_items": "row_wise"}
    # both collections' input is the batch's KJT as it is (each selects its keys): they start early
    # and distribute the next batch; both run generated lookups (the sequence rows' per id)
    accepted = {tuple(candidate.split("@")) for candidate, ok, _ in report["decisions"] if ok}
    for path in graph["modules"]:
        assert {("latency_hiding:early_start", path), ("latency_hiding:next_batch", path),
                ("codegen:lookup", path)} <= accepted
    assert report["early_steps"] > 0 and report["prefetched_steps"] > 0
    assert_same_dumps(tmp_path / "torchrec", tmp_path / "lifted")


@pytest.mark.slow  # (make test runs the CLI on the tiny config: system/test_registry.py)
def test_the_lightning_cli_config_trains_the_sequence_model(tmp_path, data_cache):
    small = ["--data.init_args.num_train", "2048", "--data.init_args.num_val", "512", "--data.init_args.num_test", "512",
             "--data.init_args.num_items", "2000", "--data.init_args.batch_size", "128",
             "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false"]
    out = subprocess.run([str(Path(sys.executable).with_name("sparselift")), "fit", "--config",
                          str(ROOT / "configs/sequence_synthetic.yaml"), *small],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "SPARSELIFT_CACHE": str(data_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "lifted 2 sparse module(s)" in text and "`Trainer.fit` stopped" in text
