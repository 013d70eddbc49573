"""The step-time model on small graphs (process-free): what each schedule the passes write does to
the predicted step, from hand-made inputs (graph_fixtures.step_model: 0.05 ms + 10 ns/byte per
all-to-all, copies at 100 MB/s)."""

from __future__ import annotations

import json

import pytest

from graph_fixtures import EBC, ITEM, USER, four_tables_two_ranks, generated, load, step_model
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.ir.graph import TableShard
from lightning_sparselift.ir.schedule import GENERATED_KERNEL, INPUT_REGIONS
from lightning_sparselift.passes import select_passes
from lightning_sparselift.plan import ExecutionPlan, PlanFingerprint, Planner

ALPHA, BETA = 0.05, 1e-5


def _applied(graph: SparseGraph, candidate_id: str, optimizations: list[str]) -> SparseGraph:
    planner = Planner(select_passes(optimizations), None, calibrate=True)
    (candidate,) = [c for c in planner.propose(graph)[0] if c.id == candidate_id]
    return planner.apply(graph, candidate)


@pytest.mark.parametrize("window_ms", [0.0, 0.02, 0.04, 1.0])
def test_an_early_start_hides_its_all_to_alls_behind_the_dense_compute_around_the_module(window_ms):
    two = load("two_modules_2ranks")
    early = _applied(two, f"latency_hiding:early_start@{USER}", ["latency_hiding"])
    model = step_model(two, window_ms=window_ms)
    # the pooled all-to-all (128 B per member) behind the forward's window, its gradient behind
    # backward's (twice as long)
    t = ALPHA + 128 * BETA
    assert model.increment_ms(two, early) == pytest.approx(-(min(t, window_ms) + min(t, 2 * window_ms)))
    prediction = model.predict(early)
    assert prediction.step_ms == pytest.approx(100.0 + model.increment_ms(two, early))
    assert prediction.hidden_ms == pytest.approx(min(t, window_ms) + min(t, 2 * window_ms))


def test_the_slowest_rank_gates_each_collective():
    two = load("two_modules_2ranks")
    early = _applied(two, f"latency_hiding:early_start@{USER}", ["latency_hiding"])
    even, skewed = step_model(two, window_ms=1.0), step_model(two, window_ms=1.0)
    # rank 1 reaches the module 1 ms after rank 0: rank 0 waits for it at the first collective, and
    # the step is as long as it is when both take 1 ms
    skewed.inputs.timings.window_ms[USER] = [0.0, 1.0]
    assert skewed.predict(two).sparse_ms == pytest.approx(even.predict(two).sparse_ms)
    # rank 0 has no dense compute to hide its all-to-all behind, but rank 1, which it waits for, has
    t = ALPHA + 128 * BETA
    assert skewed.increment_ms(two, early) == pytest.approx(even.increment_ms(two, early)) == pytest.approx(-2 * t)


def test_next_batch_hides_the_payload_not_the_splits_exchange():
    graph = load("table_and_column_wise_2ranks")
    ahead = _applied(graph, f"latency_hiding:next_batch@{EBC}", ["latency_hiding"])
    model = step_model(graph)
    payload = [n for n in graph.collectives() if n.role in ("input_lengths", "input_values")]
    assert model.increment_ms(graph, ahead) == pytest.approx(
        -sum(ALPHA + max(n.bytes_per_member) * BETA for n in payload))


def _eight_tables(threads: int) -> SparseGraph:
    """One rank, one table-wise group of eight tables of dim 4, 100 ids each per step, a generated kernel."""
    graph = load("table_wise_1rank")
    module = graph.module(EBC)
    group = module.groups[0]
    template = group.tables[0]
    group.tables = [TableShard(f"t{k}", 0, 100, 4, 0, 0, template.kernel, template.pooling, [f"f{k}"])
                    for k in range(8)]
    group.features = [f"f{k}" for k in range(8)]
    group.features_per_rank = [8]
    group.embedding_dims = [4] * 8
    group.embedding_names = [f"t{k}" for k in range(8)]
    module.ids_per_step = [{f"f{k}": 100.0 for k in range(8)}]
    graph.threads_per_rank = [threads]
    return generated(graph)


@pytest.mark.parametrize("cores, threads, expected", [(1.0, 4, 1.0), (4.0, 4, 2.0), (4.0, 1, 1.0), (8.0, 8, 2.0)])
def test_concurrent_buckets_run_side_by_side_on_as_many_threads_and_cores_as_there_are(cores, threads, expected):
    graph = _eight_tables(4)
    generated = _applied(graph, f"codegen:lookup@{EBC}", ["codegen"])
    buckets = _applied(generated, f"subgraph_parallelism:buckets2@{EBC}", ["codegen", "subgraph_parallelism"])
    for g in (graph, generated, buckets):  # (the threads the rank runs: the pass proposes buckets on 2 or more)
        g.threads_per_rank = [threads]
    model = step_model(graph, cores=cores)
    # 800 ids x 4 columns x 4 bytes: forward half a copy, the generated backward one
    lookups = (0.5 + 1.0) * 2 * 800 * 16 / 1e5
    assert model.increment_ms(generated, buckets) == pytest.approx(lookups / expected - lookups)


def test_a_pipelined_buckets_all_to_all_overlaps_the_next_buckets_lookups():
    graph = four_tables_two_ranks()
    generated = _applied(graph, f"codegen:lookup@{EBC}", ["codegen"])
    pipelined = _applied(generated, f"subgraph_parallelism:pipelined2@{EBC}", ["codegen", "subgraph_parallelism"])
    # copies at 100 B/ms: a bucket's lookups take far longer than any all-to-all here
    model = step_model(graph, bandwidth_bytes_per_ms=100.0, window_ms=0.0)

    def a2a(node) -> float:
        return ALPHA + max(node.bytes_per_member) * BETA

    (whole,) = [n for n in generated.collectives() if n.role == "output_pooled" and n.groups == [0]]
    (grad,) = [n for n in generated.collectives() if n.role == "grad_pooled" and n.groups == [0]]
    first, second = [n for n in pipelined.collectives("forward") if n.bucket is not None]
    grads = [n for n in pipelined.collectives("backward") if n.bucket is not None]
    assert (first.bucket, second.bucket, len(grads)) == (0, 1, 2)
    (other,) = [n for n in generated.collectives() if n.role == "output_pooled" and n.groups == [1]]
    assert a2a(other) < a2a(second)
    # forward: the first bucket's all-to-all runs behind the second bucket's lookups, the second's behind
    # g1's exchange (on the world's process group; each bucket has its own) and then is waited for;
    # backward: each bucket's gradient all-to-all is waited for where it is issued
    assert model.predict(generated).hidden_ms == 0.0
    assert model.predict(pipelined).hidden_ms == pytest.approx(a2a(first) + a2a(other))
    assert model.increment_ms(generated, pipelined) == pytest.approx(
        -a2a(whole) + (a2a(second) - a2a(other)) + sum(a2a(n) for n in grads) - a2a(grad))


def test_a_generated_lookup_reads_the_touched_rows_once_in_backward_where_the_reference_reads_them_twice():
    graph = _eight_tables(1)
    generated = _applied(graph, f"codegen:lookup@{EBC}", ["codegen"])
    assert step_model(graph).increment_ms(graph, generated) == pytest.approx(-2 * 800 * 16 / 1e5)


def test_the_lookups_cost_what_the_capture_steps_measured_of_torchrecs():
    graph = _eight_tables(1)
    generated = _applied(graph, f"codegen:lookup@{EBC}", ["codegen"])
    model = step_model(graph)
    model.inputs.timings.lookup_ms = {EBC: [5.0]}  # TorchRec's lookups: 5 ms forward and backward
    # forward half a pass, backward two (the reference) or one (generated): the generated lookups
    # take 1.5 / 2.5 of the 5 ms
    assert model.increment_ms(graph, generated) == pytest.approx(-5.0 * (1 - 1.5 / 2.5))


def test_a_plan_records_the_model_and_its_file_keeps_it(tmp_path):
    two = load("two_modules_2ranks")
    early = _applied(two, f"latency_hiding:early_start@{USER}", ["latency_hiding"])
    model = step_model(two)
    model.inputs.reference_input_ms = {f"{USER}/g0/recat": [0.25, 0.5]}
    plan = ExecutionPlan(PlanFingerprint(two.fingerprint(), "sharding", 2, "gloo", {}, ["latency_hiding"]), early,
                         step_model=model.record(early))
    assert plan.predicted_change_ms == pytest.approx(model.increment_ms(two, early))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = ExecutionPlan.load(str(path))
    assert loaded.step_model == plan.step_model
    text = loaded.explain()
    assert "step-time model: all_to_all_single on world[2]: alpha 0.050 ms + 10.000 ms/MB" in text
    assert f"change {plan.predicted_change_ms:+.3f} ms" in text
    assert f"TorchRec's input kernels {USER}/g0/recat 0.25/0.50" in text
    assert json.loads(path.read_text())["step_model"]["inputs"]["timings"]["window_ms"][USER] == [1.0, 1.0]


def test_torchrecs_input_regions_cost_what_the_probe_timed_and_the_generated_kernel_its_bytes():
    graph = load("two_modules_2ranks")
    graph.module(ITEM).input_kernels = [GENERATED_KERNEL]
    generated = _applied(graph, f"codegen:input@{ITEM}", ["codegen"])
    regions = [n.id for n in graph.nodes if n.module == ITEM and n.op in INPUT_REGIONS]
    assert len(regions) == 4  # permute, a bucketize, two recats

    def model(timed_ms):
        m = step_model(graph)
        m.inputs.reference_input_ms = {} if timed_ms is None else {r: [timed_ms] * 2 for r in regions}
        return m

    # each region's timed ms on the reference side only (were the generated kernel priced by it
    # too, the gain would not move with it): the generated kernel's stays its bytes
    assert model(3.0).increment_ms(graph, generated) - model(1.0).increment_ms(graph, generated) == \
        pytest.approx(-2.0 * len(regions))
    assert model(1.0).increment_ms(graph, generated) != pytest.approx(model(None).increment_ms(graph, generated))
