"""The next-batch schedule through Trainer.fit: a step whose features changed after their
distribution started fails on every rank; epochs cut short by limit_train_batches do not expect the
batch their last step announced. Its moving parts in one process: tests/unit/test_latency_hiding.py."""

from __future__ import annotations

import lightning.pytorch as L
import pytest

from helpers import tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy


class ChangeSparseInPlace(L.Callback):
    """Changes the ids of one batch after the lifted executor started distributing them."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            batch.sparse.values().add_(1).remainder_(7)  # still valid ids of the smallest table


def test_a_step_whose_features_changed_after_their_distribution_started_fails(data_cache):
    dm = tiny_data(data_cache, num_train=512)
    strategy = SparseLiftStrategy(start_method="fork", calibrate=False, optimizations=["latency_hiding"])
    # steps 0-2 are captured; step 3 is the first on the plan and starts step 4's input distribution
    t = trainer(2, strategy, callbacks=[ChangeSparseInPlace(at=4)], limit_val_batches=0)
    with pytest.raises(Exception, match="not the ones the training loop announced as next"):
        t.fit(tiny_model(dm), dm)


def test_epochs_cut_short_by_limit_train_batches(data_cache):
    # each epoch's last step announces a batch the epoch never reaches; the next epoch must not expect it
    dm = tiny_data(data_cache, num_train=512)
    strategy = SparseLiftStrategy(start_method="fork", calibrate=False, optimizations=["latency_hiding"])
    trainer(2, strategy, limit_train_batches=5, max_epochs=3, limit_val_batches=0).fit(tiny_model(dm), dm)
