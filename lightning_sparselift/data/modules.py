"""The data modules of Criteo-shaped data: :class:`RecDataModule` (what every data module of this
package shares: splits as column stores, the generated-data cache, loaders of whole batches) and
:class:`CriteoDataModule` (synthetic, TorchRec's npy files or raw Criteo TSV files). The
sequence data module sits with its generator in :mod:`lightning_sparselift.data.sequence`."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader

from lightning_sparselift.data.batch import ConcatRecArrays, OneHotRecArrays, RecArrays
from lightning_sparselift.data.criteo import (
    CRITEO_KAGGLE_CARDINALITIES, DLRMV2_POOLING_FACTORS, FEATURE_NAMES, NUM_DENSE, convert_tsv_files,
    read_criteo_npy, split_rows, table_sizes,
)
from lightning_sparselift.data.loading import (
    BatchedRecDataset, EpochShuffledSampler, EvenDistributedSampler, ResumableLoader, _identity,
)
from lightning_sparselift.data.synthetic import SyntheticSpec, bayes_optimal_auc, load_or_generate


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
            :mod:`lightning_sparselift.data.criteo`.
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

