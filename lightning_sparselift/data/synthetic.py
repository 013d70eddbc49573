"""The synthetic Criteo-like generator: :class:`SyntheticSpec` (everything that determines a
split), Zipf-distributed ids, a planted signal (hashed per-id effects, dense weights drawn from
``model_seed``) whose true click probability gives the Bayes-optimal AUC, and the cache that
generates a spec once and memory-maps it afterwards (:func:`load_or_generate`)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_sparselift.data.batch import RecArrays
from lightning_sparselift.data.criteo import FEATURE_NAMES, NUM_DENSE

_FORMAT_VERSION = 3  # 3: the planted dense weights come from model_seed (shared by the splits)


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


def bayes_optimal_auc(probability: np.ndarray, labels: np.ndarray) -> float:
    """ROC-AUC of a generator's true click probability: no model can beat it."""
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(torch.from_numpy(np.array(probability)), torch.from_numpy(np.array(labels)).long()))
