"""The simulator on a small workload (the ``tiny`` bench scenario, counted on one process): its
graphs at world sizes that never ran come from the lifter, its predictions are the step-time
model's own, and the planner decides by the model alone."""

from __future__ import annotations

import json

import pytest

from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.simulate import report
from lightning_sparselift.simulate.cli import main
from lightning_sparselift.simulate.profile import DEFAULT_PROFILE, HardwareProfile
from lightning_sparselift.simulate.scaling import offered_types, scaled_graph
from lightning_sparselift.simulate.simulator import dense_step, model_inputs, simulate_world
from lightning_sparselift.simulate.workload import workload_from_scenario


@pytest.fixture(scope="module")
def tiny():
    return workload_from_scenario("tiny", 64)


@pytest.fixture(scope="module")
def gpu():
    return HardwareProfile.load(DEFAULT_PROFILE)


def test_the_workload_counts_the_dense_step_and_captures_the_inputs(tiny):
    assert tiny.forward_flops > 0 and tiny.backward_flops > tiny.forward_flops
    assert tiny.forward_kernels > 0 and tiny.backward_kernels > 0
    (path,) = tiny.module_paths
    capture = tiny.capture.modules[path]
    assert capture.batch_size == 64 and capture.batch_input is not None
    scaled = tiny.capture_at(3, 16, 256).modules[path]
    assert scaled.batch_size == 256
    assert sum(f.ids_per_step for f in scaled.features.values()) == pytest.approx(
        4 * sum(f.ids_per_step for f in capture.features.values()), rel=0.01)


def test_a_scaled_graph_is_the_lifters_graph_of_the_planners_placement(tiny, gpu):
    graph = scaled_graph(tiny, 16, 128, gpu)
    assert graph.world_size == 16 and graph.backend == "nccl" and graph.device == "cuda"
    (m,) = graph.modules
    assert m.batch_size_per_rank == [128] * 16
    for g in m.groups:
        assert g.sharding_type in offered_types(10**6, 64, 16, 6, gpu)
        for t in g.tables:
            assert t.rank is None or 0 <= t.rank < 16
    # every collective's bytes are per member of the 16 ranks
    assert all(len(n.bytes_per_member) == 16 for n in graph.collectives())


def test_the_dense_all_reduce_takes_the_backend_cpu_per_mb_where_the_ranks_share_cores(tiny):
    """DDP hides the all-reduce behind the backward, but on ranks without a spare core its
    backend's reduction takes the training thread's core: its bytes are charged as the sparse
    path's collectives are (the profile's per-MB; 0 on a profile with spare cores)."""
    import copy

    from lightning_sparselift.simulate.simulator import all_reduce_bytes

    profile = copy.deepcopy(HardwareProfile.load(DEFAULT_PROFILE))
    graph = scaled_graph(tiny, 2, 64, profile)
    assert profile.backend_cpu_ms_per_mb == 0.0
    spare = dense_step(tiny, graph, profile, 64)
    profile.backend_cpu_ms_per_mb = 2.0
    shared = dense_step(tiny, graph, profile, 64)
    assert all_reduce_bytes(tiny, graph) >= tiny.dense_param_bytes > 0
    assert shared.exposed_all_reduce - spare.exposed_all_reduce == pytest.approx(
        2.0 * all_reduce_bytes(tiny, graph) / 1e6)
    assert shared.all_reduce == spare.all_reduce  # (the link's time is the link's)


def test_row_wise_and_data_parallel_are_offered_within_the_estimate_budget(gpu):
    assert set(offered_types(10**6, 128, 8, 26, gpu)) == {"table_wise", "column_wise", "row_wise", "data_parallel"}
    # beyond it: row-wise only for a table no rank holds
    assert set(offered_types(10**6, 128, 1024, 26, gpu)) == {"table_wise", "column_wise"}
    assert "row_wise" in offered_types(10**9, 128, 1024, 26, gpu)


@pytest.mark.parametrize("world", [2, 16])
def test_the_predictions_are_the_step_time_models(tiny, gpu, world):
    result = simulate_world(tiny, world, 128, gpu)
    graph = scaled_graph(tiny, world, 128, gpu)
    model = StepModel(model_inputs(graph, dense_step(tiny, graph, gpu, 128), gpu), graph)
    identity = model.predict(graph)
    assert result.identity_model == identity
    assert result.identity.step == pytest.approx(identity.step_ms)
    assert result.plan.step <= result.identity.step
    for d in result.decisions:
        if d.accepted:
            assert d.predicted_ms < 0 and "accepted by the model" in d.reason
    assert [d.candidate for d in result.decisions if d.accepted] == result.accepted


def test_strong_scaling_splits_the_global_batch_and_rejects_an_uneven_split(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["--scenario", "tiny", "--ranks", "2,4", "--global-batch", "256", "--json", str(out),
                 "--plot", str(tmp_path / "sim.png"), "--explain", "4"]) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == report.SCHEMA and "model output" in data["note"]
    assert [(w["world"], w["batch_per_rank"]) for w in data["worlds"]] == [(2, 128), (4, 64)]
    assert (tmp_path / "sim.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "4 ranks, 64 samples per rank (model output)" in printed and "decisions:" in printed
    with pytest.raises(SystemExit):
        main(["--scenario", "tiny", "--ranks", "3", "--global-batch", "256"])
    assert "does not split evenly over [3] ranks" in capsys.readouterr().err


def test_a_profile_fitted_on_a_run_keeps_its_links_and_times_the_dense_step_here(tmp_path):
    from pathlib import Path

    from lightning_sparselift.simulate.fit import read_run

    run = Path(__file__).parents[1] / "fixtures" / "step_model" / "dlrm_run1.json"
    profile_path = tmp_path / "cpu.yaml"
    assert main(["fit-profile", "--run", str(run), "--scenario", "dlrm", "--step-latency-us", "450",
                 "--out", str(profile_path)]) == 0
    profile = HardwareProfile.load(str(profile_path))
    inputs, graph, _ = read_run(run)
    assert profile.device.kind == "cpu" and profile.device.dense == "timed"
    assert profile.measured["world_size"] == graph.world_size == 2
    # the run's all-to-all's bandwidth and a collective's latency in a step, as the simulator
    # prices them at the run's world size; the run's alpha (after a barrier) is recorded beside
    link = profile.all_to_all(2, "world[2]")
    assert link.alpha_ms == pytest.approx(0.45)
    assert profile.measured["probed_alpha_us"] == pytest.approx(inputs.links[0].alpha_ms * 1e3)
    assert link.beta_ms_per_byte == pytest.approx(inputs.links[0].beta_ms_per_byte)
    assert profile.bandwidth_bytes_per_ms == pytest.approx(inputs.bandwidth_bytes_per_ms)


def test_one_process_has_no_collective_latency_to_measure():
    from lightning_sparselift.cost.priors import measure_step_latency

    assert measure_step_latency(None) == 0.0


def test_fit_profile_refuses_a_negative_step_latency(capsys):
    with pytest.raises(SystemExit):
        main(["fit-profile", "--run", "plan.json", "--scenario", "dlrm", "--step-latency-us", "-1", "--out", "x.yaml"])
    assert "--step-latency-us must be >= 0" in capsys.readouterr().err


def test_a_fitted_profile_reproduces_the_step_of_the_run_it_was_fitted_on():
    """What the run's step took beyond the simulated one joins the per-MB term of its collectives,
    so the simulator, on the profile it fitted, predicts that run's step (the workload's timings as
    recorded, so that the check does not move with the machine)."""
    from pathlib import Path

    from lightning_sparselift.simulate.fit import fit_profile, read_run
    from lightning_sparselift.simulate.validation import read_timings
    from lightning_sparselift.simulate.workload import workload_from_scenario

    fixtures = Path(__file__).parents[1] / "fixtures" / "simulate"
    run = fixtures / "runs" / "dlrm_run1.json"
    inputs, graph, _ = read_run(run)
    batch = max(max(m.batch_size_per_rank) for m in graph.modules)
    workload = read_timings(fixtures / "timings.json")[f"dlrm@{batch}"].onto(workload_from_scenario("dlrm", batch))
    profile = fit_profile(run, workload, "fitted")
    assert profile.backend_cpu_ms_per_mb >= profile.measured["backend_cpu_ms_per_mb"] > 0
    captured = max(inputs.timings.step_ms)
    predicted = simulate_world(workload, graph.world_size, batch, profile).identity.step
    assert predicted == pytest.approx(max(captured, profile.measured["simulated_step_ms_before_fit"]), rel=0.02)


def test_a_timed_profile_needs_a_timed_workload(tiny):
    profile = HardwareProfile.load("cpu-2core-measured")
    with pytest.raises(ValueError, match="the workload was not timed"):
        simulate_world(tiny, 2, 64, profile)


def test_fit_profile_reads_a_plan_file_as_it_reads_a_recorded_run(tmp_path):
    """A plan file (``plan_path``) carries the model's inputs and its identity prediction."""
    from pathlib import Path

    from lightning_sparselift.bench.model_error import RecordedRun
    from lightning_sparselift.cost.step_model import StepModel
    from lightning_sparselift.ir import SparseGraph
    from lightning_sparselift.plan.types import ExecutionPlan, PlanFingerprint
    from lightning_sparselift.simulate.fit import read_run

    recorded = Path(__file__).parents[1] / "fixtures" / "step_model" / "dlrm_run1.json"
    run = RecordedRun.from_dict(json.loads(recorded.read_text()))
    identity = SparseGraph.from_dict(run.identity)
    record = StepModel(run.inputs, identity).record(identity)
    plan = ExecutionPlan(PlanFingerprint(identity.fingerprint(), "0" * 16, identity.world_size, identity.backend,
                                         dict(identity.versions), []), identity, step_model=record)
    plan.save(tmp_path / "plan.json")
    inputs, graph, sparse_ms = read_run(tmp_path / "plan.json")
    assert inputs == run.inputs and graph.fingerprint() == identity.fingerprint()
    assert sparse_ms == pytest.approx(read_run(recorded)[2])
    with pytest.raises(ValueError, match="neither a plan file nor a recorded bench run"):
        (tmp_path / "other.json").write_text("{}")
        read_run(tmp_path / "other.json")


def _timed(workload, lookup_ms: float, step_ms: float):
    """``workload`` as a profile of this machine would time it (made-up timings)."""
    import copy

    from lightning_sparselift.simulate.one_rank import OneRankTiming
    from lightning_sparselift.simulate.workload import DenseTiming

    timed = copy.copy(workload)
    timed._scaled = {}
    timed.timed = DenseTiming(0.3, 0.4, {p: 0.1 for p in workload.module_paths}, 1, 0.1)
    timed.one_rank = OneRankTiming(step_ms, {p: lookup_ms for p in workload.module_paths}, 1)
    return timed


def test_a_timed_profile_predicts_the_one_rank_step_it_timed_and_scales_its_lookups(tiny):
    """On a profile of this machine TorchRec's step timed at one rank is the prediction there; at
    more ranks its lookups scale the byte model's as a run's captured lookups do, and what the
    step took beyond the model's parts (host work) is added."""
    from lightning_sparselift.simulate.simulator import one_rank_terms, rest_of_step

    profile = HardwareProfile.load("cpu-2core-measured")
    (path,) = tiny.module_paths
    slow, fast = _timed(tiny, 2.0, 5.0), _timed(tiny, 1.0, 5.0)
    assert simulate_world(slow, 1, 64, profile).identity.step == pytest.approx(5.0)
    scale, host = one_rank_terms(slow, profile)
    assert scale[path] == pytest.approx(2 * one_rank_terms(fast, profile)[0][path])
    # the host term is what the timed step leaves: the slower lookups leave less of it
    assert host == pytest.approx(one_rank_terms(fast, profile)[1] - 1.0)
    graph = scaled_graph(slow, 2, 64, profile)
    dense = rest_of_step(slow, graph, profile, 64)
    inputs = model_inputs(graph, dense, profile)
    modelled = StepModel(inputs, graph).reference_lookup_ms(graph)[path]
    assert inputs.timings.lookup_ms[path] == pytest.approx([ms * scale[path] for ms in modelled])
    two = simulate_world(slow, 2, 64, profile)
    assert two.identity.host == pytest.approx(host) and two.identity.step > two.identity.host


def test_torchrecs_step_is_timed_at_one_rank_in_a_process_group_of_its_own(tiny):
    import torch.distributed as dist

    from lightning_sparselift.simulate.workload import workload_from_scenario

    timed = workload_from_scenario("tiny", 32, threads=1)
    (path,) = timed.module_paths
    assert timed.one_rank.step_ms > 0 and timed.one_rank.lookup_ms[path] > 0 and timed.one_rank.threads == 1
    assert not dist.is_initialized()  # (the group it made is gone)
