"""Synthetic data for sequence-aware ranking: per sample a variable-length history of item ids
(a user's past interactions), one target item to score, one-hot categorical features and dense
features. The planted signal rewards a target item from the same category as many of the
history's items, which a model can only pick up by relating the target to the history (target
attention); the rest is the Criteo-like signal of :mod:`lightning_sparselift.data.synthetic`.

The arrays have the layout of :class:`~lightning_sparselift.data.batch.RecArrays` (features: the
categorical ones, then the history, then the target item), so batches, samplers, the strategy's
input checks and the benchmark read them like any other split.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from lightning_sparselift.data.batch import RecArrays
from lightning_sparselift.data.criteo import NUM_DENSE
from lightning_sparselift.data.modules import RecDataModule
from lightning_sparselift.data.synthetic import dense_features, id_effect, load_or_generate, zipf_ids

_FORMAT_VERSION = 1
HISTORY_FEATURE = "history"
TARGET_FEATURE = "item"
DEFAULT_CATEGORICAL_ROWS = (1000, 5000, 20000, 100000, 300, 50, 10000, 2000)


@dataclass(frozen=True)
class SequenceSpec:
    """Everything that determines one generated split (its hash names the cache folder).

    Items belong to ``categories`` categories (item ``i`` to ``i % categories``); each sample has
    a taste category, ``in_taste`` of its history items come from it, the rest from any category,
    and the target item is from the taste category half of the time. History lengths are
    geometric with mean ``mean_history`` (empty histories included), capped at ``max_history``.
    """

    num_samples: int
    categorical_rows: tuple[int, ...]
    num_items: int
    categories: int = 50
    mean_history: float = 20.0
    max_history: int = 100
    in_taste: float = 0.8
    zipf_exponent: float = 1.05
    signal_strength: float = 1.0
    base_rate_logit: float = -1.2
    seed: int = 0
    model_seed: int = 0
    num_dense: int = NUM_DENSE

    def __post_init__(self) -> None:
        if not self.categorical_rows or any(r < 1 for r in self.categorical_rows):
            raise ValueError(f"categorical_rows needs at least one table of at least one row, got "
                             f"{list(self.categorical_rows)}")
        if self.categories < 1 or self.num_items < self.categories:
            raise ValueError(f"num_items ({self.num_items}) must be at least categories ({self.categories}) >= 1")
        if not 0 <= self.mean_history <= self.max_history:
            raise ValueError(f"mean_history must be in [0, max_history={self.max_history}], got {self.mean_history}")
        if not 0.0 <= self.in_taste <= 1.0:
            raise ValueError(f"in_taste must be in [0, 1], got {self.in_taste}")
        if self.zipf_exponent <= 0:
            raise ValueError(f"zipf_exponent must be > 0, got {self.zipf_exponent}")

    @property
    def feature_names(self) -> list[str]:
        return [f"cat_{i}" for i in range(len(self.categorical_rows))] + [HISTORY_FEATURE, TARGET_FEATURE]

    def digest(self) -> str:
        blob = json.dumps({"v": _FORMAT_VERSION, "kind": "sequence", **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def generate(self) -> dict[str, np.ndarray]:
        return generate_sequences(self)


def _items(rng: np.random.Generator, category: np.ndarray, spec: SequenceSpec, feature: int) -> np.ndarray:
    """An item of each given category, Zipf-popular within it."""
    per_category = spec.num_items // spec.categories
    return category + spec.categories * zipf_ids(rng, category.shape[0], per_category, spec.zipf_exponent, feature)


def generate_sequences(spec: SequenceSpec) -> dict[str, np.ndarray]:
    """One split: ``dense``, ``labels``, ``lengths`` [features, samples], ``values`` (ids
    feature-major) and the true click ``probability``. The logit is ``base + 1.5 s (0.6 z_ctx +
    0.8 z_match)``: ``z_ctx`` the standardized Criteo-like effect of the dense and categorical
    features, ``z_match`` the standardized share of history items in the target's category."""
    rng = np.random.default_rng(spec.seed)
    n, num_categorical = spec.num_samples, len(spec.categorical_rows)
    dense, z = dense_features(rng, n, spec.num_dense, spec.model_seed)
    lengths = np.empty((num_categorical + 2, n), dtype=np.int32)
    values = []
    for f, rows in enumerate(spec.categorical_rows):
        lengths[f] = 1
        ids = zipf_ids(rng, n, rows, spec.zipf_exponent, f)
        values.append(ids)
        z += id_effect(f, ids)
    context = z / math.sqrt(spec.num_dense + num_categorical)

    taste = rng.integers(0, spec.categories, n)
    history_lengths = np.minimum(rng.geometric(1.0 / (spec.mean_history + 1.0), n) - 1, spec.max_history)
    owner = np.repeat(np.arange(n), history_lengths)
    in_taste = rng.random(owner.shape[0]) < spec.in_taste
    history_category = np.where(in_taste, taste[owner], rng.integers(0, spec.categories, owner.shape[0]))
    history = _items(rng, history_category, spec, num_categorical)
    target_category = np.where(rng.random(n) < 0.5, taste, rng.integers(0, spec.categories, n))
    target = _items(rng, target_category, spec, num_categorical + 1)
    same = (history_category == target_category[owner]).astype(np.float64)
    match = np.bincount(owner, weights=same, minlength=n) / np.maximum(history_lengths, 1)
    match = (match - match.mean()) / (match.std() + 1e-6)

    logit = spec.base_rate_logit + spec.signal_strength * 1.5 * (0.6 * context + 0.8 * match)
    probability = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < probability).astype(np.float32)
    lengths[num_categorical] = history_lengths
    lengths[num_categorical + 1] = 1
    return {"dense": dense, "labels": labels, "lengths": lengths,
            "values": np.concatenate(values + [history, target]).astype(np.int64),
            "probability": probability.astype(np.float32)}


class SequenceDataModule(RecDataModule):
    """Synthetic sequence-ranking data (see :class:`SequenceSpec`): features ``cat_0..``
    (one id each), ``history`` (variable-length item ids) and ``item`` (the target item).

    Args:
        batch_size: samples per rank per step.
        num_train / num_val / num_test: split sizes.
        categorical_rows: rows of each categorical feature's table.
        num_items: rows of the item table (read by ``history`` and ``item``).
        categories / mean_history / max_history / in_taste: see :class:`SequenceSpec`.
        zipf_exponent: skew of the id distributions.
        signal_strength: scale of the planted signal (0 gives labels independent of features).
        seed: determines the whole dataset.
        cache_dir: where generated data is stored (default ``$SPARSELIFT_CACHE`` or
            ``~/.cache/lightning_sparselift``).
    """

    def __init__(
        self,
        batch_size: int = 512,
        num_train: int = 131_072,
        num_val: int = 32_768,
        num_test: int = 32_768,
        categorical_rows: Optional[list[int]] = None,
        num_items: int = 100_000,
        categories: int = 50,
        mean_history: float = 20.0,
        max_history: int = 100,
        in_taste: float = 0.8,
        zipf_exponent: float = 1.05,
        signal_strength: float = 1.0,
        seed: int = 0,
        cache_dir: Optional[str] = None,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        rows = tuple(int(r) for r in (categorical_rows or DEFAULT_CATEGORICAL_ROWS))
        self._specs = {split: SequenceSpec(
            num_samples=int(size), categorical_rows=rows, num_items=int(num_items), categories=int(categories),
            mean_history=float(mean_history), max_history=int(max_history), in_taste=float(in_taste),
            zipf_exponent=float(zipf_exponent), signal_strength=float(signal_strength),
            # one planted model for every split; the samples differ through a per-split seed
            seed=seed * 1000 + offset, model_seed=seed)
            for offset, (split, size) in enumerate((("train", num_train), ("val", num_val), ("test", num_test)))}
        spec = self._specs["train"]
        self.feature_names = spec.feature_names
        self.table_sizes = list(rows) + [spec.num_items, spec.num_items]
        self.num_dense = spec.num_dense

    def prepare_data(self) -> None:
        for spec in self._specs.values():
            load_or_generate(spec, self.cache_dir)

    def split(self, name: str) -> RecArrays:
        """The column store of split ``train`` / ``val`` / ``test`` (generated on first use)."""
        if name not in self._splits:
            self._splits[name], self._probability[name] = load_or_generate(self._specs[name], self.cache_dir)
        return self._splits[name]
