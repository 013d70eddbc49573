"""Mid-epoch resume: a run killed mid-epoch and resumed from its last checkpoint ends exactly where
an uninterrupted run ends, on both executors (the lifted one reads the loader one batch ahead), with
rowwise Adagrad and with Adam (whose bias corrections read fbgemm's iteration counter)."""

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import DumpLocalState, load_dumps, tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.data.loading import EpochShuffledSampler, ResumableLoader
from lightning_sparselift.lightning.lookahead import LookaheadLoader

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


class CountingLoader:
    """A stateful loader of batches 0..n-1 whose state is the number of batches it has produced."""

    def __init__(self, n: int):
        self.n = n
        self.produced = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        while self.produced < self.n:
            self.produced += 1
            yield self.produced - 1

    def state_dict(self) -> dict:
        return {"produced": self.produced}

    def load_state_dict(self, state: dict) -> None:
        self.produced = state["produced"]


def test_lookahead_state_is_the_consumers_position():
    loader = LookaheadLoader(CountingLoader(5))
    positions = []
    for batch in loader:
        assert loader.loader.produced == min(batch + 2, 5)  # one batch ahead
        positions.append(loader.state_dict())
    assert positions == [{"produced": k} for k in range(1, 6)]

    resumed = LookaheadLoader(CountingLoader(5))
    resumed.load_state_dict(positions[1])  # the consumer had batches 0 and 1
    assert list(resumed) == [2, 3, 4]


def test_lookahead_is_stateful_only_when_its_loader_is():
    assert hasattr(LookaheadLoader(CountingLoader(1)), "state_dict")
    assert hasattr(LookaheadLoader(CountingLoader(1)), "load_state_dict")
    assert not hasattr(LookaheadLoader(list(range(3))), "state_dict")
    assert not hasattr(LookaheadLoader(list(range(3))), "load_state_dict")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_training_loader_resumes_mid_epoch(num_workers):
    def loader():
        dataset = list(range(40))
        return ResumableLoader(dataset, sampler=EpochShuffledSampler(dataset, 2, 0, seed=5), batch_size=None,
                               num_workers=num_workers)

    straight = loader()
    straight.sampler.set_epoch(1)
    order = list(straight)

    killed = loader()
    killed.sampler.set_epoch(1)
    batches = iter(killed)
    head = [next(batches) for _ in range(7)]  # workers have prefetched more than these
    state = killed.state_dict()
    assert state == {"epoch": 1, "batches": 7}

    resumed = loader()
    resumed.load_state_dict(state)
    batches = iter(resumed)  # as Lightning does on resume: the iterator exists before set_epoch
    resumed.sampler.set_epoch(1)
    assert head + list(batches) == order
    # the next epoch starts at its first batch; so does one resumed from the end of the previous epoch
    resumed.sampler.set_epoch(2)
    assert len(list(resumed)) == 20
    resumed.load_state_dict({"epoch": 2, "batches": 20})
    resumed.sampler.set_epoch(3)
    assert len(list(resumed)) == 20
