"""GPU runs (NCCL, CUDA fbgemm kernels). Skipped without CUDA devices."""

import lightning.pytorch as L
import pytest
import torch

from helpers import tiny_data, tiny_model
from lightning_sparselift import SparseLiftStrategy


def _fit(devices, data_cache, **strategy_kwargs):
    dm = tiny_data(data_cache)
    trainer = L.Trainer(strategy=SparseLiftStrategy(start_method="spawn", **strategy_kwargs), accelerator="gpu",
                        devices=devices, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False)
    trainer.fit(tiny_model(dm), dm)
    return trainer.callback_metrics


@pytest.mark.gpu
def test_one_gpu_trains_with_fused_adam(data_cache):
    metrics = _fit(1, data_cache, embedding_optimizer={"name": "adam", "lr": 0.01})
    assert torch.isfinite(metrics["train/loss"])
    assert 0.0 < float(metrics["val/auc"]) < 1.0


@pytest.mark.multigpu
@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "table_row_wise"])
def test_two_gpus_over_nccl(kind, data_cache):
    metrics = _fit(2, data_cache, sharding_types={"t_cat_4": kind})
    assert torch.isfinite(metrics["train/loss"])
