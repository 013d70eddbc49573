"""Where a training loader resumes: the lookahead loader's state is its consumer's position (not
the batch it read ahead), and the resumable loader continues a killed epoch at the next batch, with
and without worker processes. Through a killed and resumed Trainer.fit: tests/ranks/test_resume.py."""

from __future__ import annotations

import pytest

from lightning_sparselift.data.loading import EpochShuffledSampler, ResumableLoader
from lightning_sparselift.lightning.lookahead import LookaheadLoader


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
