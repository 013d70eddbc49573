"""TorchRec's quantized communication through the strategy's qcomms_config: TorchRec's sharders
quantize the output exchanges and the lifted executor applies the same codecs where TorchRec's
comm ops do (FP16 / BF16), so with every pass forced on it trains bit-identically to TorchRec's
path under the same config; codecs it does not apply (INT8) keep TorchRec's path, the reason said."""

from __future__ import annotations

import json
import re

import lightning.pytorch as L
import pytest
import torch

from helpers import (
    LIFTED, DumpLocalState, ExecutorReport, GraphReport, assert_same_dumps, load_dumps, tiny_data, trainer,
)
from lightning_sparselift import SparseLiftStrategy
from user_models import PositionalKJT, WithSequenceFeature

# column-wise, row-wise (its reduce-scatter) and table-wise tables
SHARDING = {"table_cat_4": "column_wise", "table_cat_2": "row_wise"}


def _fit(dm, folder, sharding=SHARDING, model=PositionalKJT, world=2, **strategy_kwargs) -> dict:
    L.seed_everything(0)
    strategy = SparseLiftStrategy(start_method="fork", embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                  sharding_types=sharding, **strategy_kwargs)
    trainer(world, strategy, limit_val_batches=0, callbacks=[DumpLocalState(folder), ExecutorReport(folder),
                                                         GraphReport(folder)]).fit(
        model(dm.table_sizes, dm.feature_names), dm)
    return {**json.loads((folder / "report0.json").read_text()), **json.loads((folder / "graph0.json").read_text())}


def _config(forward: str, backward: str, **kwargs):
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    return QCommsConfig(forward_precision=CommType[forward], backward_precision=CommType[backward], **kwargs)


# (3 ranks: an 8-wide table does not split in 3 column shards; INT8: TorchRec's own row-wise reduce-scatter fails
# under it)
@pytest.mark.parametrize("forward, backward, loss_scale, world, sharding", [
    ("FP16", "FP16", None, 2, SHARDING), ("FP16", "BF16", 4.0, 2, SHARDING),
    ("FP16", "FP16", 2.0, 3, {"table_cat_2": "row_wise"}), ("INT8", "INT8", None, 2, {"table_cat_4": "column_wise"}),
    ("INT8", "INT8", None, 2, {"table_cat_4": "table_column_wise"})], ids=["fp16", "fp16-bf16", "fp16-3ranks", "int8",
                                                                          "int8-twcw"])
def test_quantized_exchanges_lifted_bit_identical_to_torchrecs_path(forward, backward, loss_scale, world, sharding,
                                                                     tmp_path, data_cache):
    dm = tiny_data(data_cache, num_train=768)
    config = _config(forward, backward, forward_loss_scale=loss_scale, backward_loss_scale=loss_scale)
    _fit(dm, tmp_path / "torchrec", sharding, world=world, executor="torchrec", qcomms_config=config)
    report = _fit(dm, tmp_path / "lifted", sharding, world=world, calibrate=False, qcomms_config=config)
    assert report["executor"] in LIFTED, report["fallback"]
    assert "latency_hiding:early_start@embeddings" in {c for c, ok, _ in report["decisions"] if ok}
    # the graph's collectives carry the wire's dtype
    wire = "uint8" if forward == "INT8" else "float16"
    assert re.search(rf"output_pooled .* {wire}", report["explain"]), report["explain"]
    assert forward == "INT8" or re.search(r"output_partial_sums .* float16", report["explain"]), report["explain"]
    states = assert_same_dumps(tmp_path / "torchrec", tmp_path / "lifted", world)
    _fit(dm, tmp_path / "fp32", sharding, world=world, executor="torchrec")  # the codecs really ran: fp32 exchanges train other tables
    fp32 = load_dumps(tmp_path / "fp32", world)[0]
    tables = [k for k in states[0] if "embedding_bags" in k and not k.startswith("optim/")]
    assert any(not torch.equal(states[0][k], fp32[k]) for k in tables)


def test_a_codec_the_lifted_executor_does_not_apply_keeps_torchrecs_path(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    config = _config("MX4", "FP16")
    report = _fit(dm, tmp_path / "mx4", sharding={"table_cat_4": "column_wise"}, qcomms_config=config)
    assert report["executor"] == "torchrec"
    assert "as MX4, which the lifted executor does not apply" in report["fallback"], report["fallback"]


def test_an_embedding_collections_quantized_rows_are_lifted_bit_identical(tmp_path, data_cache):
    dm = tiny_data(data_cache)
    config = _config("FP16", "FP16")
    _fit(dm, tmp_path / "torchrec", sharding=None, model=WithSequenceFeature, executor="torchrec",
         qcomms_config=config)
    report = _fit(dm, tmp_path / "lifted", sharding=None, model=WithSequenceFeature, calibrate=False,
                  qcomms_config=config)
    assert report["executor"] in LIFTED and not report["not_lifted"], report
    assert re.search(r"output_sequence .* float16", report["explain"]), report["explain"]
    assert_same_dumps(tmp_path / "torchrec", tmp_path / "lifted")
