"""Loading a split: a dataset whose items are whole batches, the samplers that split it across
ranks (evaluation padded so every rank runs the same number of forwards, training shuffled per
epoch) and the training loader that resumes mid-epoch at the next batch."""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Optional

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_sparselift.data.batch import RecArrays, RecBatch


class BatchedRecDataset(Dataset):
    """A dataset whose item ``i`` is batch ``i`` (consecutive samples); the last may be short.

    Index ``-1`` yields a padding batch: a full-size batch with all weights 0, used by
    :class:`EvenDistributedSampler` so every rank runs the same number of forwards.
    """

    def __init__(self, arrays: RecArrays, batch_size: int, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.arrays = arrays
        self.batch_size = batch_size
        n = len(arrays)
        self.num_batches = n // batch_size if drop_last else math.ceil(n / batch_size)
        if self.num_batches == 0:
            raise ValueError(f"{n} samples make no batch of {batch_size} (drop_last={drop_last})")

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> RecBatch:
        if index == -1:
            padding = self.arrays.batch(0, min(self.batch_size, len(self.arrays)))
            padding.weights.zero_()
            return padding
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range [0, {self.num_batches})")
        start = index * self.batch_size
        return self.arrays.batch(start, min(start + self.batch_size, len(self.arrays)))


class EvenDistributedSampler(DistributedSampler):
    """Splits indices across ranks without duplicating any, then pads the shorter ranks with
    index ``-1`` so that all ranks yield the same count.

    Lightning's default ``DistributedSampler`` repeats samples to even out ranks (metrics count
    them twice) and its predict sampler gives ranks different counts (a sharded model's
    all-to-all then waits forever on the rank that stopped). Datasets used with this sampler map
    ``-1`` to a zero-weight padding item.
    """

    def __init__(self, dataset: Dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.num_samples = math.ceil(len(dataset) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        own = list(range(self.rank, len(self.dataset), self.num_replicas))
        return iter(own + [-1] * (self.num_samples - len(own)))

    def __len__(self) -> int:
        return self.num_samples


class EpochShuffledSampler(DistributedSampler):
    """Lightning's ``DistributedSampler`` for training, but its shuffle is drawn when the first
    index is requested rather than when the iterator is created.

    On resuming from an end-of-epoch checkpoint Lightning creates the dataloader iterator before
    it calls ``set_epoch``; an eager sampler then replays the previous epoch's order and the
    resumed run diverges from an uninterrupted one.

    ``start`` skips the first positions of the epoch's order: :class:`ResumableLoader` sets it to
    resume mid-epoch without loading the batches already trained on.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        yield from itertools.islice(super().__iter__(), self.start, None)


class ResumableLoader(DataLoader):
    """The training DataLoader, stateful for Lightning: its state is the sampler's epoch and the
    number of batches yielded in it. Lightning saves that in every checkpoint and restores it
    when resuming mid-epoch; the loader then continues with the next batch of the same shuffled
    order (an :class:`EpochShuffledSampler` that starts past the batches already trained on, so
    they are not loaded again). Batches are counted as they are yielded, which is sampler order
    also with worker processes, so the position is exact whatever the workers have prefetched.
    """

    def __init__(self, dataset: Dataset, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self._epoch = 0
        self._yielded = 0  # batches yielded in self._epoch
        self._resuming = False  # a loaded position, applied when the iteration of its epoch starts

    def __iter__(self) -> Iterator[Any]:
        if not isinstance(self.sampler, EpochShuffledSampler):
            # Lightning's overfit_batches swaps in a SequentialSampler: the same few batches each
            # epoch, read from the first one again on resume
            yield from super().__iter__()
            return
        # runs at the first batch, after Lightning's set_epoch (which comes after iter() on resume)
        epoch = self.sampler.epoch
        if not (self._resuming and epoch == self._epoch):
            self._yielded = 0  # a new epoch (a position saved at the end of the last one included)
        self._epoch, self._resuming = epoch, False
        self.sampler.start = self._yielded
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batches": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._yielded = int(state["epoch"]), int(state["batches"])
        self._resuming = True


def _identity(x: Any) -> Any:
    """The loaders' ``collate_fn``: a dataset item is already a whole batch."""
    return x
