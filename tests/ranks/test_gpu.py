"""GPU runs (NCCL, CUDA fbgemm kernels). Skipped without CUDA devices."""

import lightning.pytorch as L
import pytest
import torch

from helpers import DumpLocalState, assert_same_dumps, tiny_data, tiny_model
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


@pytest.mark.gpu
def test_one_gpu_runs_the_triton_lookups_in_buckets_on_streams_bit_identical_to_one_bucket(tmp_path, data_cache):
    """Under numerics="fast" (the generated Triton lookups), without calibration: the lookups in
    one bucket and in two (subgraph parallelism forced: each bucket on a CUDA stream of its own)
    train to the same tables, optimizer state and dense weights."""
    dm = tiny_data(data_cache)
    plans = {}
    for name, optimizations in (("one", ["codegen:lookup"]),
                                ("buckets", ["codegen:lookup", "subgraph_parallelism:buckets2"])):
        L.seed_everything(0)
        strategy = SparseLiftStrategy(start_method="spawn", calibrate=False, numerics="fast",
                                      optimizations=optimizations, embedding_optimizer={"name": "adagrad", "lr": 0.05},
                                      sharding_types={f"t_{f}": "table_wise" for f in dm.feature_names})
        L.Trainer(strategy=strategy, accelerator="gpu", devices=1, max_epochs=1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                  callbacks=[DumpLocalState(tmp_path / name)]).fit(tiny_model(dm), dm)
        plans[name] = strategy.execution_plan
    assert_same_dumps(tmp_path / "one", tmp_path / "buckets", world_size=1)
    lookups = [r for m in plans["buckets"].graph.modules for r in m.schedule.regions if r.name == "lookup"]
    assert [len(r.buckets) for r in lookups if r.kernel == "generated"] == [2]
    assert plans["buckets"].graph.device == "cuda"


@pytest.mark.multigpu
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_two_gpus_under_mixed_precision_match_torchrecs_path_or_refuse(precision, tmp_path, data_cache):
    """bf16-mixed: the lifted executor (every pass forced on) trains bit-identically to TorchRec's
    path under the same precision; 16-mixed's loss scaling is refused, naming the flag."""
    dm = tiny_data(data_cache)

    def fit(name, **strategy_kwargs):
        L.seed_everything(0)
        L.Trainer(strategy=SparseLiftStrategy(start_method="spawn", **strategy_kwargs), accelerator="gpu", devices=2,
                  precision=precision, max_epochs=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, limit_val_batches=0,
                  callbacks=[DumpLocalState(tmp_path / name)]).fit(tiny_model(dm), dm)

    if precision == "16-mixed":
        with pytest.raises(Exception, match=r"precision='16-mixed'.*GradScaler"):
            fit("lifted", calibrate=False)
        return
    fit("torchrec", executor="torchrec")
    fit("lifted", calibrate=False)
    assert_same_dumps(tmp_path / "torchrec", tmp_path / "lifted", world_size=2)
