"""The sequence model family: target attention, the generator of item histories, the module's
checks, training through the strategy bit-identically to TorchRec's path (the bags and the
EmbeddingCollection lifted, every feasible pass applied), and the LightningCLI config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import torch

from helpers import DumpLocalState, ExecutorReport, GraphReport, assert_same_dumps, trainer
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.sequence_data import SequenceDataModule, SequenceSpec, generate_sequences
from lightning_sparselift.sequence_model import SequenceRankingModule, target_attention

ROOT = Path(__file__).resolve().parents[2]


def test_target_attention_matches_a_per_sample_softmax_and_gives_zeros_for_empty_histories():
    torch.manual_seed(0)
    lengths = torch.tensor([3, 0, 1, 5], dtype=torch.int32)
    query = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    history = torch.randn(int(lengths.sum()), 6, dtype=torch.float64, requires_grad=True)
    got = target_attention(query, history, lengths)
    rows = history.split(lengths.tolist())
    want = torch.stack([torch.softmax(h @ q / 6 ** 0.5, dim=0) @ h if len(h) else torch.zeros(6, dtype=torch.float64)
                        for q, h in zip(query, rows)])
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], torch.zeros(6, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda q, h: target_attention(q, h, lengths), (query, history))
    with pytest.raises(ValueError, match="4 queries .* for 3 histories"):
        target_attention(query, history, lengths[:3])


def _spec(**kwargs) -> SequenceSpec:
    args = dict(num_samples=4000, categorical_rows=(40, 300), num_items=500, categories=10, mean_history=6,
                max_history=20, seed=1)
    args.update(kwargs)
    return SequenceSpec(**args)


def test_histories_have_variable_capped_lengths_and_carry_the_planted_signal():
    a = generate_sequences(_spec())
    assert np.array_equal(a["values"], generate_sequences(_spec())["values"])  # deterministic
    history = a["lengths"][2]
    assert (history == 0).any() and history.max() == 20 and abs(history.mean() - 6) < 1.0
    assert (a["lengths"][[0, 1, 3]] == 1).all()  # one-hot categorical features and one target item
    ids = np.split(a["values"], np.cumsum(a["lengths"].sum(axis=1))[:-1])
    assert ids[0].max() < 40 and ids[1].max() < 300 and ids[2].max() < 500 and ids[3].max() < 500
    # the label depends on the target's category among the history's: informative, not trivially so
    from lightning_sparselift.data import bayes_optimal_auc

    assert 0.7 < bayes_optimal_auc(a["probability"], a["labels"]) < 0.95
    assert np.ptp(generate_sequences(_spec(signal_strength=0.0))["probability"]) == 0  # labels independent
    with pytest.raises(ValueError, match="num_items"):
        _spec(num_items=5)
    with pytest.raises(ValueError, match="mean_history"):
        _spec(mean_history=30)


@pytest.mark.parametrize("change, message", [
    (dict(feature_names=["cat_0", "cat_1", "history", "target"]), r"\['item'\] not among the features"),
    (dict(num_embeddings_per_feature=[40, 300, 500, 400]), "share the item table: their rows differ"),
    (dict(feature_names=["history", "item"], num_embeddings_per_feature=[500, 500]), "at least one categorical"),
    (dict(over_arch_layer_sizes=[16, 2]), "ending in 1"),
])
def test_the_module_names_what_is_wrong(change, message):
    args = dict(num_embeddings_per_feature=[40, 300, 500, 500], feature_names=["cat_0", "cat_1", "history", "item"])
    args.update(change)
    with pytest.raises(ValueError, match=message):
        SequenceRankingModule(**args)


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
    assert report["executor"] == "sparselift" and graph["not_lifted"] == {}
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
