"""A clean console: what TorchRec's defaults made a run print is fixed where it came from, with
the same results (the planner's reservation and topology, so the same placements), and the two
warnings from other libraries' code are filtered by message and origin only. Sharding on two ranks
(no warnings, DDP's buffers left rank-local): tests/ranks/test_console_ranks.py."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest
import torch

from lightning_sparselift.models import DLRMModule
from lightning_sparselift.embedding_optimizer import EmbeddingOptimizer
from lightning_sparselift.sharding import build_sharding_plan


def _dlrm(sizes: list[int], **kwargs) -> DLRMModule:
    torch.manual_seed(0)
    model = DLRMModule(sizes, embedding_dim=16, dense_arch_layer_sizes=[32, 16], over_arch_layer_sizes=[32, 1],
                       **kwargs)
    EmbeddingOptimizer("sgd").apply_in_backward([p for p in model.parameters() if p.is_meta])
    return model


def _storage(topology) -> list[tuple[int, int, int]]:
    return [(d.storage.hbm, d.storage.ddr, d.storage.ssd) for d in topology.devices]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("with_constraints", [False, True])
def test_the_storage_reservation_reserves_what_torchrecs_default_heuristic_did(device, with_constraints):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation

    from lightning_sparselift.torchrec_parts import DenseAndInputReservation, planner_topology

    model = _dlrm([1000, 20_000, 7], interaction="dcn", dcn_num_layers=2, dcn_low_rank_dim=8)
    sharders = [EmbeddingBagCollectionSharder()]
    constraints = {"t_cat_1": ParameterConstraints(pooling_factors=[3.5, 1.0], batch_sizes=[512, 256]),
                   "t_cat_2": ParameterConstraints(pooling_factors=[2.0])} if with_constraints else None
    with warnings.catch_warnings(), _quiet("torchrec"):  # the reference is the class that warns
        warnings.simplefilter("ignore", FutureWarning)
        reference = HeuristicalStorageReservation(percentage=0.15)  # the planner's default
        expected = reference.reserve(Topology(world_size=3, compute_device=device), 1024, model, sharders, constraints)
    ours = DenseAndInputReservation()
    reserved = ours.reserve(planner_topology(3, device), 1024, model, sharders, constraints)
    assert _storage(reserved) == _storage(expected)
    assert ours._dense_storage == reference._dense_storage and ours._kjt_storage == reference._kjt_storage
    assert ours._dense_storage.hbm + ours._dense_storage.ddr > 0 and _storage(ours.last_reserved_topology) == \
        _storage(reserved)


def test_the_planner_topology_is_torchrecs_default_topology(caplog):
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.types import _topology_hash_components

    from lightning_sparselift.torchrec_parts import planner_topology

    for world, device in [(1, "cpu"), (2, "cpu"), (8, "cuda")]:
        with _quiet("torchrec"):
            direct = Topology(world_size=world, compute_device=device)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            made = planner_topology(world, device)
        assert caplog.records == []
        assert _topology_hash_components(made, round_unit=1) == _topology_hash_components(direct, round_unit=1)


@pytest.mark.parametrize("world, device, types", [(2, "cpu", {}), (3, "cpu", {"t_cat_0": "column_wise"}),
                                                  (4, "cuda", {}), (2, "cuda", {"t_cat_1": "data_parallel"})])
def test_the_sharding_plan_is_the_one_torchrecs_defaults_give(world, device, types, caplog):
    """Placements by our explicit topology and reservation = placements by TorchRec's defaults,
    including tables large enough that memory decides (a caching kernel on GPU)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    sizes = [2_000_000_000, 450_000_000, 100_000_000, 1000, 5000] if device == "cuda" else [100_000, 3000, 50, 7]
    model = _dlrm(sizes)
    with warnings.catch_warnings(), _quiet("torchrec"):
        warnings.simplefilter("ignore", FutureWarning)
        default = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device=device), debug=False,
            constraints={t: ParameterConstraints(sharding_types=[k]) for t, k in types.items()},
        ).plan(model, [EmbeddingBagCollectionSharder()])
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="torchrec"):
        warnings.simplefilter("always")
        ours = build_sharding_plan(model, [EmbeddingBagCollectionSharder()], world, device, types, None)
    assert str(ours) == str(default)
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and "Sharding spec not found" not in r.getMessage()] == []  # (data_parallel tables have no spec)
    if device == "cuda":  # HBM decided something (a table in host memory), so the reservation mattered
        kernels = {p.compute_kernel for p in ours.plan["model.sparse_arch.embedding_bag_collection"].values()}
        assert any(k.startswith("fused_uvm") for k in kernels), kernels


class _quiet:
    """Silence a logger (the reference objects built here log TorchRec's warnings)."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def __enter__(self) -> None:
        self.level, self.logger.level = self.logger.level, logging.CRITICAL

    def __exit__(self, *exc) -> None:
        self.logger.level = self.level


# ---------------------------------------------------------------------------------------- CLI, filters
def test_from_the_command_line_the_cli_leaves_sys_argv_to_lightning(monkeypatch):
    import lightning_sparselift.cli as cli

    seen = []
    monkeypatch.setattr(cli, "SparseLiftCLI", lambda *a, **kw: seen.append(kw["args"]))
    monkeypatch.setattr(sys, "argv", ["sparselift", "fit", "--config", "x.yaml"])
    cli.main()
    cli.main(["fit", "--config", "y.yaml"])
    assert seen == [None, ["fit", "--config", "y.yaml"]]


def test_the_filters_drop_exactly_the_two_library_messages(caplog):
    from lightning_sparselift.lightning import console

    console.install()
    console.install()  # idempotent
    fx = logging.getLogger("torch.fx._symbolic_trace")
    assert len([f for f in fx.filters if isinstance(f, console._DropFxTracingNotice)]) == 1
    with caplog.at_level(logging.WARNING):
        fx.warning("is_fx_tracing will return true for both fx.symbolic_trace and torch.export. Please use ...")
        fx.warning("something else torch.fx has to say")
        logging.getLogger("other").warning("is_fx_tracing will return true for both fx.symbolic_trace and "
                                           "torch.export")
    assert [(r.name, r.getMessage()[:20]) for r in caplog.records] == [
        ("torch.fx._symbolic_trace", "something else torch"), ("other", "is_fx_tracing will r")]

    message = ("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
               "treespec.is_leaf()` instead.")
    with warnings.catch_warnings(record=True) as caught:
        console.install()  # inside catch_warnings, which restores the filters afterwards
        warnings.simplefilter("always")
        console.install()  # (simplefilter put "always" first; install puts the filter back in front)
        from lightning.pytorch.utilities._pytree import _tree_flatten

        _tree_flatten([1, 2])  # Lightning's LeafSpec() call: filtered
        warnings.warn_explicit(message, FutureWarning, "elsewhere.py", 1, module="elsewhere")  # other code: shown
        warnings.warn_explicit("other", FutureWarning, "_pytree.py", 1, module="lightning.pytorch.utilities._pytree")
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce_coalesced"):
            warnings.warn_explicit(f"`torch.distributed.{name}` is deprecated. Please use ...", FutureWarning,
                                   "c10d_logger.py", 83, module="torch.distributed.c10d_logger")
    assert [(str(w.message)[:12], w.filename) for w in caught] == [
        ("`isinstance(", "elsewhere.py"), ("other", "_pytree.py"), ("`torch.distr", "c10d_logger.py")]
    assert "all_reduce_coalesced" in str(caught[-1].message)
