"""TorchRec's quantized communication through the strategy's qcomms_config: TorchRec's sharders
quantize the output exchanges; the lifted executor does not apply codecs yet, so the modules keep
TorchRec's path (the reason said), and both executors train bit-identically."""

from __future__ import annotations

import json

import lightning.pytorch as L
import torch

from helpers import DumpLocalState, ExecutorReport, GraphReport, assert_same_dumps, load_dumps, tiny_data, trainer
from lightning_sparselift import SparseLiftStrategy
from user_models import PositionalKJT


def _fit(dm, folder, **strategy_kwargs) -> dict:
    L.seed_everything(0)
    strategy = SparseLiftStrategy(start_method="fork", embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                  sharding_types={"table_cat_4": "column_wise"}, **strategy_kwargs)
    trainer(2, strategy, limit_val_batches=0, callbacks=[DumpLocalState(folder), ExecutorReport(folder),
                                                         GraphReport(folder)]).fit(
        PositionalKJT(dm.table_sizes, dm.feature_names), dm)
    return json.loads((folder / "report0.json").read_text())


def test_quantized_exchanges_train_on_torchrecs_path_with_the_reason(tmp_path, data_cache):
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    dm = tiny_data(data_cache)
    config = QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16)
    _fit(dm, tmp_path / "torchrec", executor="torchrec", qcomms_config=config)
    report = _fit(dm, tmp_path / "sparselift", qcomms_config=config)
    assert report["executor"] == "torchrec"
    assert "quantized (qcomms_config" in report["fallback"], report["fallback"]
    states = assert_same_dumps(tmp_path / "torchrec", tmp_path / "sparselift")
    _fit(dm, tmp_path / "fp32", executor="torchrec")  # the codecs really ran: fp32 exchanges train other tables
    fp32 = load_dumps(tmp_path / "fp32", 2)[0]
    tables = [k for k in states[0] if "embedding_bags" in k and not k.startswith("optim/")]
    assert any(not torch.equal(states[0][k], fp32[k]) for k in tables)

