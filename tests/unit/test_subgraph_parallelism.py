"""Subgraph parallelism on small graphs (process-free): the partition of a group's tables into
buckets, feasibility and its reasons, and the sweep over G that the planner runs (each rung only
after the one before it improved)."""

from __future__ import annotations

import pytest

from graph_fixtures import EBC, four_tables_two_ranks, generated, load
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.ir.graph import TableShard
from lightning_sparselift.ir.schedule import GENERATED_KERNEL, check_schedule
from lightning_sparselift.passes import InfeasibleCandidate, select_passes
from lightning_sparselift.passes.subgraph_parallelism import SubgraphParallelism, partition
from lightning_sparselift.plan import PlanFingerprint, Planner, PlanningLoop


def _eight_tables() -> SparseGraph:
    """One rank, one table-wise group of eight tables; table k's feature brings 10 * (k + 1) ids per step."""
    graph = load("table_wise_1rank")
    module = graph.module(EBC)
    group = module.groups[0]
    template = group.tables[0]
    group.tables = [TableShard(f"t{k}", 0, 100, template.dim, 0, 0, template.kernel, template.pooling, [f"f{k}"])
                    for k in range(8)]
    group.features = [f"f{k}" for k in range(8)]
    module.ids_per_step = [{f"f{k}": 10.0 * (k + 1) for k in range(8)}]
    return generated(graph)


def test_tables_are_balanced_over_the_buckets_by_ids_times_dim():
    graph = _eight_tables()
    module = graph.module(EBC)
    buckets = partition(module, module.groups[0], 2)
    weights = {f"t{k}": k + 1 for k in range(8)}
    loads = sorted(sum(weights[t] for t in b) for b in buckets)
    assert loads == [18, 18] and sorted(t for b in buckets for t in b) == sorted(weights)
    assert len(partition(module, module.groups[0], 8)) == 8
    # a table sharded over ranks is in one bucket (the schedule names buckets by table on every rank)
    two_ranks = load("table_and_column_wise_2ranks")
    column_wise = two_ranks.module(EBC).groups[1]
    assert partition(two_ranks.module(EBC), column_wise, 2) == [["t_c"]]


def test_buckets_apply_to_groups_with_a_generated_kernel_where_a_rank_holds_two_tables():
    sweep = SubgraphParallelism()
    graph = load("table_wise_1rank")
    first = sweep.candidates(graph)[0]
    assert not first.feasible and "no generated lookup kernel" in first.reasons[0]
    with pytest.raises(InfeasibleCandidate):
        sweep.apply(graph, first)
    graph = generated(graph)
    two, four, eight = sweep.candidates(graph)[:3]  # (then the pipelined rungs)
    assert [c.role for c in (two, four, eight)] == ["buckets2", "buckets4", "buckets8"]
    assert (two.follows, four.follows, eight.follows) == (None, two.id, four.id)
    applied = sweep.apply(graph, two)
    region = applied.module(EBC).schedule.region("lookup", 0)
    # t_b brings 12 ids per step, t_a 8: the heavier table is placed first
    assert (region.kernel, region.buckets) == (GENERATED_KERNEL, [["t_b"], ["t_a"]])
    assert "in 2 concurrent buckets" in applied.explain() and "g0 in 2 concurrent buckets" in applied.provenance[-1]
    # two tables make at most two buckets: four is what two already is
    assert sweep.candidates(applied)[1].reasons == ["already scheduled"]
    # one thread on every rank: the buckets would run one after the other
    graph.threads_per_rank = [1]
    assert sweep.candidates(graph)[0].reasons == [
        "every rank runs 1 intra-op thread (torch.get_num_threads()): buckets would run one after the other"]
    # each table on its own rank: nothing runs side by side
    spread = generated(load("table_and_column_wise_2ranks"))
    assert sweep.candidates(spread)[0].reasons == ["g0 (table_wise): no rank holds two of its tables",
                                                   "g1 (column_wise): no rank holds two of its tables"]


def test_the_schedule_refuses_buckets_a_generated_lookup_cannot_run():
    graph = _eight_tables()
    schedule = graph.module(EBC).schedule
    region = schedule.region("lookup", 0)
    region.buckets = [["t0", "t1"], ["t2"]]
    assert any("only a generated lookup runs them" in p for p in check_schedule(schedule, ["table_wise"], 1))
    region.kernel = GENERATED_KERNEL
    assert check_schedule(schedule, ["table_wise"], 1) == []
    region.buckets = [["t0", "t1"], ["t1"]]
    assert any("not two or more disjoint" in p for p in check_schedule(schedule, ["table_wise"], 1))


def _lookup_wall_ms(graph: SparseGraph) -> float:
    """Lookups that take 12 ms on one thread, 7 in two buckets, 7.5 in four and 4 in eight."""
    region = graph.module(EBC).schedule.region("lookup", 0)
    return {0: 12.0, 2: 7.0, 4: 7.5, 8: 4.0}[len(region.buckets)]


def test_the_sweep_goes_up_while_each_g_improves_on_the_one_before_and_stops_at_the_first_that_does_not():
    graph = _eight_tables()
    passes = ["codegen", "subgraph_parallelism"]
    fingerprint = PlanFingerprint(graph.fingerprint(), "sharding", 1, "gloo", {}, passes)
    loop = PlanningLoop(Planner(select_passes(passes), None, calibrate=True), fingerprint, graph, None)
    loop.propose()
    tried = []
    while not loop.done:
        trial = loop.next_graph()
        if trial is not loop.incumbent:
            tried.append(trial.provenance[-1].split(":")[0])
        lookup = 10.0 if trial.module(EBC).schedule.region("lookup", 0).kernel == GENERATED_KERNEL else 14.0
        loop.feedback(50.0, 20.0, lookup, _lookup_wall_ms(trial))
    decisions = {d.candidate.split("@")[0]: d for d in loop.plan.decisions}
    # code generation first (the pass the buckets build on), then G = 2, 4, 8 in order
    assert list(dict.fromkeys(tried)) == ["codegen", "subgraph_parallelism"]
    assert decisions["codegen:lookup"].accepted and decisions["subgraph_parallelism:buckets2"].accepted
    assert decisions["subgraph_parallelism:buckets2"].measured_ms == pytest.approx(-5.0)
    # four buckets measured against two: slower, so eight (faster than one, but not tried) is not
    assert not decisions["subgraph_parallelism:buckets4"].accepted
    assert decisions["subgraph_parallelism:buckets4"].measured_ms == pytest.approx(0.5)
    eight = decisions["subgraph_parallelism:buckets8"]
    assert not eight.accepted and eight.measured_ms is None and "the sweep stopped" in eight.reason
    assert len(loop.plan.graph.module(EBC).schedule.region("lookup", 0).buckets) == 2


def _sweep(incumbent: int, wall_ms: dict[int, float]) -> tuple[dict, int]:
    """A planning round of code generation and subgraph parallelism whose incumbent plan ran
    ``incumbent`` buckets, the lookups taking ``wall_ms[G]`` (G = 0: one bucket); the decisions by
    candidate and the G planned."""
    graph = _eight_tables()
    graph.incumbent_buckets = {EBC: incumbent}
    passes = ["codegen", "subgraph_parallelism"]
    fingerprint = PlanFingerprint(graph.fingerprint(), "sharding", 1, "gloo", {}, passes)
    loop = PlanningLoop(Planner(select_passes(passes), None, calibrate=True), fingerprint, graph, None)
    loop.propose()
    while not loop.done:
        region = loop.next_graph().module(EBC).schedule.region("lookup", 0)
        loop.feedback(50.0, 20.0, 10.0 if region.kernel == GENERATED_KERNEL else 14.0, wall_ms[len(region.buckets)])
    decisions = {d.candidate.split("@")[0].removeprefix("subgraph_parallelism:"): d for d in loop.plan.decisions}
    return decisions, len(loop.plan.graph.module(EBC).schedule.region("lookup", 0).buckets)


def test_the_sweep_starts_at_the_incumbents_g_and_goes_both_ways():
    sweep = SubgraphParallelism()
    graph = _eight_tables()
    graph.incumbent_buckets = {EBC: 4}
    two, four, eight = sweep.candidates(graph)[:3]  # (then the pipelined rungs)
    assert (four.follows, eight.follows, eight.when) == (None, four.id, "accepted")
    assert (two.follows, two.when, two.unless) == (four.id, "decided", eight.id)  # the turn
    ordered, _ = Planner([sweep], None, calibrate=True).propose(graph)
    assert [c.role for c in ordered] == ["buckets4", "buckets8", "buckets2"]
    graph.incumbent_buckets = {EBC: 8}  # the top of the ladder: it turns down at once
    two, four, eight = sweep.candidates(graph)[:3]  # (then the pipelined rungs)
    assert (eight.follows, four.follows, four.when, two.follows) == (None, eight.id, "decided", four.id)
    # 8 improves on 4: the sweep does not turn, 2 is not tried
    decisions, planned = _sweep(4, {0: 12.0, 2: 7.0, 4: 6.0, 8: 5.0})
    assert decisions["buckets4"].accepted and decisions["buckets8"].accepted and planned == 8
    assert "the sweep went the other way: subgraph_parallelism:buckets8" in decisions["buckets2"].reason
    # 8 does not improve on 4: down to 2, measured against 4
    decisions, planned = _sweep(4, {0: 12.0, 2: 7.0, 4: 7.5, 8: 8.0})
    assert [decisions[r].accepted for r in ("buckets4", "buckets8", "buckets2")] == [True, False, True]
    assert decisions["buckets2"].measured_ms == pytest.approx(-0.5) and planned == 2
    # 4 does not improve on one bucket: up is not tried, 2 is measured against one bucket
    decisions, planned = _sweep(4, {0: 12.0, 2: 10.0, 4: 12.5, 8: 4.0})
    assert not decisions["buckets4"].accepted and "the sweep stopped" in decisions["buckets8"].reason
    assert decisions["buckets2"].measured_ms == pytest.approx(-2.0) and planned == 2
    # from 8: down while each G improves (4 on 8), stopping at 2 (slower than 4)
    decisions, planned = _sweep(8, {0: 12.0, 2: 9.0, 4: 6.0, 8: 7.0})
    assert [decisions[r].measured_ms for r in ("buckets8", "buckets4", "buckets2")] == pytest.approx([-5, -1, 3])
    assert planned == 4
    # without calibration a sweep does not turn: the rungs up from the start are applied
    planner = Planner([sweep], None, calibrate=False)
    graph.incumbent_buckets = {EBC: 4}
    loop = PlanningLoop(planner, PlanFingerprint(graph.fingerprint(), "s", 1, "gloo", {}, []), graph, None)
    loop.propose()
    assert len(loop.plan.graph.module(EBC).schedule.region("lookup", 0).buckets) == 8
    assert "a sweep turns on measurements only" in {d.role: d for d in loop.plan.decisions}["buckets2"].reason


def test_a_replan_starts_the_sweep_from_the_installed_plans_buckets():
    graph = _eight_tables()
    assert graph.lookup_buckets() == {}
    applied = SubgraphParallelism().apply(graph, SubgraphParallelism().candidates(graph)[1])  # G = 4
    assert applied.lookup_buckets() == {EBC: 4}
    applied.incumbent_buckets = applied.lookup_buckets()
    assert f"planned from lookups in 4 buckets ({EBC})" in applied.explain()
    assert applied.fingerprint() == SparseGraph.from_dict({**applied.to_dict(), "incumbent_buckets": {EBC: 4}}
                                                          ).fingerprint()  # the run's, not the structure's


def test_a_rung_selected_alone_stands_alone_and_one_after_an_infeasible_rung_is_not_tried():
    graph = _eight_tables()
    planner = Planner(select_passes(["subgraph_parallelism:buckets4"]), None, calibrate=True)
    (four,), rejected = planner.propose(graph)
    assert four.role == "buckets4" and four.follows is None and not rejected
    two_tables = generated(load("table_and_column_wise_2ranks"))
    feasible, rejected = Planner(select_passes(["subgraph_parallelism"]), None, calibrate=True).propose(two_tables)
    assert not feasible and [d.candidate.split("@")[0] for d in rejected] == [
        f"subgraph_parallelism:{family}{g}" for family in ("buckets", "pipelined") for g in (2, 4, 8)]


def test_the_buckets_scratch_held_at_once_must_fit_the_workspace_budget():
    graph = _eight_tables()
    graph.threads_per_rank = [4]
    dim = graph.module(EBC).groups[0].tables[0].dim
    scratch = 80 * (56 + 4 * dim)  # t7's 80 ids per step: the largest table's backward scratch
    sweep = SubgraphParallelism()
    two, four, eight = sweep.candidates(graph)[:3]  # (then the pipelined rungs)
    # beyond the calling thread's: one more thread's scratch with 2 buckets, 3 more with 4 (and with 8, on 4 threads)
    assert [c.cost_inputs["workspace_bytes"] for c in (two, four, eight)] == [scratch, 3 * scratch, 3 * scratch]
    assert two.feasible and four.feasible  # no budget: no limit
    graph.workspace_budget_bytes = 2 * scratch
    two, four, eight = sweep.candidates(graph)[:3]  # (then the pipelined rungs)
    assert two.feasible and not four.feasible and not eight.feasible
    assert four.reasons == [f"the buckets hold {3 * scratch / 1024:.2f}KB more backward scratch at once on rank 0 (a "
                            f"scratch per thread running one) than the workspace budget of {2 * scratch / 1024:.2f}KB "
                            f"(workspace_budget_mb)"]
    assert "workspace budget" in graph.explain() and SparseGraph.from_dict(graph.to_dict()) == graph
    # the budget is the run's, not the graph's structure: a plan made under another one still matches it
    assert graph.fingerprint() == _eight_tables().fingerprint()


def test_on_gpus_the_buckets_run_on_streams_whatever_the_threads_and_hold_no_more_workspace():
    graph = _eight_tables()
    graph.device, graph.threads_per_rank = "cuda", [1]
    graph.workspace_budget_bytes = 0
    two, four, eight = SubgraphParallelism().candidates(graph)[:3]
    assert two.feasible and four.feasible and eight.feasible
    assert [c.cost_inputs["workspace_bytes"] for c in (two, four, eight)] == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------------------------ pipelined buckets

def _rungs(graph: SparseGraph) -> dict[str, object]:
    return {c.role: c for c in SubgraphParallelism().candidates(graph)}


def test_pipelined_buckets_split_a_groups_all_to_all_over_process_groups_of_their_own():
    graph = four_tables_two_ranks()
    rungs = _rungs(graph)
    # one thread per rank: nothing runs side by side, but the buckets' exchanges can overlap the
    # next bucket's lookups
    assert not rungs["buckets2"].feasible and "buckets would run one after the other" in rungs["buckets2"].reasons[0]
    two = rungs["pipelined2"]
    assert two.feasible and (two.follows, rungs["pipelined4"].follows) == (None, two.id)
    assert SubgraphParallelism().protocol_for("pipelined2").region == "step"
    assert SubgraphParallelism().protocol_for("buckets2").region == "lookup_wall"
    assert two.cost_inputs["groups"] == 1.0  # g1's one table is one bucket
    applied = SubgraphParallelism().apply(graph, two)
    module = applied.module(EBC)
    # each rank's tables cut in output order at half their weight (t0 4 ids | t1 8, t2 12 | t3 16), so that
    # every bucket's columns on a rank are one run
    assert module.schedule.region("lookup", 0).buckets == [["t0", "t2"], ["t1", "t3"]]
    assert module.groups[0].bucket_columns([["t0", "t2"], ["t1", "t3"]]) == [[[0, 1, 2, 3]] * 2, [[4, 5, 6, 7]] * 2]
    assert module.schedule.outputs[0].split == ["bucket0", "bucket1"] and module.schedule.outputs[1].split == []
    assert check_schedule(module.schedule, module.kinds, 2) == []
    assert "g0 in 2 pipelined buckets, each all-to-all on its own process group" in applied.provenance[-1]
    text = applied.explain()
    assert "one per bucket on bucket0, bucket1" in text and "lookup g0 in 2 pipelined buckets: t0,t2 | t1,t3" in text
    # the step's collectives: one per bucket each way, on its process group, the bytes split by columns
    before = [n for n in graph.collectives() if n.module == EBC and n.groups == [0] and n.role in
              ("output_pooled", "grad_pooled")]
    after = [n for n in applied.collectives() if n.module == EBC and n.groups == [0] and n.role in
             ("output_pooled", "grad_pooled")]
    assert [(n.role, n.process_group) for n in after] == [
        ("output_pooled", "bucket0[2]"), ("output_pooled", "bucket1[2]"),
        ("grad_pooled", "bucket0[2]"), ("grad_pooled", "bucket1[2]")]
    for role in ("output_pooled", "grad_pooled"):
        whole, = [n.bytes_per_member for n in before if n.role == role]
        halves = [n.bytes_per_member for n in after if n.role == role]
        assert [sum(b) for b in zip(*halves)] == whole and halves[0] == halves[1]
    # what merges the exchanges would undo the split, and the split is already there
    merge = {c.role: c for c in select_passes(["aggregation"])[0].candidates(applied)}["output"]
    assert any("pipelined (subgraph parallelism): merging would undo it" in r for r in merge.reasons)
    assert _rungs(applied)["pipelined2"].reasons == ["already scheduled"]
    assert SparseGraph.from_dict(applied.to_dict()) == applied


def test_pipelined_buckets_are_infeasible_with_their_reasons():
    graph = four_tables_two_ranks()
    merged = select_passes(["aggregation"])[0]
    merged = merged.apply(graph, {c.role: c for c in merged.candidates(graph)}["output"])
    assert _rungs(merged)["pipelined2"].reasons == [
        "g0 (table_wise): its output all-to-all carries g0+g1 together (aggregation)",
        "g1 (column_wise): its output all-to-all carries g0+g1 together (aggregation)"]
    # each table on its own rank (the fixture as it is): nothing to pipeline
    assert _rungs(generated(load("table_and_column_wise_2ranks")))["pipelined2"].reasons == [
        "g0 (table_wise): no rank holds tables of two buckets", "g1 (column_wise): no rank holds tables of two buckets"]
    one_rank_holds_all = four_tables_two_ranks()
    for t in one_rank_holds_all.module(EBC).groups[0].tables:
        t.rank = 0
    assert "g0 (table_wise): some rank holds none of its tables" in _rungs(one_rank_holds_all)["pipelined2"].reasons
    no_kernel = load("table_and_column_wise_2ranks")
    assert "no generated lookup kernel" in _rungs(no_kernel)["pipelined2"].reasons[0]
    older = four_tables_two_ranks()
    older.module(EBC).groups[0].output_blocks = []
    assert "g0 (table_wise): the graph records no output blocks per rank (lifted by an older version)" in \
        _rungs(older)["pipelined2"].reasons
    cuda = four_tables_two_ranks()
    cuda.device = "cuda"
    assert "device tables" in _rungs(cuda)["pipelined2"].reasons[0]
    assert _rungs(_eight_tables())["pipelined2"].reasons == ["one rank: no all-to-all to pipeline"]
    budget = four_tables_two_ranks()
    pieces = 4 * (2 * 8 * 8 + 8 * 16)  # rank 0's output sent once more, the module's 16 columns received once more
    assert _rungs(budget)["pipelined2"].cost_inputs["workspace_bytes"] == pieces
    budget.workspace_budget_bytes = pieces - 1
    assert "all-to-all pieces hold" in _rungs(budget)["pipelined2"].reasons[0]


def test_the_schedule_refuses_a_split_the_runtime_cannot_run():
    graph = four_tables_two_ranks()
    applied = SubgraphParallelism().apply(graph, _rungs(graph)["pipelined2"])
    schedule = applied.module(EBC).schedule
    schedule.outputs[0].split = ["bucket0", "bucket0"]
    assert any("buckets share a process group" in p for p in check_schedule(schedule, ["table_wise", "column_wise"], 2))
    schedule.outputs[0].split = ["bucket0", "bucket1", "bucket2"]
    assert any("its lookup region has 2 buckets" in p for p in check_schedule(schedule, ["table_wise", "column_wise"],
                                                                              2))
    schedule.outputs[1].split = ["bucket0"]
    assert any("output g1 split over 1 process groups" in p for p in
               check_schedule(schedule, ["table_wise", "column_wise"], 2))


def test_with_one_thread_per_rank_the_pipelined_rungs_are_measured_on_whole_steps_and_rejected_when_no_faster():
    graph = four_tables_two_ranks()
    passes = ["codegen:lookup", "subgraph_parallelism"]
    fingerprint = PlanFingerprint(graph.fingerprint(), "sharding", 2, "gloo", {}, passes)
    loop = PlanningLoop(Planner(select_passes(passes), None, calibrate=True), fingerprint, graph, None)
    loop.propose()
    while not loop.done:
        trial = loop.next_graph()
        region = trial.module(EBC).schedule.region("lookup", 0)
        generated = region.kernel == GENERATED_KERNEL
        # pipelining changes nothing the step waits for here: the same step time with noise either way
        step = 50.0 + (0.3 if loop.plan.calibration_steps % 2 else -0.3)
        loop.feedback(step, 20.0, 10.0 if generated else 14.0, 10.0 if generated else 14.0)
    decisions = {d.candidate.split("@")[0].removeprefix("subgraph_parallelism:"): d for d in loop.plan.decisions}
    two = decisions["pipelined2"]
    assert two.measured_ms is not None and not two.accepted, two.reason
    assert "the sweep stopped" in decisions["pipelined4"].reason
    assert "every rank runs 1 intra-op thread" in decisions["buckets2"].reason
    assert not loop.plan.graph.module(EBC).schedule.outputs[0].split
    assert "reject     subgraph_parallelism:pipelined2" in loop.plan.explain()


def test_the_kernels_in_buckets_are_asked_for_the_rungs_that_can_run_and_a_failed_build_says_why():
    from lightning_sparselift.passes.subgraph_parallelism import bucket_kernel
    from lightning_sparselift.session.lifting import mark_generated
    from lightning_sparselift.plan.types import KernelBuild

    sweep = SubgraphParallelism()
    graph = four_tables_two_ranks(kernels=False)
    assert sweep.kernels_to_build(graph) == {}  # (no one-bucket kernel yet: no rung can run)
    for group in graph.module(EBC).groups:
        group.lookup_kernels.append(GENERATED_KERNEL)
    # one thread per rank: only the pipelined rungs; four tables over two ranks make two buckets at any G
    wanted = sweep.kernels_to_build(graph)
    assert [(r.groups, r.buckets) for r in wanted[EBC]] == [([0], [["t0", "t2"], ["t1", "t3"]])]
    pipelined = [c for c in sweep.candidates(graph) if c.role == "pipelined2"][0]
    assert not pipelined.feasible and "not built yet" in pipelined.reasons[0]
    tables = wanted[EBC][0].buckets
    built = graph.copy()
    mark_generated(built, [KernelBuild(EBC, 0, r, "", 1.0, False, 2, tables) for r in range(2)])
    assert built.module(EBC).groups[0].built_buckets == [tables] and sweep.kernels_to_build(built) == {}
    assert [c for c in sweep.candidates(built) if c.role == "pipelined2"][0].feasible
    mark_generated(graph, [KernelBuild(EBC, 0, 0, "", 1.0, False, 2, tables),
                           KernelBuild(EBC, 0, 1, "the compiler failed", 0.0, False, 2, tables)])
    assert graph.module(EBC).groups[0].lookup_notes[bucket_kernel(tables)] == "rank 1: the compiler failed"
    assert sweep.kernels_to_build(graph) == {}  # (not asked again)
    pipelined = [c for c in sweep.candidates(graph) if c.role == "pipelined2"][0]
    assert pipelined.reasons == ["g0 (table_wise): no generated lookup kernel in these 2 buckets: "
                                 "rank 1: the compiler failed"]


def test_a_kernel_in_buckets_is_built_for_the_next_rung_of_a_sweep_and_only_for_a_predicted_gain():
    import types

    from lightning_sparselift.session.kernel_builds import buckets_asked, buckets_to_build

    graph = _eight_tables()
    graph.threads_per_rank = [2]
    graph.module(EBC).groups[0].built_buckets.clear()  # (the one-bucket kernel built, none in buckets yet)
    passes = select_passes(["codegen", "subgraph_parallelism:buckets2", "subgraph_parallelism:buckets4"])
    gains = types.SimpleNamespace(increment_ms=lambda before, after: -1.0)
    wanted, declined = buckets_to_build(passes, graph, buckets_asked(passes, graph), gains, accepted=set())
    # the sweep starts at two buckets: four are tried only after two were accepted
    assert [len(r.buckets) for r in wanted[EBC]] == [2] and declined == []
    wanted, _ = buckets_to_build(passes, graph, buckets_asked(passes, graph), gains,
                                 accepted={f"subgraph_parallelism:buckets2@{EBC}"})
    assert [len(r.buckets) for r in wanted[EBC]] == [2, 4]
    loses = types.SimpleNamespace(increment_ms=lambda before, after: 0.5)
    wanted, declined = buckets_to_build(passes, graph, buckets_asked(passes, graph), loses, accepted=set())
    assert wanted == {} and [(path, len(r.buckets), why) for path, r, why in declined] == [
        (EBC, 2, f"not built: the step-time model predicts +0.500 ms for subgraph_parallelism:buckets2@{EBC} (a kernel "
                 f"in buckets is built for a predicted gain)")]
    # without a model (a round without calibration applies every rung at once): every rung's
    assert [len(r.buckets) for r in buckets_asked(passes, graph)[EBC]] == [2, 4]
