"""The lifted executor against TorchRec: bit-identical outputs, dense gradients, updated tables and
fused optimizer state, for every sharding type, weighted and unweighted, one-hot and multi-hot
(with empty bags), one or two sharded modules, EmbeddingBagCollections and EmbeddingCollections
(alone and next to an EmbeddingBagCollection), on 1, 2 and 3 processes; and the lifted graph's
bytes per collective against the bytes TorchRec actually moved.

`make test` runs every case on 2 ranks with the passes forced on together, and the quick cases
(``lp.QUICK_CASES``) on 1 and 3 ranks and with each pass alone; the rest is ``slow``. Each world
size's selected runs happen in one spawn."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import lifted_parity as lp
from helpers import LIFTED, free_port
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.ir.vocab import ROW_SHARDED, output_collective

ALL = lp.ALL
EACH_PASS = [(c, v) for c, v in ALL if v in lp.EACH_PASS_VARIANTS]


def _cases(pairs: list[tuple[str, str]], quick: bool) -> list:
    """``pairs`` as parameters, those outside the quick cases marked slow (unless ``quick``: all run by default)."""
    return [pytest.param(c, v, marks=() if quick or c in lp.QUICK_CASES else pytest.mark.slow) for c, v in pairs]


def _worlds(worlds: list[int], pairs: list[tuple[str, str]], quick_on: tuple[int, ...] = ()) -> list:
    """(world, case, variant) parameters: every pair on the worlds of ``quick_on``, the quick cases elsewhere."""
    return [pytest.param(w, *p.values, marks=p.marks) for w in worlds for p in _cases(pairs, w in quick_on)]


def _wanted(items: list) -> dict[tuple[int, bool], list[tuple[str, str, bool]]]:
    """What the selected tests read from the harness: per (world size, cuda), (case, variant, each pass alone too)."""
    wanted: dict[tuple[int, bool], dict[tuple[str, str], bool]] = {}
    for item in items:
        if "runs" not in getattr(item, "fixturenames", ()):
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        cuda = item.get_closest_marker("gpu") is not None or item.get_closest_marker("multigpu") is not None
        world = params.get("world", 2 if item.get_closest_marker("multigpu") or not cuda else 1)
        pair = (params.get("case", "mixed"), params.get("variant", "two_modules"))
        runs = wanted.setdefault((world, cuda), {})
        runs[pair] = runs.get(pair, False) or item.originalname == "test_each_pass_forced_alone_is_bit_identical"
    return {key: [(c, v, each) for (c, v), each in runs.items()] for key, runs in wanted.items()}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """(world size, cuda) -> (case, variant) -> per-rank results; each world size runs the cases
    the selected tests read in one spawn."""
    cache: dict[tuple[int, bool], dict] = {}
    wanted = _wanted(request.session.items)

    def get(world: int, cuda: bool = False) -> dict:
        if (world, cuda) not in cache:
            out = tmp_path_factory.mktemp(f"parity{world}")
            cases = wanted[world, cuda]
            mp.start_processes(lp.worker, args=(world, free_port(), cases, str(out), cuda), nprocs=world,
                               start_method="spawn")
            cache[world, cuda] = {(c, v): [torch.load(Path(out) / f"{c}-{v}-rank{r}.pt", weights_only=False)
                                           for r in range(world)] for c, v, _ in cases}
        return cache[world, cuda]
    return get


def _lifted_runs(result: dict) -> list[str]:
    """The runs of a case on the lifted executor: the identity plan, then the passes forced on."""
    return [name for name in result if name in ("lifted", *lp.OPTIMIZED)]


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


@pytest.mark.parametrize("world, case, variant", _worlds([1, 2, 3], ALL, quick_on=(2,)))
def test_lifted_executor_is_bit_identical_to_torchrec(runs, world, case, variant):
    _assert_identical(runs(world)[(case, variant)], case, variant, world)


@pytest.mark.parametrize("world, case, variant", _worlds([1, 2, 3], EACH_PASS))
def test_each_pass_forced_alone_is_bit_identical(runs, world, case, variant):
    results = runs(world)[(case, variant)]
    assert all(set(lp.OPTIMIZED) <= set(r) for r in results)
    _assert_identical(results, case, variant, world)


def _assert_identical(results: list[dict], case: str, variant: str, world: int, cuda: bool = False) -> None:
    """``cuda``: the ranks ran on GPUs, where under the default ``numerics="exact"`` no generated
    kernel runs (the Triton lookups are not shown bit-identical to fbgemm's CUDA kernels, and the
    consumer layout and input kernel are C++ over host memory), so none of their rewrites apply."""
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("error")
        for executor in _lifted_runs(result):  # the identity plan, and the passes forced on
            bad = _differences(result["reference"], result[executor])
            assert not bad, f"{executor}, rank {rank}: " + "; ".join(bad[:10])
            # the lifted executor really ran: it was installed, and it handed only the uneven step to
            # TorchRec (data-parallel tables need no exchange, so their uneven step stays lifted)
            short = lp.VARIANTS[variant].get("short_step") is not None and world > 1 and case != "data_parallel"
            assert "graph" in result[executor]
            assert set(result[executor]["torchrec_steps"].values()) == {1 if short else 0}
            # latency hiding: every lifted step of a module with an output all-to-all started early;
            # every lifted step after the first had its input distributed during the step before
            graph = SparseGraph.from_dict(result[executor]["graph"])
            passes = lp.OPTIMIZED.get(executor, ())
            for m in graph.modules:
                early = m.schedule.lookup_at == "root_forward"
                assert early == ("latency_hiding" in passes and world > 1 and any(
                    output_collective(g.kind, m.pooled) == "all_to_all_single" for g in m.groups))
                assert result[executor]["early_steps"][m.path] == (lp.LIFTED_STEPS - int(short) if early else 0)
                ahead = m.schedule.input_issue == "previous_step"
                assert ahead == (bool({"latency_hiding", "latency_hiding:next_batch"} & set(passes)) and world > 1
                                 and any(g.kind not in ("data_parallel", None) for g in m.groups))
                assert result[executor]["prefetched_steps"][m.path] == (lp.LIFTED_STEPS - 1 if ahead else 0)
                # code generation: a pooled module whose concatenation capture saw (the first one in it)
                # writes its output into it, every lifted step; every fused pooled group's lookup ran a
                # generated kernel
                consumer = ("codegen" in passes and not cuda and m.consumer is not None and not m.mean_after_reduce
                            and not any(g.not_lifted for g in m.groups))
                assert (m.schedule.region("output").kernel == "consumer") == consumer, m.consumer_note
                assert result[executor]["concatenated_steps"][m.path] == (lp.LIFTED_STEPS - int(short) if consumer
                                                                          else 0), m.consumer
                # subgraph parallelism: in buckets wherever a rank holds two of the group's tables;
                # pipelined (the pass's last rungs, so they win where feasible) where the group is pooled,
                # has an output all-to-all of its own and tables on every one of several ranks
                pipelined = any(p in ("subgraph_parallelism", "subgraph_parallelism:pipelined2",
                                      "subgraph_parallelism:pipelined4") for p in passes)
                concurrent = any(p in ("subgraph_parallelism", "subgraph_parallelism:buckets2",
                                       "subgraph_parallelism:buckets4") for p in passes)
                for g in m.groups:
                    region = m.schedule.region("lookup", g.index)
                    fused = g.kind not in ("data_parallel", None)  # (None: TorchRec's modules run it)
                    assert (region.kernel == "generated") == (fused and not cuda and (
                        "codegen" in passes or bool(region.buckets))), f"{executor} g{g.index}: {g.lookup_notes}"
                    tables_per_rank = Counter(t.rank for t in g.tables)
                    own = any(e.groups == [g.index] and e.op == "all_to_all_single" for e in m.schedule.outputs)
                    splits = pipelined and world > 1 and m.pooled and own and len(tables_per_rank) == world
                    assert bool(region.buckets) == ((splits or concurrent) and fused and not cuda
                                                    and max(tables_per_rank.values()) > 1), \
                        f"{executor} g{g.index}: {region}"
                    split = [e.split for e in m.schedule.outputs if e.groups == [g.index] and e.split]
                    assert split == ([[f"bucket{b}" for b in range(len(region.buckets))]] if splits and region.buckets
                                     else []), f"{executor} g{g.index}: {m.schedule.outputs}"


@pytest.mark.gpu
@pytest.mark.parametrize("case, variant", ALL)
def test_lifted_executor_on_one_gpu(runs, case, variant):
    _assert_identical(runs(1, cuda=True)[(case, variant)], case, variant, 1, cuda=True)


@pytest.mark.multigpu
@pytest.mark.parametrize("case, variant", ALL)
def test_lifted_executor_on_two_gpus_over_nccl(runs, case, variant):
    _assert_identical(runs(2, cuda=True)[(case, variant)], case, variant, 2, cuda=True)


@pytest.mark.parametrize("world, case, variant", _worlds([2, 3], ALL, quick_on=(2,)))
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
            if (exact and not _follows_id_spread(graph, node)) or not node.data_dependent:
                assert node.bytes_per_member[rank] == record[4], f"{node.id} on rank {rank}"
        # backward: TorchRec's gradient collectives, and DDP's all-reduces (bucketed) in total
        back = [n for n in graph.collectives("backward") if n.op != "all_reduce"]
        seen_back = [c for c in captured if c[1] == "backward" and c[0] != "all_reduce"]
        if exact or not any(n.data_dependent for n in back):
            assert Counter((n.op, n.bytes_per_member[rank]) for n in back) == Counter((c[0], c[4]) for c in seen_back)
        else:
            assert Counter(n.op for n in back) == Counter(c[0] for c in seen_back)
        predicted_reduce = sum(n.bytes_per_member[rank] for n in graph.collectives("backward") if n.op == "all_reduce")
        assert predicted_reduce == sum(c[4] for c in captured if c[0] == "all_reduce")
        # the lifted executor issues the graph's collectives, with aggregation forced on as well
        for executor in _lifted_runs(result):
            run = result[executor]
            graph = SparseGraph.from_dict(run["graph"])
            if (lp.VARIANTS[variant].get("short_step") == lp.WARMUP_STEPS + 2
                    and any(m.schedule.input_issue == "previous_step" for m in graph.modules)):
                continue  # the recorded step distributes the next (uneven) batch: its splits exchange only
            ours = [c for c in run["lifted_collectives"] if c[0] != "all_reduce"]
            predicted = [n for n in graph.collectives() if n.op != "all_reduce"]
            assert Counter((c[0], c[3]) for c in ours) == Counter((n.op, n.dtype) for n in predicted), executor
            if exact:
                # a packed payload pads each destination's chunk to 8 bytes; with row-wise groups how
                # the ids split over destinations (so the padding) is data-dependent
                slack = 7 * world if any(g.sharding_type in ROW_SHARDED for m in graph.modules for g in m.groups) else 0
                for key in {(c[0], c[3]) for c in ours}:
                    if any(_follows_id_spread(graph, n) for n in predicted if (n.op, n.dtype) == key):
                        continue
                    seen_bytes = sorted(c[4] for c in ours if (c[0], c[3]) == key)
                    predicted_bytes = sorted(n.bytes_per_member[rank] for n in predicted if (n.op, n.dtype) == key)
                    tolerance = slack if key[1] == "uint8" else 0
                    assert all(abs(a - b) <= tolerance for a, b in zip(seen_bytes, predicted_bytes)), (executor, key)


def _follows_id_spread(graph: SparseGraph, node) -> bool:
    """An EmbeddingCollection's row-wise rows: how many each rank returns follows where the batch's
    ids fall among the row blocks (the graph predicts an even spread)."""
    m = graph.module(node.module) if node.module != "dense" else None
    return (m is not None and not m.pooled and node.role == "output_sequence"
            and any(m.groups[i].sharding_type == "row_wise" for i in node.groups))


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

from helpers import ONE_LOOK, DumpLocalState, assert_same_dumps, tiny_data, tiny_model, trainer  # noqa: E402
from lightning_sparselift import SparseLiftStrategy  # noqa: E402

MIXED = dict(zip(["t_cat_0", "t_cat_1", "t_cat_2", "t_cat_3", "t_cat_4", "t_cat_5"],
                 ["table_wise", "column_wise", "row_wise", "data_parallel", "row_wise", "table_wise"]))


class SaveExecutor(L.Callback):
    def __init__(self, folder: Path):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        s = trainer.strategy
        graph = s.sparse_graph
        forwards = s.lifted_executor.executors.values() if s.lifted_executor is not None else []
        torch.save({"executor": s.executor_in_use, "fallback": s.executor_fallback_reason,
                    "graph": graph.to_dict() if graph is not None else None,
                    "early": [(f.early_starts, f.early_steps) for f in forwards],
                    "ahead": [(f.prefetches, f.prefetched_steps) for f in forwards],
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   self.folder / f"executor{trainer.global_rank}.pt")


def test_strategy_lifted_executor_matches_torchrec_executor(tmp_path, data_cache):
    """Trainer.fit with executor='sparselift' (the default, every pass applied) and 'torchrec': the
    same tables, fused optimizer state and dense weights after an epoch with validation, bit for bit."""
    dm = tiny_data(data_cache, num_train=1600)  # 25 steps
    for executor in ("torchrec", "sparselift"):
        L.seed_everything(0)
        folder = tmp_path / executor
        folder.mkdir()
        strategy = SparseLiftStrategy(start_method="fork", sharding_types=MIXED, executor=executor, calibrate=False,
                                      embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05})
        t = trainer(2, strategy, callbacks=[DumpLocalState(folder), SaveExecutor(folder)])
        t.fit(tiny_model(dm), dm)
    assert_same_dumps(tmp_path / "torchrec", tmp_path / "sparselift")
    for rank in range(2):
        info = torch.load(tmp_path / "sparselift" / f"executor{rank}.pt", weights_only=False)
        assert info["executor"] in LIFTED and info["fallback"] is None
        graph = SparseGraph.from_dict(info["graph"])
        schedule = graph.modules[0].schedule
        assert [e.packing for e in schedule.inputs] == ["bytes"]  # aggregated: one bucket of every group
        assert [len(e.groups) for e in schedule.outputs if e.op == "all_to_all_single"] == [2]
        assert schedule.lookup_at == "root_forward" and schedule.input_issue == "previous_step"
        # forked ranks run one thread each: no buckets (tests/ranks/test_subgraph_parallelism.py runs them)
        assert not any(r.buckets for r in schedule.regions)
        # every training step after the 3 captured ones started early, once (Lightning calls the
        # LightningModule twice per step: the forward redirection, then training_step's self(batch))
        assert info["early"] == [(22, 22)]
        # and each of them but the first had its input distributed by the step before (the last
        # step of the epoch has no next batch to announce)
        assert info["ahead"] == [(21, 21)]
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


def test_row_wise_mean_pooling_is_lifted_and_matches_torchrec(tmp_path, data_cache):
    # TorchRec's row-wise lookups sum and its module divides by bag lengths after the reduce-scatter
    dm = tiny_data(data_cache, num_train=640, pooling_factors=[1, 3, 2, 1, 4, 1], length_distribution="poisson")
    for executor in ("torchrec", "sparselift"):
        L.seed_everything(0)
        strategy = SparseLiftStrategy(start_method="fork", executor=executor, calibrate=False,
                                      sharding_types={"t_cat_1": "row_wise", "t_cat_2": "row_wise"})
        folder = tmp_path / executor
        folder.mkdir()
        t = trainer(2, strategy, callbacks=[SaveExecutor(folder), DumpLocalState(folder)], limit_val_batches=0)
        t.fit(_mean_pooled_model(dm), dm)
    info = torch.load(tmp_path / "sparselift" / "executor0.pt", weights_only=False)
    assert info["executor"] in LIFTED, info["fallback"]
    assert "divided by bag lengths after the reduce-scatter" in SparseGraph.from_dict(info["graph"]).explain()
    assert_same_dumps(tmp_path / "torchrec", tmp_path / "sparselift")


def test_ranks_with_different_graphs_raise_instead_of_hanging(data_cache, monkeypatch):
    import torch.distributed as dist

    # forked ranks inherit the patch: each rank claims a different graph
    monkeypatch.setattr(SparseGraph, "fingerprint", lambda self: f"graph-of-rank-{dist.get_rank()}")
    dm = tiny_data(data_cache, num_train=256)
    t = trainer(2, SparseLiftStrategy(start_method="fork"), limit_val_batches=0)
    with pytest.raises(Exception, match="ranks lifted different sparse graphs"):
        t.fit(tiny_model(dm), dm)


def _fit_with_plan(tmp_path, data_cache, plan_path, run, **options):
    dm = tiny_data(data_cache, num_train=6656)  # 104 steps: 3 captured, 96 calibrating, 5 on the plan
    L.seed_everything(0)
    folder = tmp_path / run
    folder.mkdir()
    t = trainer(2, SparseLiftStrategy(start_method="fork", sharding_types=MIXED, plan_path=str(plan_path),
                                      **{**ONE_LOOK, **options}),
                callbacks=[SaveExecutor(folder)], limit_val_batches=0)
    t.fit(tiny_model(dm), dm)
    return torch.load(folder / "executor0.pt", weights_only=False)["metrics"]


def _calibration_steps(plan) -> int:
    """The steps a plan's calibration took under ONE_LOOK: 1 warmup + 5 measured blocks per design,
    so few that each decides one candidate (the others' fitted effects would leave too few); the
    next-batch schedule's observed steps each after a settle step on the same plan (it acts across
    two steps). A candidate whose region's noise, measured by the designs before it, leaves no
    reach to the model's prediction is not measured (futile before measuring: 0 steps)."""
    measured = [d for d in plan.decisions if d.feasible and d.observations_ms is not None]
    unmeasured = [d for d in plan.decisions if d.feasible and d.observations_ms is None]
    assert measured and all(d.decided for d in unmeasured)  # (unmeasured: decided = futile before measuring)
    return sum(24 if ":next_batch@" in d.candidate else 12 for d in measured)


def test_saved_plan_is_reused_and_a_mismatching_plan_is_rejected(tmp_path, data_cache):
    import json

    from lightning_sparselift.plan import ExecutionPlan

    # the graph's kernels built first (a round without calibration waits for them): calibration starts
    # once they are built, and on a cold kernel cache their builds outlast the 104 steps
    _fit_with_plan(tmp_path, data_cache, tmp_path / "uncalibrated.json", "builds", calibrate=False)
    plan_path = tmp_path / "plan.json"
    first = _fit_with_plan(tmp_path, data_cache, plan_path, "first")
    assert first["sparselift/plan_reused"] == 0
    plan = ExecutionPlan.load(plan_path)
    assert first["sparselift/calibration_steps"] == _calibration_steps(plan)
    assert json.loads(plan_path.read_text())["schema"] == "sparselift-plan/3"
    assert {d.candidate.split("@")[0] for d in plan.decisions if d.feasible} == {
        "aggregation:input", "aggregation:output", "latency_hiding:early_start", "latency_hiding:next_batch",
        "codegen:lookup", "codegen:output", "codegen:input"}
    # forked ranks run one thread each: no concurrent buckets; no rank holds two tables of a group: nothing
    # to pipeline
    assert all("1 intra-op thread" in d.reason for d in plan.decisions if not d.feasible and ":buckets" in d.candidate)
    assert all("g0 (table_wise): no rank holds tables of two buckets" in d.reason
               for d in plan.decisions if ":pipelined" in d.candidate)
    assert all(d.measured_ms is not None and len(d.observations_ms) == 2 and d.pairs + d.outliers == 5
               for d in plan.decisions if d.feasible and d.observations_ms is not None)
    # accepted only beyond noise and the minimum gain: the whole interval below zero
    assert all(d.accepted <= (d.interval_ms[1] < 0) for d in plan.decisions if d.feasible and d.interval_ms)

    second = _fit_with_plan(tmp_path, data_cache, plan_path, "second")
    assert second["sparselift/plan_reused"] == 1
    assert "sparselift/calibration_step" not in second  # no calibration step ran
    assert second["sparselift/collectives_per_step"] == len(plan.graph.collectives())

    data = json.loads(plan_path.read_text())
    data["fingerprint"]["sharding_plan"] = "made-elsewhere"
    plan_path.write_text(json.dumps(data))
    with pytest.raises(Exception, match="sharding_plan: plan has 'made-elsewhere'"):
        ExecutionPlan.load(plan_path).check(plan.fingerprint)
    third = _fit_with_plan(tmp_path, data_cache, plan_path, "third")
    again = ExecutionPlan.load(plan_path)
    assert third["sparselift/plan_reused"] == 0 and third["sparselift/calibration_steps"] == _calibration_steps(again)
    assert again.fingerprint == plan.fingerprint  # planned again and saved
