"""The loggers a user reaches for, through the strategy (fork launcher): TensorBoard (the ``logging``
extra) receives the strategy's metrics, and LearningRateMonitor's columns say whose LR each is."""

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from helpers import tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy


class MonitorNames(L.Callback):
    """Saves the LR monitor's column names at the end of training."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        (monitor,) = [c for c in trainer.callbacks if isinstance(c, LearningRateMonitor)]
        torch.save(sorted(monitor.lrs), self.folder / f"names{trainer.global_rank}.pt")


def test_tensorboard_gets_the_strategy_metrics_and_the_lr_columns_name_their_optimizer(tmp_path, data_cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dm = tiny_data(data_cache)
    strategy = SparseLiftStrategy(start_method="fork", embedding_optimizer={"name": "sgd", "lr": 0.2},
                                  optimizations=["aggregation"], calibrate=False)
    loggers = [TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")]
    trainer(2, strategy, logger=loggers, callbacks=[LearningRateMonitor(), MonitorNames(tmp_path)],
            limit_val_batches=0, max_steps=6, log_every_n_steps=1).fit(tiny_model(dm), dm)
    assert torch.load(tmp_path / "names0.pt") == ["lr-CombinedOptimizer/dense", "lr-CombinedOptimizer/embedding"]
    (events,) = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"lr-CombinedOptimizer/embedding", "lr-CombinedOptimizer/dense", "train/loss"} <= set(tags), tags
    assert any(tag.startswith("sparselift/") for tag in tags), tags
