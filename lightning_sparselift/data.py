"""Criteo-like recommendation data: a synthetic generator with a planted signal, a reader for the
npy files that ``torchrec.datasets.criteo`` writes (and, through :mod:`lightning_sparselift.criteo`,
for raw Criteo TSV files converted by it), and a LightningDataModule over them.

Batches are assembled by slicing memory-mapped arrays (one dataset item is one whole batch), so
loading is a handful of ``np`` slices per step and never part of the measured model execution.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from lightning_sparselift.criteo import convert_tsv_files, split_rows

# Criteo Kaggle (Display Advertising Challenge) cardinalities of the 26 categorical features.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# Per-feature pooling factors of MLPerf DLRMv2 (multi-hot Criteo 1TB).
DLRMV2_POOLING_FACTORS: tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)
NUM_DENSE = 13
FEATURE_NAMES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(len(CRITEO_KAGGLE_CARDINALITIES)))

_FORMAT_VERSION = 3  # 3: the planted dense weights come from model_seed (shared by the splits)


def table_sizes(cardinalities: Sequence[int], max_rows: Optional[int]) -> list[int]:
    """Rows per table: the raw cardinality, capped at ``max_rows`` (ids are taken modulo it)."""
    return [int(c) if max_rows is None else int(min(c, max_rows)) for c in cardinalities]


@dataclass
class RecBatch(Pipelineable):
    """One batch: dense features, sparse features as a KJT, labels and per-sample weights.
    It is ``Pipelineable``, so TorchRec's train pipelines can move and prefetch it.

    ``weights`` is 1 for real samples and 0 for the padding that keeps every rank's number of
    evaluation batches equal (so metrics never count a sample twice).
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    weights: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "RecBatch":
        return RecBatch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            weights=self.weights.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)
        self.weights.record_stream(stream)

    def pin_memory(self) -> "RecBatch":
        return RecBatch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory(),
                        self.weights.pin_memory())

    def __len__(self) -> int:
        return int(self.labels.numel())


class RecArrays:
    """Column store of one split: dense [N, 13], labels [N], per feature (lengths [N], values).

    ``values`` holds all features' ids feature-major in one array; feature ``f``'s ids for
    samples ``[s, e)`` are the contiguous slice ``values[starts[f] + offsets[f, s] :
    starts[f] + offsets[f, e]]``, so a batch of consecutive samples costs one slice per feature.
    """

    def __init__(self, dense: np.ndarray, labels: np.ndarray, lengths: np.ndarray,
                 values: np.ndarray, feature_names: Sequence[str], id_modulus: Optional[Sequence[int]] = None):
        if lengths.shape != (len(feature_names), dense.shape[0]):
            raise ValueError(f"lengths must have shape (features, samples) = {(len(feature_names), dense.shape[0])}, "
                             f"got {lengths.shape}")
        self.dense = dense
        self.labels = labels
        self.lengths = lengths
        self.values = values
        self.feature_names = list(feature_names)
        self.id_modulus = None if id_modulus is None else torch.tensor(list(id_modulus), dtype=torch.int64)
        offsets = np.zeros((lengths.shape[0], lengths.shape[1] + 1), dtype=np.int64)
        np.cumsum(lengths, axis=1, out=offsets[:, 1:])
        self.offsets = offsets
        self.starts = np.concatenate([[0], np.cumsum(offsets[:, -1])[:-1]])
        if int(offsets[:, -1].sum()) != values.shape[0]:
            raise ValueError(f"lengths sum to {int(offsets[:, -1].sum())} ids but values holds {values.shape[0]}")

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def batch(self, start: int, end: int) -> RecBatch:
        pieces = [self.values[b + o[start]: b + o[end]] for b, o in zip(self.starts, self.offsets)]
        values = torch.from_numpy(np.concatenate(pieces).astype(np.int64, copy=False))
        lengths = torch.from_numpy(np.ascontiguousarray(self.lengths[:, start:end]).astype(np.int32).reshape(-1))
        if self.id_modulus is not None:
            values = values % self.id_modulus.repeat_interleave(
                torch.tensor([p.shape[0] for p in pieces], dtype=torch.int64))
        # np.array copies: the columns may be read-only memory maps, which a batch must not alias.
        return RecBatch(
            dense=torch.from_numpy(np.array(self.dense[start:end], dtype=np.float32)),
            sparse=KeyedJaggedTensor.from_lengths_sync(keys=self.feature_names, values=values, lengths=lengths),
            labels=torch.from_numpy(np.array(self.labels[start:end], dtype=np.float32)),
            weights=torch.ones(end - start, dtype=torch.float32),
        )


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


# ----------------------------------------------------------------------------------------------
# Synthetic generator
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that determines the generated data (its hash names the cache folder)."""

    num_samples: int
    num_embeddings_per_feature: tuple[int, ...]
    pooling_factors: tuple[float, ...]
    length_distribution: str = "fixed"  # "fixed": every bag has exactly its pooling factor; "poisson"
    zipf_exponent: float = 1.05
    signal_strength: float = 1.0
    base_rate_logit: float = -1.2
    seed: int = 0  # the samples
    model_seed: int = 0  # the planted model's dense weights (the id effects are fixed hashes)
    num_dense: int = NUM_DENSE
    feature_names: tuple[str, ...] = field(default=FEATURE_NAMES)

    def __post_init__(self) -> None:
        n = len(self.num_embeddings_per_feature)
        if len(self.pooling_factors) != n or len(self.feature_names) != n:
            raise ValueError(f"num_embeddings_per_feature ({n}), pooling_factors ({len(self.pooling_factors)}) and "
                             f"feature_names ({len(self.feature_names)}) must have the same length")
        if self.length_distribution not in ("fixed", "poisson"):
            raise ValueError(f"length_distribution must be 'fixed' or 'poisson', got {self.length_distribution!r}")
        if self.zipf_exponent <= 0:
            raise ValueError(f"zipf_exponent must be > 0, got {self.zipf_exponent}")
        if any(r < 1 for r in self.num_embeddings_per_feature):
            raise ValueError("every table needs at least one row")

    def digest(self) -> str:
        blob = json.dumps({"v": _FORMAT_VERSION, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def generate(self) -> dict[str, np.ndarray]:
        return generate_synthetic(self)


def id_effect(feature: int, ids: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random effect per (feature, id) with mean 0 and variance 1 (a hash, so it
    needs no table as large as the feature's cardinality)."""
    h = (ids.astype(np.uint64) * np.uint64(2654435761) + np.uint64(feature * 40503 + 1)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(2246822519)) & np.uint64(0xFFFFFFFF)
    return (h.astype(np.float64) / 2.0**32 - 0.5) * math.sqrt(12.0)


def zipf_ids(rng: np.random.Generator, count: int, rows: int, exponent: float, feature: int) -> np.ndarray:
    """Ids in [0, rows) with P(rank k) ~ 1/k^exponent, hot ids scattered over the table."""
    if rows == 1:
        return np.zeros(count, dtype=np.int64)
    k = np.arange(1, rows + 1, dtype=np.float64)
    cdf = np.cumsum(k ** -exponent)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(count)), rows - 1).astype(np.int64)
    # An affine map with a multiplier coprime to rows is a bijection: hot ranks land on spread-out rows.
    mult = 1 + 2 * (7919 + feature)
    while math.gcd(mult, rows) != 1:
        mult += 2
    return (ranks * mult + 17 * feature) % rows


def dense_features(rng: np.random.Generator, n: int, num_dense: int, model_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Lognormal dense features after the usual Criteo preprocessing (``log(1 + x)``), and the
    planted linear effect of their standardized values (weights drawn from ``model_seed``)."""
    dense = np.log1p(rng.lognormal(mean=0.0, sigma=1.0, size=(n, num_dense)).astype(np.float32))
    w = np.random.default_rng(model_seed).standard_normal(num_dense)
    standardized = (dense - dense.mean(axis=0)) / (dense.std(axis=0) + 1e-6)
    return dense, standardized @ w


def generate_synthetic(spec: SyntheticSpec) -> dict[str, np.ndarray]:
    """Generate one split. Labels are Bernoulli(sigmoid(z)) with
    ``z = base + s * (w . dense + sum_f mean(effect_f(ids in bag f))) / sqrt(13 + F)``; the true
    probability is returned as ``probability`` so the Bayes-optimal AUC can be computed."""
    rng = np.random.default_rng(spec.seed)
    n, num_features = spec.num_samples, len(spec.num_embeddings_per_feature)
    dense, z = dense_features(rng, n, spec.num_dense, spec.model_seed)
    lengths = np.empty((num_features, n), dtype=np.int32)
    values = []
    for f, (rows, pf) in enumerate(zip(spec.num_embeddings_per_feature, spec.pooling_factors)):
        if spec.length_distribution == "fixed":
            lengths[f] = max(int(round(pf)), 0)
        else:
            lengths[f] = rng.poisson(pf, size=n)
        ids = zipf_ids(rng, int(lengths[f].sum()), rows, spec.zipf_exponent, f)
        values.append(ids)
        bag_sum = np.bincount(np.repeat(np.arange(n), lengths[f]), weights=id_effect(f, ids), minlength=n)
        z += bag_sum / np.maximum(lengths[f], 1)
    logit = spec.base_rate_logit + spec.signal_strength * z / math.sqrt(spec.num_dense + num_features) * 3.0
    probability = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < probability).astype(np.float32)
    return {"dense": dense, "labels": labels, "lengths": lengths,
            "values": np.concatenate(values).astype(np.int64), "probability": probability.astype(np.float32)}


def load_or_generate(spec: Any, cache_dir: Path) -> tuple[RecArrays, np.ndarray]:
    """Generate ``spec`` (a frozen dataclass with ``digest()`` and ``generate()``, e.g.
    :class:`SyntheticSpec`) once into ``cache_dir/<digest>/`` and memory-map it afterwards."""
    folder = Path(cache_dir) / spec.digest()
    done = folder / "spec.json"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        arrays = spec.generate()
        for name, array in arrays.items():
            tmp = folder / f".{name}.{os.getpid()}.npy"
            np.save(tmp, array)
            os.replace(tmp, folder / f"{name}.npy")
        tmp = folder / f".spec.{os.getpid()}.json"
        tmp.write_text(json.dumps(asdict(spec), indent=1))
        os.replace(tmp, done)  # written last: its presence means the folder is complete
    load = {name: np.load(folder / f"{name}.npy", mmap_mode="r")
            for name in ("dense", "labels", "lengths", "values", "probability")}
    arrays = RecArrays(load["dense"], load["labels"], load["lengths"], load["values"], spec.feature_names)
    return arrays, load["probability"]


class OneHotRecArrays:
    """One id per feature, row-major as ``torchrec.datasets.criteo`` writes it: dense [N, 13],
    ids [N, F], labels [N] (or [N, 1]). A batch transposes only its own rows, so memory-mapped
    files are never loaded whole. With ``id_modulus`` the ids are taken modulo the table sizes
    the way TorchRec's ``InMemoryBinaryCriteoIterDataPipe(hashes=...)`` does (``sparse % hashes``).
    """

    def __init__(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray, feature_names: Sequence[str],
                 id_modulus: Optional[Sequence[int]] = None):
        labels = labels.reshape(-1)
        n = dense.shape[0]
        if sparse.ndim != 2 or sparse.shape != (n, len(feature_names)) or labels.shape[0] != n:
            raise ValueError(f"inconsistent Criteo npy shapes: dense {dense.shape}, sparse {sparse.shape}, "
                             f"labels {labels.shape}; expected sparse (N, {len(feature_names)})")
        if id_modulus is not None and len(id_modulus) != len(feature_names):
            raise ValueError(f"{len(id_modulus)} table sizes for {len(feature_names)} features")
        self.dense, self.sparse, self.labels = dense, sparse, labels
        self.feature_names = list(feature_names)
        self.id_modulus = None if id_modulus is None else np.asarray(id_modulus, dtype=np.int64).reshape(1, -1)

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def batch(self, start: int, end: int) -> RecBatch:
        ids = np.array(self.sparse[start:end], dtype=np.int64)  # a copy, never a view of the file
        if self.id_modulus is not None:
            ids %= self.id_modulus
        values = torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1))
        lengths = torch.ones(values.numel(), dtype=torch.int32)
        return RecBatch(
            dense=torch.from_numpy(np.array(self.dense[start:end], dtype=np.float32)),
            sparse=KeyedJaggedTensor.from_lengths_sync(keys=self.feature_names, values=values, lengths=lengths),
            labels=torch.from_numpy(np.array(self.labels[start:end], dtype=np.float32)),
            weights=torch.ones(end - start, dtype=torch.float32),
        )


class ConcatRecArrays:
    """Several column stores read as one (e.g. consecutive day files): a batch that crosses a
    boundary is the concatenation of the parts' batches, as TorchRec's in-memory Criteo reader
    fills a batch across files."""

    def __init__(self, parts: Sequence[Any]):
        self.parts = [p for p in parts if len(p) > 0]
        if not self.parts:
            raise ValueError("no rows in any part")
        self.feature_names = list(self.parts[0].feature_names)
        self.bounds = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def batch(self, start: int, end: int) -> RecBatch:
        pieces = []
        for part, lo, hi in zip(self.parts, self.bounds[:-1], self.bounds[1:]):
            s, e = max(start, int(lo)), min(end, int(hi))
            if s < e:
                pieces.append(part.batch(s - int(lo), e - int(lo)))
        return pieces[0] if len(pieces) == 1 else _cat_batches(pieces)


def _cat_batches(batches: Sequence[RecBatch]) -> RecBatch:
    keys = batches[0].sparse.keys()
    values, lengths = [], []
    for key in keys:
        for b in batches:
            jt = b.sparse[key]
            values.append(jt.values())
            lengths.append(jt.lengths())
    return RecBatch(
        dense=torch.cat([b.dense for b in batches]),
        sparse=KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)),
        labels=torch.cat([b.labels for b in batches]),
        weights=torch.cat([b.weights for b in batches]),
    )


def read_criteo_npy(prefix: str | Path, num_embeddings_per_feature: Sequence[int],
                    feature_names: Sequence[str] = FEATURE_NAMES,
                    rows: Optional[tuple[int, int]] = None) -> OneHotRecArrays:
    """Read the ``<prefix>_dense.npy`` / ``_sparse.npy`` / ``_labels.npy`` triple that
    ``torchrec.datasets.criteo.BinaryCriteoUtils`` writes (dense already log-transformed,
    one id per feature), memory-mapped. Ids are taken modulo the table sizes, as TorchRec's
    reader does. ``rows=(start, end)`` reads only those rows (TorchRec's ``load_npy_range``)."""
    prefix = str(prefix)
    paths = {k: Path(f"{prefix}_{k}.npy") for k in ("dense", "sparse", "labels")}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(f"Criteo npy files not found: {missing}")
    if len(num_embeddings_per_feature) != len(feature_names):
        raise ValueError(f"{len(num_embeddings_per_feature)} table sizes for {len(feature_names)} features")
    if rows is None:
        arrays = {k: np.load(p, mmap_mode="r") for k, p in paths.items()}
    else:
        from torchrec.datasets.criteo import BinaryCriteoUtils

        start, end = rows
        arrays = {k: BinaryCriteoUtils.load_npy_range(str(p), start, end - start, mmap_mode=True)
                  for k, p in paths.items()}
    return OneHotRecArrays(arrays["dense"], arrays["sparse"], arrays["labels"], feature_names,
                           id_modulus=num_embeddings_per_feature)


class RecDataModule(pl.LightningDataModule):
    """What the data modules share: splits as column stores (``split(name)``, the subclass's),
    generated data under ``cache_dir``, loaders of whole batches and the Bayes-optimal AUC of
    synthetic data. Under a trainer the training loader is resumable and shuffled per epoch (the
    same permutation on every rank, each rank its share); evaluation loaders give every rank the
    same number of batches (padding weighted 0). Subclasses set ``hparams`` ``batch_size``,
    ``num_workers`` and ``cache_dir``, and fill ``_splits`` (loaded splits) and ``_probability``
    (generated splits' true click probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        self._splits: dict[str, Any] = {}
        self._probability: dict[str, np.ndarray] = {}

    def split(self, name: str) -> Any:
        raise NotImplementedError

    @property
    def cache_dir(self) -> Path:
        """Where generated data is stored: ``cache_dir``, else ``$SPARSELIFT_CACHE``, else
        ``~/.cache/lightning_sparselift``."""
        configured = self.hparams.cache_dir or os.environ.get("SPARSELIFT_CACHE")
        return Path(configured) if configured else Path.home() / ".cache" / "lightning_sparselift"

    def bayes_optimal_auc(self, split: str = "val") -> float:
        """ROC-AUC of the generator's true click probability on ``split``: no model can beat it."""
        labels = self.split(split).labels  # loads the split and its probabilities
        return bayes_optimal_auc(self._probability[split], labels)

    def setup(self, stage: str) -> None:
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}[stage]
        for name in wanted:
            self.split(name)

    def _loader(self, split: str, train: bool) -> DataLoader:
        dataset = BatchedRecDataset(self.split(split), self.hparams.batch_size, drop_last=train)
        args = dict(batch_size=None, num_workers=self.hparams.num_workers, collate_fn=_identity)
        if self.trainer is None:
            return DataLoader(dataset, shuffle=train, **args)
        world, rank = self.trainer.world_size, self.trainer.global_rank
        if train:
            sampler = EpochShuffledSampler(dataset, world, rank, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
            return ResumableLoader(dataset, sampler=sampler, **args)
        return DataLoader(dataset, sampler=EvenDistributedSampler(dataset, num_replicas=world, rank=rank), **args)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test", train=False)


def bayes_optimal_auc(probability: np.ndarray, labels: np.ndarray) -> float:
    """ROC-AUC of a generator's true click probability: no model can beat it."""
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(torch.from_numpy(np.array(probability)), torch.from_numpy(np.array(labels)).long()))


class CriteoDataModule(RecDataModule):
    """Criteo-shaped data for DLRM training: synthetic (default), TorchRec's npy format or raw
    Criteo TSV files.

    Args:
        batch_size: samples per rank per step.
        num_train / num_val / num_test: synthetic split sizes (ignored for npy data).
        max_rows: cap on table rows (ids are folded into ``[0, max_rows)``); ``None`` keeps the
            Criteo Kaggle cardinalities.
        rows_per_feature: table sizes to use instead of the capped Criteo ones.
        multi_hot: use DLRMv2 pooling factors (or ``pooling_factors``) instead of one id per feature.
        pooling_factors: per-feature mean bag sizes (implies multi-hot).
        length_distribution: ``"fixed"`` bags of exactly the pooling factor, or ``"poisson"``
            (gives empty bags for small factors).
        zipf_exponent: skew of the id distribution.
        signal_strength: scale of the planted signal (0 gives labels independent of features).
        seed: determines the whole dataset.
        criteo_npy_dir: a folder with ``day_*`` / ``train`` / ``val`` / ``test`` npy triples written
            by ``torchrec.datasets.criteo``; when set, synthetic generation is skipped.
        criteo_tsv: raw Criteo TSV files (Kaggle ``train.txt``, Terabyte ``day_N``), converted once
            by TorchRec's ``BinaryCriteoUtils.tsv_to_npys`` into ``<cache_dir>/criteo_tsv/`` (keyed by
            path, size and mtime) and read like ``criteo_npy_dir``. A list of files in day order:
            train on all but the last, validate on the first half of the last, test on its second
            half (TorchRec's Terabyte split); one file: its last 1/7 of rows held out and halved
            (val, test). Or ``{"train": [...], "val": [...], "test": [...]}``. See
            :mod:`lightning_sparselift.criteo`.
        cache_dir: where generated data is stored (default ``$SPARSELIFT_CACHE`` or
            ``~/.cache/lightning_sparselift``).
    """

    def __init__(
        self,
        batch_size: int = 1024,
        num_train: int = 262_144,
        num_val: int = 65_536,
        num_test: int = 65_536,
        max_rows: Optional[int] = 100_000,
        rows_per_feature: Optional[list[int]] = None,
        multi_hot: bool = False,
        pooling_factors: Optional[list[float]] = None,
        length_distribution: str = "fixed",
        zipf_exponent: float = 1.05,
        signal_strength: float = 1.0,
        seed: int = 0,
        criteo_npy_dir: Optional[str] = None,
        cache_dir: Optional[str] = None,
        num_workers: int = 0,
        criteo_tsv: Optional[Union[str, list[str], dict[str, Union[str, list[str]]]]] = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        if criteo_tsv is not None and criteo_npy_dir is not None:
            raise ValueError("set criteo_npy_dir or criteo_tsv, not both")
        self._tsv = None if criteo_tsv is None else _tsv_layout(criteo_tsv)
        if rows_per_feature is not None:
            sizes = [int(x) for x in rows_per_feature]
        else:
            sizes = table_sizes(CRITEO_KAGGLE_CARDINALITIES, max_rows)
        if pooling_factors is not None:
            pooling = [float(p) for p in pooling_factors]
        elif multi_hot:
            pooling = [float(p) for p in DLRMV2_POOLING_FACTORS]
        else:
            pooling = [1.0] * len(sizes)
        if len(pooling) != len(sizes):
            raise ValueError(f"{len(pooling)} pooling factors for {len(sizes)} tables")
        if self._tsv is not None and (len(sizes) != len(FEATURE_NAMES) or any(p != 1.0 for p in pooling)):
            raise ValueError(f"Criteo TSV files hold one id for each of {len(FEATURE_NAMES)} features: criteo_tsv "
                             f"needs {len(FEATURE_NAMES)} table sizes (got {len(sizes)}) and no multi-hot pooling")
        self.table_sizes = sizes
        self.pooling_factors = pooling
        self.feature_names = list(FEATURE_NAMES[: len(sizes)]) if len(sizes) <= len(FEATURE_NAMES) \
            else [f"cat_{i}" for i in range(len(sizes))]
        self.num_dense = NUM_DENSE

    def _spec(self, split: str) -> SyntheticSpec:
        size = {"train": self.hparams.num_train, "val": self.hparams.num_val, "test": self.hparams.num_test}[split]
        # The same planted model for every split (the id effects are fixed hashes, the dense
        # weights come from `seed`); the samples differ through a per-split seed offset.
        return SyntheticSpec(
            num_samples=int(size), num_embeddings_per_feature=tuple(self.table_sizes),
            pooling_factors=tuple(self.pooling_factors), length_distribution=self.hparams.length_distribution,
            zipf_exponent=self.hparams.zipf_exponent, signal_strength=self.hparams.signal_strength,
            seed=self.hparams.seed * 1000 + {"train": 0, "val": 1, "test": 2}[split], model_seed=self.hparams.seed,
            feature_names=tuple(self.feature_names),
        )

    @property
    def _real_data(self) -> bool:
        return self.hparams.criteo_npy_dir is not None or self._tsv is not None

    def prepare_data(self) -> None:
        if self._tsv is not None:
            files = self._tsv[1] if self._tsv[0] == "days" else [f for fs in self._tsv[1].values() for f in fs]
            convert_tsv_files(list(dict.fromkeys(files)), self.cache_dir)  # once; cached afterwards
        elif self.hparams.criteo_npy_dir is None:
            for split in ("train", "val", "test"):
                load_or_generate(self._spec(split), self.cache_dir)

    def _tsv_split(self, name: str) -> Any:
        """Split ``name`` of the TSV files: converted (or found in the cache), then memory-mapped."""
        mode, files = self._tsv
        if mode == "splits":
            if name not in files:
                raise ValueError(f"criteo_tsv names no files for split {name!r} (it has {sorted(files)})")
            converted = convert_tsv_files(files[name], self.cache_dir)
            parts = [(c, 0, c.rows) for c in converted]
        else:
            if len(files) == 1:
                (only,) = convert_tsv_files(files, self.cache_dir)
                train_end, val_end = split_rows(only.rows)
                bounds = {"train": (0, train_end), "val": (train_end, val_end), "test": (val_end, only.rows)}
                parts = [(only, *bounds[name])]
            elif name == "train":
                parts = [(c, 0, c.rows) for c in convert_tsv_files(files[:-1], self.cache_dir)]
            else:
                (last,) = convert_tsv_files(files[-1:], self.cache_dir)
                half = math.ceil(last.rows / 2)  # TorchRec: val is the first half of the last day (rounded up)
                parts = [(last, 0, half) if name == "val" else (last, half, last.rows)]
        arrays = [read_criteo_npy(c.prefix, self.table_sizes, self.feature_names, rows=(s, e))
                  for c, s, e in parts if e > s]
        if not arrays:
            raise ValueError(f"the {name} split of criteo_tsv has no rows "
                             f"({', '.join(f'{c.source}: {c.rows} rows' for c, _, _ in parts)})")
        return arrays[0] if len(arrays) == 1 else ConcatRecArrays(arrays)

    def split(self, name: str) -> RecArrays | OneHotRecArrays | ConcatRecArrays:
        """The column store of split ``train`` / ``val`` / ``test`` (loaded on first use)."""
        if name not in self._splits:
            if self._tsv is not None:
                self._splits[name] = self._tsv_split(name)
            elif self.hparams.criteo_npy_dir is not None:
                self._splits[name] = read_criteo_npy(Path(self.hparams.criteo_npy_dir) / name,
                                                     self.table_sizes, self.feature_names)
            else:
                arrays, probability = load_or_generate(self._spec(name), self.cache_dir)
                self._splits[name] = arrays
                self._probability[name] = probability
        return self._splits[name]

    def bayes_optimal_auc(self, split: str = "val") -> float:
        if self._real_data:
            raise ValueError("the Bayes-optimal AUC is only known for synthetic data")
        return super().bayes_optimal_auc(split)


def _identity(x):
    return x


def _tsv_layout(spec: Any) -> tuple[str, Any]:
    """``("days", [files])`` or ``("splits", {split: [files]})`` from the ``criteo_tsv`` option."""
    if isinstance(spec, (str, os.PathLike)):
        return "days", [str(spec)]
    if isinstance(spec, dict):
        unknown = set(spec) - {"train", "val", "test"}
        if unknown or not spec:
            raise ValueError(f"criteo_tsv splits must be among train/val/test, got {sorted(map(str, spec))}")
        out = {k: [str(v)] if isinstance(v, (str, os.PathLike)) else [str(f) for f in v] for k, v in spec.items()}
        empty = [k for k, v in out.items() if not v]
        if empty:
            raise ValueError(f"criteo_tsv split(s) {empty} list no files")
        return "splits", out
    files = [str(f) for f in spec]
    if not files:
        raise ValueError("criteo_tsv lists no files")
    return "days", files

