"""Mid-epoch resume: a run killed mid-epoch and resumed from its last checkpoint ends exactly where
an uninterrupted run ends, on both executors (the lifted one reads the loader one batch ahead), with
rowwise Adagrad and with Adam (whose bias corrections read fbgemm's iteration counter). The loaders'
own positions, in one process: tests/unit/test_loader_positions.py."""

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import DumpLocalState, load_dumps, tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy

# 2560 samples / batch 32 / 2 ranks: 40 steps per epoch, so steps 20 and 26 are mid-epoch
NUM_TRAIN = 2560
KILL_AT_STEP = 26


class Killed(Exception):
    pass


class KillAtStep(L.Callback):
    """Raises before the training step ``step`` (a crash: nothing after the last checkpoint survives)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Killed(f"killed before step {self.step}")


def _fit(dm, tmp_path: Path, name: str, executor: str, optimizer: str, ckpt_path=None, kill_at=None):
    L.seed_everything(11)
    model = tiny_model(dm, lr_scheduler="cosine", lr_scheduler_steps=80)
    callbacks = [DumpLocalState(tmp_path / name),
                 ModelCheckpoint(dirpath=tmp_path / f"{name}-ckpt", save_top_k=-1, every_n_train_steps=10)]
    if kill_at is not None:
        callbacks.append(KillAtStep(kill_at))
    # calibrate=False applies the next-batch schedule unmeasured: the lifted run always trains on announced batches
    strategy = SparseLiftStrategy(start_method="fork", executor=executor, calibrate=False,
                                  embedding_optimizer={"name": optimizer, "lr": 0.05},
                                  embedding_lr_schedule="follow_dense")
    t = trainer(2, strategy, max_epochs=2, callbacks=callbacks, limit_val_batches=0, enable_checkpointing=True)
    t.fit(model, dm, ckpt_path=ckpt_path)


@pytest.mark.parametrize("executor, optimizer", [pytest.param("torchrec", "rowwise_adagrad", marks=pytest.mark.slow),
                                                 ("sparselift", "rowwise_adagrad"), ("sparselift", "adam")])
def test_mid_epoch_resume_continues_exactly(tmp_path, data_cache, executor, optimizer):
    dm = tiny_data(data_cache, num_train=NUM_TRAIN)
    _fit(dm, tmp_path, "straight", executor, optimizer)
    with pytest.raises(Exception, match=f"killed before step {KILL_AT_STEP}"):
        _fit(dm, tmp_path, "killed", executor, optimizer, kill_at=KILL_AT_STEP)
    checkpoints = sorted(p.name for p in (tmp_path / "killed-ckpt").iterdir())
    assert checkpoints == ["epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt"]
    # resumed mid-epoch 0, it runs through the rest of epoch 0 and all of epoch 1
    _fit(dm, tmp_path, "resumed", executor, optimizer, ckpt_path=tmp_path / "killed-ckpt" / "epoch=0-step=20.ckpt")

    straight, resumed = load_dumps(tmp_path / "straight", 2), load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        assert straight[rank].keys() == resumed[rank].keys()
        assert any(k.startswith("optim/") for k in straight[rank]), "no fused optimizer state found"
        for key in straight[rank]:
            assert torch.equal(straight[rank][key], resumed[rank][key]), f"rank {rank}: {key} differs after resume"
