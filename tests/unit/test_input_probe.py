"""The probe of TorchRec's input kernels (process-free): which regions it times, on whose shape."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from graph_fixtures import ITEM, load
from lightning_sparselift.session.input_probe import _features, measure_reference_inputs
from lightning_sparselift.ir.schedule import INPUT_REGIONS

GRAPHS = Path(__file__).parents[1] / "fixtures" / "graphs"


def test_it_times_every_input_region_on_every_ranks_shape():
    graph = load("two_modules_2ranks")
    timed = measure_reference_inputs(graph, 0, torch.device("cpu"))
    # the user module's recat; the item module's permute, its row-wise group's bucketize and both
    # groups' recat (before any generated kernel is built: the probe runs while they build); not
    # the lookups or the outputs
    regions = sorted(n.id for n in graph.nodes if n.op in INPUT_REGIONS)
    assert {n.split("/")[-1] for n in regions if n.startswith(ITEM)} == set(INPUT_REGIONS)
    assert sorted(timed) == regions and len(regions) == 5
    assert all(len(ms) == graph.world_size and min(ms) > 0 for ms in timed.values())


@pytest.mark.parametrize("name", sorted(p.stem for p in GRAPHS.glob("*.json")))
def test_every_fixture_graphs_input_regions_are_timed(name):
    graph = load(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a region the probe cannot make up warns: none here)
        timed = measure_reference_inputs(graph, 0, torch.device("cpu"))
    assert sorted(timed) == sorted(n.id for n in graph.nodes if n.op in INPUT_REGIONS)


def test_ranks_with_different_batch_sizes_are_timed_on_their_own():
    graph = load("two_modules_2ranks")
    for m in graph.modules:
        m.batch_size_per_rank = [m.batch_size_per_rank[0], m.batch_size_per_rank[0] + 8]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timed = measure_reference_inputs(graph, 0, torch.device("cpu"))
    assert sorted(timed) == sorted(n.id for n in graph.nodes if n.op in INPUT_REGIONS)


def test_a_region_the_probe_cannot_time_is_left_to_the_bytes_with_a_warning(monkeypatch):
    def refuse(*_):
        raise RuntimeError("a shape the probe cannot make up")

    monkeypatch.setattr("lightning_sparselift.runtime.kernels.bucketize_fbgemm", refuse)
    graph = load("two_modules_2ranks")
    with pytest.warns(UserWarning, match="could not be timed on rank 0's shape .RuntimeError: a shape"):
        timed = measure_reference_inputs(graph, 0, torch.device("cpu"))
    assert f"{ITEM}/g1/bucketize" not in timed and f"{ITEM}/g1/recat" in timed


def test_nothing_is_timed_on_an_accelerator():
    assert measure_reference_inputs(load("two_modules_2ranks"), 0, torch.device("cuda")) == {}


@pytest.mark.parametrize("rank", [0, 1])
def test_the_synthetic_features_hold_the_ids_the_capture_counted_per_key(rank):
    m = load("two_modules_2ranks").module(ITEM)
    batch, stats = m.batch_size_per_rank[rank], m.ids_per_step[rank]
    features = _features(m, m.keys, batch, stats, rows=100)
    assert features.stride() == batch
    assert features.length_per_key() == [round(stats[k]) for k in m.keys]
    assert int(features.values().max()) < 100
    assert (features.weights_or_none() is not None) == m.weighted
