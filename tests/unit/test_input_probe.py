"""The probe of TorchRec's input kernels (process-free): which regions it times, on whose shape."""

from __future__ import annotations

import pytest
import torch

from graph_fixtures import ITEM, load
from lightning_sparselift.cost.input_probe import _features, measure_reference_inputs
from lightning_sparselift.ir.schedule import GENERATED_KERNEL, INPUT_REGIONS


def _with_input_kernel():
    graph = load("two_modules_2ranks")
    graph.module(ITEM).input_kernels = [GENERATED_KERNEL]
    return graph


def test_it_times_every_input_region_that_has_a_generated_kernel_to_choose_on_every_ranks_shape():
    graph = _with_input_kernel()
    timed = measure_reference_inputs(graph, 0, torch.device("cpu"))
    # the item module's permute, its row-wise group's bucketize and both groups' recat; not the
    # user module's (no generated input kernel), not the lookups or the output
    regions = sorted(n.id for n in graph.nodes if n.module == ITEM and n.op in INPUT_REGIONS)
    assert {n.split("/")[-1] for n in regions} == set(INPUT_REGIONS)
    assert sorted(timed) == regions
    assert all(len(ms) == graph.world_size and min(ms) > 0 for ms in timed.values())


def test_nothing_is_timed_where_no_module_has_a_generated_input_kernel_or_on_an_accelerator():
    assert measure_reference_inputs(load("two_modules_2ranks"), 0, torch.device("cpu")) == {}
    assert measure_reference_inputs(_with_input_kernel(), 0, torch.device("cuda")) == {}


@pytest.mark.parametrize("rank", [0, 1])
def test_the_synthetic_features_hold_the_ids_the_capture_counted_per_key(rank):
    m = _with_input_kernel().module(ITEM)
    batch, stats = m.batch_size_per_rank[rank], m.ids_per_step[rank]
    features = _features(m, m.keys, batch, stats, rows=100)
    assert features.stride() == batch
    assert features.length_per_key() == [round(stats[k]) for k in m.keys]
    assert int(features.values().max()) < 100
    assert (features.weights_or_none() is not None) == m.weighted
