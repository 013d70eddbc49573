"""Trains the tiny model until it is stopped, for tests/system/test_termination.py.

Run as a script: ``python sigterm_training.py <data_cache> <marker_dir> [<rank that raises>]``. The strategy's
default launcher (popen) re-runs this script once per rank, as for a user's training script.
Every rank writes ``<marker_dir>/rank<global rank>`` holding its pid once the lifted executor
has run a training step (from then on the async all-to-alls are in flight at most times), then
trains on (unlimited epochs) until a signal stops it. ``calibrate=False`` applies every candidate
unmeasured, so latency hiding (output and gradient all-to-alls in flight across the dense
compute, the next batch's input all-to-alls during the step) runs from the first lifted step.
The collective timeout is short so that a rank stuck in a collective exits within a minute
instead of half an hour. With a third argument, that rank's ``training_step`` raises alone once
the lifted executor ran (the next batch's input all-to-alls in flight), writing
``<marker_dir>/raised`` first.
"""

import os
import sys
import time
from pathlib import Path

import lightning.pytorch as L

from helpers import tiny_data, tiny_model
from lightning_sparselift import DLRMModule, SparseLiftStrategy


class RaisesAlone(DLRMModule):
    """Raises in ``training_step`` of rank ``raising`` after its forward, once the lifted executor ran."""

    raising, folder = -1, Path()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        strategy = self.trainer.strategy
        if self.trainer.global_rank == self.raising and strategy.lifted_executor is not None and batch_idx >= 6:
            (self.folder / "raised").write_text(str(time.monotonic()))
            raise RuntimeError(f"user code failed on rank {self.raising} alone")
        return loss


class MarkSteadyState(L.Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.marked = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if not self.marked and trainer.strategy.lifted_executor is not None:
            self.marked = True
            (self.folder / f"rank{trainer.global_rank}").write_text(str(os.getpid()))


if __name__ == "__main__":
    data_cache, marker_dir = Path(sys.argv[1]), Path(sys.argv[2])
    dm = tiny_data(data_cache, num_train=2048)
    model = tiny_model(dm)
    if len(sys.argv) > 3:
        model.__class__, RaisesAlone.raising, RaisesAlone.folder = RaisesAlone, int(sys.argv[3]), marker_dir
    trainer = L.Trainer(
        strategy=SparseLiftStrategy(timeout=60, calibrate=False),
        accelerator="cpu", devices=2, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[MarkSteadyState(marker_dir)])
    trainer.fit(model, dm)
