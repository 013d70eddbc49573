"""The lifted executor against TorchRec: bit-identical outputs, dense gradients, updated tables and
fused optimizer state, for every sharding type, weighted and unweighted, one-hot and multi-hot
(with empty bags), one or two sharded modules, on 1, 2 and 3 processes; and the lifted graph's
bytes per collective against the bytes TorchRec actually moved."""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import lifted_parity as lp
from lightning_sparselift.lift import SparseGraph

ALL = lp.ALL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(world size, cuda) -> (case, variant) -> per-rank results; each world size runs all cases in
    one spawn."""
    cache: dict[tuple[int, bool], dict] = {}

    def get(world: int, cuda: bool = False) -> dict:
        if (world, cuda) not in cache:
            out = tmp_path_factory.mktemp(f"parity{world}")
            mp.start_processes(lp.worker, args=(world, _free_port(), ALL, str(out), cuda), nprocs=world,
                               start_method="spawn")
            cache[world, cuda] = {(c, v): [torch.load(Path(out) / f"{c}-{v}-rank{r}.pt", weights_only=False)
                                           for r in range(world)] for c, v in ALL}
        return cache[world, cuda]
    return get


def _differences(reference: dict, lifted: dict) -> list[str]:
    bad = []
    assert len(reference["outputs"]) == len(lifted["outputs"]) == lp.WARMUP_STEPS + lp.LIFTED_STEPS
    for step, (a, b) in enumerate(zip(reference["outputs"], lifted["outputs"])):
        if not torch.equal(a, b):
            bad.append(f"pooled output of step {step} (max diff {(a - b).abs().max():.3g})")
    for step, (a, b) in enumerate(zip(reference["grads"], lifted["grads"])):
        if a.keys() != b.keys():
            bad.append(f"step {step}: gradients of different parameters {sorted(a.keys() ^ b.keys())}")
        bad += [f"gradient of {k} at step {step}" for k in a if k in b and not torch.equal(a[k], b[k])]
    for key in ("initial", "final"):
        a, b = reference[key], lifted[key]
        assert a.keys() == b.keys()
        bad += [f"{key} {k}" for k in a if not torch.equal(a[k], b[k])]
    return bad


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case, variant", ALL)
def test_lifted_executor_is_bit_identical_to_torchrec(runs, world, case, variant):
    _assert_identical(runs(world)[(case, variant)], case, variant, world)


def _assert_identical(results: list[dict], case: str, variant: str, world: int) -> None:
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("error")
        bad = _differences(result["reference"], result["lifted"])
        assert not bad, f"rank {rank}: " + "; ".join(bad[:10])
        # the lifted executor really ran: it was installed, and it handed only the uneven step to TorchRec
        # (data-parallel tables need no exchange, so their uneven step stays on the lifted path)
        short = lp.VARIANTS[variant].get("short_step") is not None and world > 1 and case != "data_parallel"
        assert "graph" in result["lifted"]
        assert set(result["lifted"]["torchrec_steps"].values()) == {1 if short else 0}


@pytest.mark.gpu
@pytest.mark.parametrize("case, variant", ALL)
def test_lifted_executor_on_one_gpu(runs, case, variant):
    _assert_identical(runs(1, cuda=True)[(case, variant)], case, variant, 1)


@pytest.mark.multigpu
@pytest.mark.parametrize("case, variant", ALL)
def test_lifted_executor_on_two_gpus_over_nccl(runs, case, variant):
    _assert_identical(runs(2, cuda=True)[(case, variant)], case, variant, 2)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case, variant", ALL)
def test_predicted_bytes_match_torchrec(runs, world, case, variant):
    for rank, result in enumerate(runs(world)[(case, variant)]):
        lifted = result["lifted"]
        graph = SparseGraph.from_dict(lifted["graph"])
        exact = not lp.VARIANTS[variant]["multi_hot"]
        captured = lifted["captured_collectives"]
        forward = [n for n in graph.collectives("forward")]
        seen = [c for c in captured if c[1] == "forward"]
        assert [(n.op, n.dtype) for n in forward] == [(c[0], c[3]) for c in seen]
        for node, record in zip(forward, seen):
            if exact or not node.data_dependent:
                assert node.bytes_per_member[rank] == record[4], f"{node.id} on rank {rank}"
        # backward: TorchRec's gradient collectives, and DDP's all-reduces (bucketed) in total
        sparse_back = Counter((n.op, n.bytes_per_member[rank]) for n in graph.collectives("backward")
                              if n.op != "all_reduce")
        seen_back = Counter((c[0], c[4]) for c in captured if c[1] == "backward" and c[0] != "all_reduce")
        assert sparse_back == seen_back
        predicted_reduce = sum(n.bytes_per_member[rank] for n in graph.collectives("backward") if n.op == "all_reduce")
        assert predicted_reduce == sum(c[4] for c in captured if c[0] == "all_reduce")
        # the lifted executor moves the same bytes as TorchRec in the same order
        ours = lifted["lifted_collectives"]
        assert Counter((c[0], c[3]) for c in ours) == Counter((c[0], c[3]) for c in captured)


def test_graph_round_trips_and_explains(runs):
    results = runs(2)[("mixed", "two_modules")]
    graph = SparseGraph.from_dict(results[0]["lifted"]["graph"])
    assert SparseGraph.from_dict(results[1]["lifted"]["graph"]).fingerprint() == graph.fingerprint()
    assert SparseGraph.from_dict(graph.to_dict()) == graph
    assert SparseGraph.from_dict(__import__("json").loads(graph.to_json())).fingerprint() == graph.fingerprint()
    text = graph.explain()
    for expected in ("table_wise", "row_wise", "column_wise", "data_parallel", "reduce_scatter", "all_gather",
                     "grad_pooled", "input_values", "ebc_b"):
        assert expected in text
    # one splits exchange per all-to-all group: ebc_a table/row/column-wise, ebc_b row/table-wise
    assert text.count("input_splits") == 5
    assert graph.to_dot().startswith("digraph")


# ---------------------------------------------------------------------------- through the strategy
import lightning.pytorch as L  # noqa: E402

from helpers import DumpLocalState, load_dumps, tiny_data, tiny_model, trainer  # noqa: E402
from lightning_sparselift import SparseLiftStrategy  # noqa: E402

MIXED = dict(zip(["t_cat_0", "t_cat_1", "t_cat_2", "t_cat_3", "t_cat_4", "t_cat_5"],
                 ["table_wise", "column_wise", "row_wise", "data_parallel", "row_wise", "table_wise"]))


class SaveExecutor(L.Callback):
    def __init__(self, folder: Path):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        s = trainer.strategy
        graph = s.sparse_graph
        torch.save({"executor": s.executor_in_use, "fallback": s.executor_fallback_reason,
                    "graph": graph.to_dict() if graph is not None else None,
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   self.folder / f"executor{trainer.global_rank}.pt")


def test_strategy_lifted_executor_matches_torchrec_executor(tmp_path, data_cache):
    """Trainer.fit with executor='sparselift' (the default) and 'torchrec': the same tables, fused
    optimizer state and dense weights after an epoch with validation, bit for bit."""
    dm = tiny_data(data_cache, num_train=1600)  # 25 steps: capture 3, calibrate 2 candidates x 6
    for executor in ("torchrec", "sparselift"):
        L.seed_everything(0)
        folder = tmp_path / executor
        folder.mkdir()
        strategy = SparseLiftStrategy(start_method="fork", sharding_types=MIXED, executor=executor,
                                      embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05})
        t = trainer(2, strategy, callbacks=[DumpLocalState(folder), SaveExecutor(folder)])
        t.fit(tiny_model(dm), dm)
    for rank in range(2):
        ours, theirs = load_dumps(tmp_path / "sparselift", 2)[rank], load_dumps(tmp_path / "torchrec", 2)[rank]
        assert ours.keys() == theirs.keys()
        assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
        info = torch.load(tmp_path / "sparselift" / f"executor{rank}.pt", weights_only=False)
        assert info["executor"] == "sparselift" and info["fallback"] is None
        assert info["metrics"]["sparselift/collectives_per_step"] == len(SparseGraph.from_dict(info["graph"]).collectives())
        reference = torch.load(tmp_path / "torchrec" / f"executor{rank}.pt", weights_only=False)
        assert reference["executor"] == "torchrec"
        assert info["metrics"]["val/auc"] == reference["metrics"]["val/auc"]


def _mean_pooled_model(dm):
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import PoolingType

    model = tiny_model(dm)
    ebc = model.model.sparse_arch.embedding_bag_collection
    configs = ebc.embedding_bag_configs()
    for config in configs:
        config.pooling = PoolingType.MEAN
    model.model.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(tables=configs,
                                                                              device=torch.device("meta"))
    return model


def test_strategy_falls_back_to_torchrec_when_the_path_cannot_be_lifted(tmp_path, data_cache):
    dm = tiny_data(data_cache, num_train=256)
    L.seed_everything(0)
    strategy = SparseLiftStrategy(start_method="fork", sharding_types={"t_cat_2": "row_wise"})
    t = trainer(2, strategy, callbacks=[SaveExecutor(tmp_path)], limit_val_batches=0)
    t.fit(_mean_pooled_model(dm), dm)
    info = torch.load(tmp_path / "executor0.pt", weights_only=False)
    assert info["executor"] == "torchrec"
    assert "row-wise with mean pooling" in info["fallback"] and "t_cat_2" in info["fallback"]


def test_ranks_with_different_graphs_raise_instead_of_hanging(data_cache, monkeypatch):
    import torch.distributed as dist

    # forked ranks inherit the patch: each rank claims a different graph
    monkeypatch.setattr(SparseGraph, "fingerprint", lambda self: f"graph-of-rank-{dist.get_rank()}")
    dm = tiny_data(data_cache, num_train=256)
    t = trainer(2, SparseLiftStrategy(start_method="fork"), limit_val_batches=0)
    with pytest.raises(Exception, match="ranks lifted different sparse graphs"):
        t.fit(tiny_model(dm), dm)
