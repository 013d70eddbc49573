"""Generated lookup kernels: bitwise against fbgemm's CPU kernels (forward and the fused update),
the kernel cache, the failures that make the candidate infeasible, and the codegen pass on small
graphs (process-free)."""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from graph_fixtures import EBC, load
from lightning_sparselift.ir.schedule import GENERATED_KERNEL
from lightning_sparselift.passes import InfeasibleCandidate
from lightning_sparselift.passes.codegen import CodeGeneration
from lightning_sparselift.runtime.codegen import Unsupported, spec_of
from lightning_sparselift.runtime.codegen.lookup import build_lookup
from lightning_sparselift.runtime.codegen.cpu_source import cpu_source
from lightning_sparselift.runtime.codegen.lookup import TableBatchKernel, bucketed
from lightning_sparselift.runtime.codegen.spec import OPTIMIZERS

# dims fbgemm allows (multiples of 4) but not of the 8-float vector, and one of more than 8 vectors of
# 8 or 16 floats (the forward sums 8 vectors of a row at a time); table 1 is read by two features, and
# its 1000 rows are many for its ~80 ids a step: its backward hashes them, the others' ids index their slots
DIMS, ROWS, FEATURE_TABLE = [8, 4, 12, 276], [50, 1000, 31, 7], [0, 1, 1, 2, 3]
BATCH = 16
ROWS_WIDTH = 12  # rows per id (no pooling) have one width
FBGEMM_OPTIMIZERS = {v: k for k, v in OPTIMIZERS.items()}
# the optimizers fbgemm's CPU module runs: the bitwise references (Adam: against torch.optim below)
HOST_OPTIMIZERS = ("adagrad", "rowwise_adagrad", "sgd")


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPARSELIFT_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))


def _tbe(optimizer: str, pooling: str, lr: float = 0.1, dims: list[int] = DIMS, **kwargs):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    torch.manual_seed(0)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in zip(ROWS, dims)],
        feature_table_map=FEATURE_TABLE, optimizer=EmbOptimType(FBGEMM_OPTIMIZERS[optimizer]), learning_rate=lr,
        eps=1e-8, pooling_mode={"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}[pooling],
        **kwargs)
    tbe.weights_host.data.normal_()
    return tbe


def _batch(gen: torch.Generator, weighted: bool, id_dtype: torch.dtype):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.randint(0, 6, (len(FEATURE_TABLE) * BATCH,), generator=gen)  # empty bags included
    lengths[3] = 0
    ids = torch.cat([torch.randint(0, ROWS[FEATURE_TABLE[i // BATCH]], (int(n),), generator=gen)
                     for i, n in enumerate(lengths)])
    ids[1:4] = ids[0]  # the same id several times in a bag and across bags
    weights = torch.rand(ids.numel(), generator=gen) if weighted else None
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(len(FEATURE_TABLE))], values=ids.to(id_dtype),
                            lengths=lengths.to(id_dtype), weights=weights)
    return kjt, ids, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]), weights


def _generated(tbe, weighted: bool, check_ids: bool = True, buckets=None) -> TableBatchKernel:
    spec = spec_of(tbe, weighted, check_ids)
    if buckets is not None:
        spec = bucketed(spec, [f"t{t}" for t in range(len(ROWS))], buckets)
    return TableBatchKernel(tbe, spec, build_lookup(cpu_source(spec), openmp=buckets is not None))


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("optimizer", HOST_OPTIMIZERS)
def test_generated_kernel_is_bitwise_fbgemm(optimizer, pooling, weighted, id_dtype, buckets=None):
    dims = [ROWS_WIDTH] * len(ROWS) if pooling == "none" else DIMS
    reference, ours = _tbe(optimizer, pooling, dims=dims), _tbe(optimizer, pooling, dims=dims)
    kernel = _generated(ours, weighted, buckets=buckets)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        if step == 2:  # the fused optimizer's learning rate changes between steps (an LR scheduler)
            reference.set_learning_rate(0.05)
            ours.set_learning_rate(0.05)
        kjt, ids, offsets, weights = _batch(gen, weighted, id_dtype)
        grad = (torch.randn(ids.numel(), ROWS_WIDTH, generator=gen) if pooling == "none" else
                torch.randn(BATCH, sum(DIMS[t] for t in FEATURE_TABLE), generator=gen))
        expected = reference(ids, offsets, per_sample_weights=weights)
        expected.backward(grad)
        got = kernel(kjt)
        got.backward(grad)
        assert torch.equal(expected, got), f"forward, step {step}"
        assert torch.equal(reference.weights_host, ours.weights_host), f"weights after step {step}"
        if optimizer != "sgd":
            assert torch.equal(reference.momentum1_host, ours.momentum1_host), f"optimizer state after step {step}"
    assert (ours.step, int(ours.iter)) == (reference.step, int(reference.iter))


@pytest.mark.parametrize("buckets", [None, [["t0", "t1"], ["t2", "t3"]]])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("optimizer", HOST_OPTIMIZERS)
def test_generated_rows_per_id_are_bitwise_fbgemm(optimizer, id_dtype, buckets):
    """An EmbeddingCollection's lookups: no pooling, a row per id (one width, as TorchRec requires;
    12 floats: not a multiple of the 8-float vector), its gradient per id."""
    test_generated_kernel_is_bitwise_fbgemm(optimizer, "none", False, id_dtype, buckets=buckets)


def test_rows_per_id_with_per_sample_weights_have_no_kernel():
    # (fbgemm itself refuses rows per id of several widths)
    with pytest.raises(Unsupported, match=r"rows per id of widths \[12\] with per-sample weights"):
        spec_of(_tbe("sgd", "none", dims=[ROWS_WIDTH] * len(ROWS)), True, True)


@pytest.mark.parametrize("buckets", [[["t0", "t1"], ["t2", "t3"]], [["t3"], ["t1", "t0"], ["t2"]]])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_buckets_of_tables_run_concurrently_and_stay_bitwise_fbgemm(optimizer, buckets):
    test_generated_kernel_is_bitwise_fbgemm(optimizer, "mean", True, torch.int64, buckets=buckets)


def test_buckets_must_hold_every_table_of_the_kernel():
    with pytest.raises(Unsupported, match=r"tables \['t3'\] are in none of the buckets"):
        _generated(_tbe("sgd", "sum"), False, buckets=[["t0", "t1"], ["t2"]])
    with pytest.raises(ValueError, match="exactly once"):
        replace(spec_of(_tbe("sgd", "sum"), False, True), buckets=((0, 1), (1, 2, 3)))


def test_the_second_build_of_a_source_loads_it_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSELIFT_KERNEL_CACHE", str(tmp_path))
    source = cpu_source(spec_of(_tbe("sgd", "sum"), False, True))
    cold = build_lookup(source)
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))  # a cache hit compiles nothing
    warm = build_lookup(source)
    assert (cold.cached, warm.cached, warm.key) == (False, True, cold.key)
    other = cpu_source(spec_of(_tbe("sgd", "mean"), False, True))
    with pytest.raises(Unsupported, match="did not build"):
        build_lookup(other)


def test_a_build_that_was_killed_does_not_block_the_next_one(tmp_path, monkeypatch):
    import threading

    monkeypatch.setenv("SPARSELIFT_KERNEL_CACHE", str(tmp_path))
    source = cpu_source(spec_of(_tbe("sgd", "sum"), False, True))
    folder = Path(build_lookup(source).path).parent
    # what a build killed while compiling leaves: cpp_extension's lock file, no library, no marker
    for leftover in folder.iterdir():
        if leftover.name not in ("kernel.cpp", "build.lock"):
            leftover.unlink() if leftover.is_file() else shutil.rmtree(leftover)
    (folder / "lock").write_text("")
    done: list = []
    worker = threading.Thread(target=lambda: done.append(build_lookup(source)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert done and not done[0].cached, "the build waited for a lock nobody holds"


@pytest.mark.parametrize("buckets", [None, [["t0", "t1"], ["t2", "t3"]]])
def test_an_out_of_range_id_is_an_error_when_no_input_check_ran(buckets):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    # (in buckets, the bad id is in the second one, which another thread runs)
    kernel = _generated(_tbe("sgd", "sum"), False, check_ids=True, buckets=buckets)
    lengths = torch.ones(len(FEATURE_TABLE) * BATCH, dtype=torch.long)
    ids = torch.zeros(lengths.numel(), dtype=torch.long)
    ids[BATCH * 4 + 2] = ROWS[3]  # one past table 3's last row
    with pytest.raises(IndexError, match=f"id {ROWS[3]} at position {BATCH * 4 + 2}"):
        kernel(KeyedJaggedTensor(keys=[f"f{i}" for i in range(5)], values=ids, lengths=lengths))


def test_a_backward_stopped_by_an_out_of_range_id_leaves_the_next_steps_bitwise_fbgemm():
    reference, ours = _tbe("sgd", "sum"), _tbe("sgd", "sum")
    kernel = _generated(ours, False, check_ids=True)
    gen = torch.Generator().manual_seed(3)
    kjt, ids, offsets, _ = _batch(gen, False, torch.int64)
    grad = torch.randn(BATCH, sum(DIMS[t] for t in FEATURE_TABLE), generator=gen)
    # a backward whose last id is one past table 3's rows stops there, after tables 0-2 took their
    # slots (which the next steps must find free again); a zero gradient leaves the weights as they are
    bad = kjt.values().clone()
    bad[-1] = ROWS[3]
    zero = torch.zeros(BATCH, sum(DIMS[t] for t in FEATURE_TABLE))
    assert kernel.backward(BATCH, bad, kjt.offsets(), None, zero) == bad.numel() - 1
    assert torch.equal(reference.weights_host, ours.weights_host)
    for step in range(2):
        kjt, ids, offsets, _ = _batch(gen, False, torch.int64)
        expected = reference(ids, offsets)
        expected.backward(grad)
        got = kernel(kjt)
        got.backward(grad)
        assert torch.equal(expected, got) and torch.equal(reference.weights_host, ours.weights_host), f"step {step}"


def _host_adam(pooling: str, lr: float, **kwargs):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation, PoolingMode

    from lightning_sparselift.runtime.codegen.host_adam import HostAdamTableBatch

    torch.manual_seed(0)
    dims = [ROWS_WIDTH] * len(ROWS) if pooling == "none" else DIMS
    tbe = HostAdamTableBatch([(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in zip(ROWS, dims)],
                             feature_table_map=FEATURE_TABLE, optimizer=EmbOptimType.ADAM, learning_rate=lr,
                             eps=1e-6, beta1=0.9, beta2=0.99, pooling_mode={"sum": PoolingMode.SUM,
                             "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}[pooling], **kwargs)
    tbe.weights_host.data.normal_()
    return tbe


def _reference_lookup(tables: list[torch.Tensor], ids, offsets, weights, pooling: str) -> torch.Tensor:
    """fbgemm's lookup in float64 through torch's embedding_bag (feature-major offsets)."""
    out = []
    for f, t in enumerate(FEATURE_TABLE):
        begin, end = int(offsets[f * BATCH]), int(offsets[(f + 1) * BATCH])
        bags = (offsets[f * BATCH:(f + 1) * BATCH] - begin).long()
        feature_ids = ids[begin:end].long()
        if pooling == "none":
            out.append(tables[t][feature_ids])
            continue
        out.append(torch.nn.functional.embedding_bag(
            feature_ids, tables[t], bags, mode=pooling,
            per_sample_weights=None if weights is None else weights[begin:end].double()))
    return torch.cat(out, dim=0 if pooling == "none" else 1)


@pytest.mark.parametrize("pooling, weighted, id_dtype", [("sum", True, torch.int64), ("mean", False, torch.int32),
                                                         ("none", False, torch.int64)])
def test_generated_adam_on_host_tables_matches_torch_optim_adam_on_the_touched_rows(pooling, weighted, id_dtype):
    """fbgemm's Adam is lazy: a step moves only the rows its ids touch, with the module's step count
    in the bias corrections. Four steps (duplicate ids, empty bags, an LR change) of the generated
    kernel on HostAdamTableBatch (fbgemm has no CPU Adam to compare bitwise) against float64
    pooling and torch.optim.Adam run on the touched rows of a copy."""
    tbe = _host_adam(pooling, lr=0.01)
    betas, eps = (tbe.optimizer_args.beta1, tbe.optimizer_args.beta2), tbe.optimizer_args.eps
    tables = [t.detach().double().clone() for t in tbe.split_embedding_weights()]
    m1 = [torch.zeros_like(t) for t in tables]
    m2 = [torch.zeros_like(t) for t in tables]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        lr = 0.01 if step < 3 else 0.005
        tbe.set_learning_rate(lr)
        _, ids, offsets, weights = _batch(gen, weighted, id_dtype)
        leaves = [t.clone().requires_grad_() for t in tables]
        expected = _reference_lookup(leaves, ids, offsets, weights, pooling)
        grad = torch.randn(expected.shape, generator=gen)
        got = tbe(ids.to(id_dtype), offsets.to(id_dtype), per_sample_weights=weights)
        torch.testing.assert_close(got.double(), expected.detach(), rtol=1e-5, atol=1e-5)
        got.backward(grad)
        expected.backward(grad.double())
        for t, leaf in enumerate(leaves):
            touched = torch.unique(ids[offsets[FEATURE_TABLE.index(t) * BATCH]:
                                       offsets[(len(FEATURE_TABLE) - FEATURE_TABLE[::-1].index(t)) * BATCH]])
            param = torch.nn.Parameter(tables[t][touched].float())
            param.grad = leaf.grad[touched].float()
            adam = torch.optim.Adam([param], lr=lr, betas=betas, eps=eps, foreach=False)
            adam.state[param] = {"step": torch.tensor(float(step - 1)), "exp_avg": m1[t][touched].float(),
                                 "exp_avg_sq": m2[t][touched].float()}
            adam.step()
            tables[t][touched] = param.detach().double()
            m1[t][touched] = adam.state[param]["exp_avg"].double()
            m2[t][touched] = adam.state[param]["exp_avg_sq"].double()
        states = tbe.split_optimizer_states()
        for t, weights_now in enumerate(tbe.split_embedding_weights()):
            torch.testing.assert_close(weights_now.double(), tables[t], rtol=1e-5, atol=1e-5, msg=f"table {t}")
            torch.testing.assert_close(states[t][0].double().view_as(m1[t]), m1[t], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(states[t][1].double().view_as(m2[t]), m2[t], rtol=1e-5, atol=1e-7)
    assert int(tbe.iter) == 4 and tbe.get_optimizer_state()[0].keys() == {"exp_avg", "exp_avg_sq"}
    assert "iter" in tbe.state_dict() and "momentum2_host" in tbe.state_dict()


@pytest.mark.parametrize("kwargs, reason", [
    (dict(weight_decay=0.01), "weight decay"),
    (dict(optimizer_name="LAMB"), "optimizer lamb"),
    (dict(optimizer_name="ADAM"), "Adam on host tables without Adam's second moment"),
])
def test_configurations_without_a_generated_kernel_say_why(kwargs, reason):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    name = kwargs.pop("optimizer_name", None)
    if name:
        tbe = _tbe("sgd", "sum")
        tbe.optimizer = EmbOptimType[name]  # (fbgemm builds no Adam or LAMB table on CPU: no state for them)
    else:
        tbe = _tbe("sgd", "sum", **kwargs)
    with pytest.raises(Unsupported, match=reason):
        spec_of(tbe, False, True)


# ------------------------------------------------------------------------------------------ the pass

def _with_generated(graph, groups=None):
    for module in graph.modules:
        for group in module.groups:
            if groups is None or group.index in groups:
                group.lookup_kernels.append(GENERATED_KERNEL)
            else:
                group.lookup_notes[GENERATED_KERNEL] = "rank 1: a DenseTableBatchedEmbeddingBagsCodegen"
    return graph


def _lookup_candidates(codegen: CodeGeneration, graph) -> list:
    return [c for c in codegen.candidates(graph) if c.role == "lookup"]


def test_codegen_proposes_only_groups_with_a_kernel_on_every_rank():
    codegen = CodeGeneration()
    graph = load("table_and_column_wise_2ranks")
    (unprobed,) = _lookup_candidates(codegen, graph)
    assert not unprobed.feasible and all("no generated kernel was built" in r for r in unprobed.reasons)
    with pytest.raises(InfeasibleCandidate):
        codegen.apply(graph, unprobed)
    graph = _with_generated(graph, groups={0})
    (candidate,) = _lookup_candidates(codegen, graph)
    assert candidate.feasible and candidate.cost_inputs["groups"] == 1 and candidate.cost_inputs["ids"] > 0
    applied = codegen.apply(graph, candidate)
    kernels = [applied.module(EBC).schedule.region("lookup", g).kernel for g in (0, 1)]
    assert kernels == [GENERATED_KERNEL, "torchrec"]
    assert "reference kernel kept for g1: rank 1: a DenseTableBatchedEmbeddingBagsCodegen" in applied.provenance[-1]
    assert _lookup_candidates(codegen, applied)[0].reasons == ["already scheduled"]
    # the probe is machine-specific: it does not change the graph's structure
    assert applied.fingerprint() != graph.fingerprint() and _with_generated(load("table_and_column_wise_2ranks")) \
        .fingerprint() == load("table_and_column_wise_2ranks").fingerprint()


def test_codegen_applies_on_one_rank_without_exchanges():
    graph = _with_generated(load("table_wise_1rank"))
    (candidate,) = _lookup_candidates(CodeGeneration(), graph)
    applied = CodeGeneration().apply(graph, candidate)
    assert _lookup_candidates(CodeGeneration(), applied)[0].reasons == ["already scheduled"]
    assert "lookup=generated" in applied.explain()


@pytest.mark.parametrize("rows", [False, True])
def test_the_lookup_region_counts_the_lookup_call_and_its_backward_node_only(rows):
    """(``rows``: an EmbeddingCollection's lookup, whose output is a view of its kernels' flat
    outputs, concatenated)"""
    from lightning_sparselift.cost.calibration import RegionClock

    class Busy(torch.autograd.Function):  # a lookup whose forward and backward each take CPU time
        @staticmethod
        def forward(ctx, x):
            _spin(0.02)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            _spin(0.03)
            return grad * 2

    clock = RegionClock(torch.device("cpu"))
    x = torch.ones(3, requires_grad=True)
    start = time.perf_counter()
    with clock.lookup():
        out = Busy.apply(x)
        if rows:
            out = torch.cat([out.view(-1), torch.zeros(3)]).view(-1, 3)
    clock.lookup_backward(out)
    forward = clock.lookup_ms
    _spin(0.05)  # outside both regions
    time.sleep(0.03)  # wall time only, outside both regions
    (out * 3).sum().backward()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    cpu, wall = clock.take_lookup()
    assert 18 < forward < 40 and 45 < cpu < 80 and clock.take_lookup() == (0.0, 0.0)
    # (bounds that hold on a loaded machine too: the outside spin and sleep took >= 80 ms of wall time)
    assert cpu - 1 < wall < elapsed_ms - 80


def test_the_lookup_wall_clock_counts_work_on_other_threads_once():
    """Buckets on threads of their own: the training thread's CPU misses their work, the wall
    clock sees the region's duration (what subgraph parallelism is measured by)."""
    import threading

    from lightning_sparselift.cost.calibration import RegionClock

    clock = RegionClock(torch.device("cpu"))
    start = time.perf_counter()
    with clock.lookup():
        other = threading.Thread(target=time.sleep, args=(0.04,))
        other.start()
        _spin(0.04)
        other.join()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    cpu, wall = clock.take_lookup()
    # the other thread's 40 ms are in the wall time, once: at most the region's own duration (not CPU + sleep)
    assert 30 < cpu < 60 and 38 < wall <= elapsed_ms


def _spin(seconds: float) -> None:
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _build_in_process(source: str, cache: str, out) -> None:
    import os

    os.environ["SPARSELIFT_KERNEL_CACHE"] = cache
    out.put(build_lookup(source).key)


def test_ranks_building_the_same_source_at_once_both_load_it(tmp_path):
    import multiprocessing as mp

    source = cpu_source(spec_of(_tbe("sgd", "sum"), True, True))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(source, str(tmp_path), out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    assert out.get(timeout=5) == out.get(timeout=5)
    assert len(list(tmp_path.iterdir())) == 1
