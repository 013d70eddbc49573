"""The data module: synthetic generator, Criteo npy reader, samplers."""

import numpy as np
import pytest
import torch

from lightning_sparselift.data import CriteoDataModule, EvenDistributedSampler
from lightning_sparselift.data.criteo import (
    CRITEO_KAGGLE_CARDINALITIES, DLRMV2_POOLING_FACTORS, read_criteo_npy, table_sizes,
)
from lightning_sparselift.data.loading import BatchedRecDataset
from lightning_sparselift.data.synthetic import SyntheticSpec, generate_synthetic


def test_table_sizes_cap():
    assert table_sizes(CRITEO_KAGGLE_CARDINALITIES, 100_000)[:4] == [1460, 583, 100_000, 100_000]
    assert table_sizes(CRITEO_KAGGLE_CARDINALITIES, None)[2] == 10131227


def test_one_hot_batches_are_valid_kjts(data_cache):
    dm = CriteoDataModule(batch_size=100, num_train=1000, num_val=250, num_test=250, cache_dir=str(data_cache))
    dm.setup("fit")
    batch = dm.train_dataloader().dataset[3]
    kjt = batch.sparse
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    assert batch.dense.shape == (100, 13) and batch.labels.shape == (100,)
    assert torch.all(kjt.lengths() == 1)
    for key, values in zip(kjt.keys(), kjt.values().split(kjt.length_per_key())):
        rows = dm.table_sizes[int(key.split("_")[1])]
        assert int(values.min()) >= 0 and int(values.max()) < rows


def test_generation_is_deterministic_and_cached(tmp_path):
    spec = SyntheticSpec(num_samples=500, num_embeddings_per_feature=(50, 1000), pooling_factors=(1, 3),
                         length_distribution="poisson", feature_names=("a", "b"), seed=5)
    a, b = generate_synthetic(spec), generate_synthetic(spec)
    for key in a:
        assert np.array_equal(a[key], b[key])
    other = generate_synthetic(SyntheticSpec(**{**spec.__dict__, "seed": 6}))
    assert not np.array_equal(a["values"], other["values"])
    assert (a["lengths"][1] == 0).any(), "poisson lengths should give empty bags"


def _planted_dense_weights(split: dict) -> np.ndarray:
    """The dense weights behind a split's labels, solved from its true probabilities (no ids)."""
    logit = np.log(split["probability"] / (1 - split["probability"])).astype(np.float64)
    dense = split["dense"].astype(np.float64)
    standardized = (dense - dense.mean(axis=0)) / (dense.std(axis=0) + 1e-6)
    design = np.hstack([standardized, np.ones((len(logit), 1))])
    return np.linalg.lstsq(design, logit, rcond=None)[0][:-1]


def test_every_split_of_a_datamodule_has_the_same_planted_model(data_cache):
    dm = CriteoDataModule(batch_size=64, num_train=512, num_val=512, num_test=64, cache_dir=str(data_cache), seed=3)
    specs = {split: SyntheticSpec(**{**dm._spec(split).__dict__, "pooling_factors": (0.0,) * 26}) for split in
             ("train", "val")}  # no ids: the labels follow the dense part alone
    train, val = (generate_synthetic(spec) for spec in specs.values())
    assert not np.array_equal(train["dense"], val["dense"])
    np.testing.assert_allclose(_planted_dense_weights(train), _planted_dense_weights(val), rtol=1e-3, atol=1e-3)


def test_multi_hot_pooling_factors(data_cache):
    dm = CriteoDataModule(batch_size=64, num_train=256, num_val=64, num_test=64, multi_hot=True,
                          cache_dir=str(data_cache))
    dm.setup("fit")
    batch = dm.train_dataloader().dataset[0]
    per_key = batch.sparse.length_per_key()
    assert per_key == [64 * p for p in DLRMV2_POOLING_FACTORS]


def test_zipf_skew(tmp_path):
    spec = SyntheticSpec(num_samples=20000, num_embeddings_per_feature=(10000,), pooling_factors=(1,),
                         feature_names=("a",), zipf_exponent=1.2)
    ids = generate_synthetic(spec)["values"]
    counts = np.sort(np.bincount(ids, minlength=10000))[::-1]
    assert counts[:10].sum() > 0.2 * ids.size  # a heavy head
    assert (counts > 0).sum() > 500  # and a long tail


def test_planted_signal_is_learnable(data_cache):
    dm = CriteoDataModule(batch_size=256, num_train=1024, num_val=20000, num_test=1024, cache_dir=str(data_cache))
    bayes = dm.bayes_optimal_auc("val")
    assert 0.7 < bayes < 0.95
    no_signal = CriteoDataModule(batch_size=256, num_train=1024, num_val=20000, num_test=1024, signal_strength=0.0,
                                 cache_dir=str(data_cache))
    assert no_signal.bayes_optimal_auc("val") == pytest.approx(0.5, abs=0.02)


def test_even_sampler_pads_without_duplicates(data_cache):
    dm = CriteoDataModule(batch_size=32, num_train=64, num_val=300, num_test=64, cache_dir=str(data_cache))
    dataset = BatchedRecDataset(dm.split("val"), 32)
    assert len(dataset) == 10
    seen = []
    for rank in range(3):
        indices = list(EvenDistributedSampler(dataset, num_replicas=3, rank=rank))
        assert len(indices) == 4
        seen += [i for i in indices if i >= 0]
    assert sorted(seen) == list(range(10))
    padding = dataset[-1]
    assert padding.weights.sum() == 0 and len(padding) == 32
    assert len(dataset[9]) == 300 - 9 * 32


def test_criteo_npy_reader(tmp_path):
    # the layout torchrec.datasets.criteo.BinaryCriteoUtils writes: <name>_{dense,sparse,labels}.npy
    rng = np.random.default_rng(0)
    n = 50
    dense = np.log1p(rng.integers(0, 100, size=(n, 13))).astype(np.float32)
    sparse = rng.integers(0, 2**31 - 1, size=(n, 26)).astype(np.int32)
    labels = rng.integers(0, 2, size=(n, 1)).astype(np.int32)
    for name, array in (("dense", dense), ("sparse", sparse), ("labels", labels)):
        np.save(tmp_path / f"train_{name}.npy", array)
    sizes = table_sizes(CRITEO_KAGGLE_CARDINALITIES, 1000)
    arrays = read_criteo_npy(tmp_path / "train", sizes)
    batch = arrays.batch(10, 20)
    assert torch.equal(batch.dense, torch.from_numpy(dense[10:20]))
    assert torch.equal(batch.labels, torch.from_numpy(labels[10:20, 0].astype(np.float32)))
    by_key = batch.sparse.to_dict()
    for f in range(26):
        expected = torch.from_numpy(sparse[10:20, f].astype(np.int64) % sizes[f])
        assert torch.equal(by_key[f"cat_{f}"].values(), expected)
    dm = CriteoDataModule(batch_size=16, criteo_npy_dir=str(tmp_path), max_rows=1000)
    assert len(dm.split("train")) == n
    with pytest.raises(FileNotFoundError, match="Criteo npy files not found"):
        dm.split("val")


def test_bad_data_arguments(data_cache):
    with pytest.raises(ValueError, match="pooling factors"):
        CriteoDataModule(pooling_factors=[1, 2])
    with pytest.raises(ValueError, match="length_distribution"):
        SyntheticSpec(num_samples=1, num_embeddings_per_feature=(1,), pooling_factors=(1,), feature_names=("a",),
                      length_distribution="uniform")
    with pytest.raises(ValueError, match="no batch"):
        BatchedRecDataset(CriteoDataModule(num_train=10, cache_dir=str(data_cache)).split("train"), 64,
                          drop_last=True)
