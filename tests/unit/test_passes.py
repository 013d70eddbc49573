"""The optimization passes in one process, on small lifted graphs loaded from JSON fixtures (no
ranks, no runtime; the way TorchRec tests its planner on meta-device models): each pass's
candidates (feasibility, the exact reasons, cost inputs from the derived collectives), what
``apply`` makes of a copy's schedule and of the collectives derived from it, provenance, the
ensures-check, and the graph's fingerprint and JSON form.

Fixtures (tests/fixtures/graphs):

- table_and_column_wise_2ranks: one module, table-wise g0 (a, b) and column-wise g1 (c in two
  column shards), batch 8 per rank, 8 ids per key and step, input in the root's arguments and
  in the announced batch;
- table_wise_1rank: one rank, one table-wise group: nothing is exchanged;
- row_wise_and_data_parallel_3ranks: three ranks, weighted, row-wise g0 (u, v) and
  data-parallel g1 (w), keys permuted into group order, batch 4 per rank;
- two_modules_2ranks: model.user_ebc (one table-wise group, input in the root's arguments) and
  model.item_ebc (column-wise g0, row-wise g1, int32 lengths, input computed by the model).
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter

import pytest

from lightning_sparselift.ir import (
    InputExchange, OutputExchange, ScheduleError, SparseGraph, check_schedule, identity_schedule,
)
from lightning_sparselift.passes import Candidate
from lightning_sparselift.passes.aggregation import CommunicationAggregation
from lightning_sparselift.passes.latency_hiding import LatencyHiding

from graph_fixtures import COMPUTED_INPUT, EBC, FIXTURES, ITEM, NOT_IN_BATCH, NOTHING_TO_MERGE, USER, load

NAMES = ["table_and_column_wise_2ranks", "table_wise_1rank", "row_wise_and_data_parallel_3ranks", "two_modules_2ranks"]
AGG, LH = CommunicationAggregation(), LatencyHiding()
MC, RF, PS = "module_call", "root_forward", "previous_step"
MCB, LB, DDP = "module_call_backward", "lookup_backward", "ddp_backward"


def candidate(graph: SparseGraph, cid: str) -> Candidate:
    p = AGG if cid.startswith("aggregation:") else LH
    (found,) = [c for c in p.candidates(graph) if c.id == cid]
    return found


def apply(graph: SparseGraph, cid: str) -> SparseGraph:
    c = candidate(graph, cid)
    assert c.feasible, c.reasons
    return (AGG if c.pass_name == "aggregation" else LH).apply(graph, c)


def collectives(graph: SparseGraph, module: str) -> list[tuple[str, str, str, list[int]]]:
    """The module's derived collectives in order: (id after the module path, issue, wait, bytes per member)."""
    return [(n.id[len(module) + 1:], n.issue, n.wait, n.bytes_per_member) for n in graph.collectives()
            if n.module == module]


def roles(graph: SparseGraph) -> Counter:
    return Counter(n.role for n in graph.collectives())


# ------------------------------------------------------------------------------------------ fixtures

@pytest.mark.parametrize("name", NAMES)
def test_fixtures_are_identity_graphs_in_the_current_schema(name):
    text = (FIXTURES / f"{name}.json").read_text()
    graph = load(name)
    assert graph.to_dict() == json.loads(text)  # nothing the schema dropped or added
    assert graph.version == 3 and graph.provenance == []
    for m in graph.modules:  # what lifting gives: TorchRec's own step
        assert m.schedule == identity_schedule(m.kinds, graph.world_size, bool(m.feature_order))
        assert check_schedule(m.schedule, m.kinds, graph.world_size) == []


def test_the_identity_schedules_and_their_collectives():
    rw = load("row_wise_and_data_parallel_3ranks")
    s = rw.module(EBC).schedule
    assert (s.lookup_at, s.inputs, s.outputs) == (MC, [InputExchange([0], "per_tensor", MC)],
                                                  [OutputExchange([0], "reduce_scatter", MC)])
    assert [(r.name, r.groups, r.kernel) for r in s.regions] == [
        ("permute", [], "torchrec"), ("bucketize", [0], "fbgemm"), ("recat", [0], "fbgemm"),
        ("lookup", [0], "torchrec"), ("lookup", [1], "torchrec"), ("output", [], "torchrec")]
    # 3 ranks, batch 4, weighted; ids per step by member: u+v = 9, 12, 6
    assert collectives(rw, EBC) == [
        ("g0/input_splits", MC, MC, [96] * 3),  # 3 destinations x 4 tensors x 8 bytes
        ("g0/input_lengths", MC, MC, [192] * 3),  # 2 keys x 3 row blocks x 4 samples x int64
        ("g0/input_values", MC, MC, [72, 96, 48]),  # ids x int64
        ("g0/input_weights", MC, MC, [36, 48, 24]),  # ids x float32
        ("g0/output_partial_sums", MC, MC, [384] * 3),  # 12 samples x 8 columns x float32
        ("g0/grad_all_gather", MCB, MCB, [128] * 3),  # 4 samples x 8 columns x float32
        ("g1/table_grad_all_reduce", DDP, DDP, [80] * 3)]  # t_w: 5 x 4 x float32
    assert [n.id for n in rw.collectives()][-1] == "dense/grad_all_reduce"
    assert load("table_wise_1rank").collectives() == []  # one rank: not even DDP's all-reduce
    # two modules: forward module by module, backward in reverse, then DDP
    two = load("two_modules_2ranks")
    assert [(n.order, n.id) for n in two.collectives() if n.phase == "backward"] == [
        (12, f"{ITEM}/g1/grad_all_gather"), (13, f"{ITEM}/g0/grad_pooled"), (14, f"{USER}/g0/grad_pooled"),
        (15, "dense/grad_all_reduce")]
    assert [n.order for n in two.collectives()] == list(range(16))
    assert two.collectives("forward")[-1].id == f"{ITEM}/g1/output_partial_sums"


# ------------------------------------------------------------------------------------------ candidates

# per fixture, every candidate in proposal order: (id, feasible, reasons, cost inputs); the cost
# inputs are sums of the derived collectives' bytes (the largest over members)
CANDIDATES = {
    "table_and_column_wise_2ranks": [
        # 2 splits + 2 x (lengths, values) -> splits + payload; copied: 4 x 128 B (2 keys x 8 samples x int64, 16 ids)
        (f"aggregation:input@{EBC}", True, [], {"collectives_removed": 4, "packed_bytes": 512}),
        # pooled g0 256 + g1 128, gradients the same
        (f"aggregation:output@{EBC}", True, [], {"collectives_removed": 2, "packed_bytes": 768}),
        (f"latency_hiding:early_start@{EBC}", True, [], {"hidden_bytes": 768, "hidden_collectives": 4}),
        (f"latency_hiding:next_batch@{EBC}", True, [], {"hidden_bytes": 512, "hidden_collectives": 4}),
    ],
    "table_wise_1rank": [
        (f"aggregation:input@{EBC}", False, ["one rank: nothing is exchanged"],
         {"collectives_removed": 0, "packed_bytes": 0}),
        (f"aggregation:output@{EBC}", False, ["one rank: nothing is exchanged"],
         {"collectives_removed": 0, "packed_bytes": 0}),
        (f"latency_hiding:early_start@{EBC}", False, ["one rank: no all-to-all to hide"],
         {"hidden_bytes": 0, "hidden_collectives": 0}),
        (f"latency_hiding:next_batch@{EBC}", False, ["one rank: no all-to-all to hide"],
         {"hidden_bytes": 0, "hidden_collectives": 0}),
    ],
    "row_wise_and_data_parallel_3ranks": [
        # splits, lengths, values, weights -> splits + payload; member 1: 192 + 96 + 48
        (f"aggregation:input@{EBC}", True, [], {"collectives_removed": 2, "packed_bytes": 336}),
        (f"aggregation:output@{EBC}", False, [NOTHING_TO_MERGE.format(0)], {"collectives_removed": 0, "packed_bytes": 0}),
        (f"latency_hiding:early_start@{EBC}", False, [
            "no output all-to-all (only row-wise reduce-scatters or data-parallel groups): nothing asynchronous to "
            "overlap"],
         {"hidden_bytes": 0, "hidden_collectives": 0}),
        (f"latency_hiding:next_batch@{EBC}", True, [], {"hidden_bytes": 336, "hidden_collectives": 3}),
    ],
    "two_modules_2ranks": [
        # splits, lengths, values -> 2; member 0: 2 keys x 4 samples x int64 + 14 ids x int64
        (f"aggregation:input@{USER}", True, [], {"collectives_removed": 1, "packed_bytes": 176}),
        (f"aggregation:output@{USER}", False, [NOTHING_TO_MERGE.format(1)],
         {"collectives_removed": 0, "packed_bytes": 256}),
        # member 0: column-wise 32 (2 keys x 4 x int32) + 128 (x twice: 16 ids), row-wise 32 (1 key x 2 blocks x 4) + 40
        (f"aggregation:input@{ITEM}", True, [], {"collectives_removed": 4, "packed_bytes": 232}),
        (f"aggregation:output@{ITEM}", False, [NOTHING_TO_MERGE.format(1)],
         {"collectives_removed": 0, "packed_bytes": 128}),
        (f"latency_hiding:early_start@{USER}", True, [], {"hidden_bytes": 256, "hidden_collectives": 2}),
        (f"latency_hiding:next_batch@{USER}", True, [], {"hidden_bytes": 176, "hidden_collectives": 2}),
        # the reduce-scatter / all-gather of the row-wise group are never hidden, its input distribution is
        (f"latency_hiding:early_start@{ITEM}", False, [COMPUTED_INPUT], {"hidden_bytes": 128, "hidden_collectives": 2}),
        (f"latency_hiding:next_batch@{ITEM}", False, [NOT_IN_BATCH], {"hidden_bytes": 232, "hidden_collectives": 4}),
    ],
}


@pytest.mark.parametrize("name", NAMES)
def test_candidates_with_their_feasibility_reasons_and_cost_inputs(name):
    graph = load(name)
    found = [(c.id, c.feasible, c.reasons, c.cost_inputs) for p in (AGG, LH) for c in p.candidates(graph)]
    assert found == CANDIDATES[name]
    for c in AGG.candidates(graph) + LH.candidates(graph):
        assert c.feasible == (not c.reasons)
        assert (c.pass_name, c.name, c.role) == (c.id.split(":")[0], f"{c.role}@{c.module}", c.name.split("@")[0])


def test_aggregation_needs_one_process_group_stream_and_point():
    graph = load("table_and_column_wise_2ranks")
    s = graph.module(EBC).schedule
    s.inputs[1].process_group = "sparse_input"
    s.outputs[1].stream = "comm"
    assert [(c.role, c.reasons) for c in AGG.candidates(graph)] == [
        ("input", ["different process groups/streams [('sparse_input', ''), ('world', '')]"]),
        ("output", ["different process groups/streams [('world', ''), ('world', 'comm')]"])]
    graph = apply(load("table_and_column_wise_2ranks"), f"latency_hiding:early_start@{EBC}")
    graph.module(EBC).schedule.outputs[1].wait = RF  # valid: waited at the lookups, the other in flight
    assert check_schedule(graph.module(EBC).schedule, ["table_wise", "column_wise"], 2) == []
    assert candidate(graph, f"aggregation:output@{EBC}").reasons == [
        "buckets waited at different points ['module_call', 'root_forward']"]


# ------------------------------------------------------------------------------------------ aggregation

def test_aggregating_the_input_packs_every_group_into_one_payload():
    before = load("table_and_column_wise_2ranks")
    snapshot = before.to_dict()
    after = apply(before, f"aggregation:input@{EBC}")
    assert before.to_dict() == snapshot and before.provenance == []  # the input graph is not modified
    s, s0 = after.module(EBC).schedule, before.module(EBC).schedule
    assert s.inputs == [InputExchange([0, 1], "bytes", MC, process_group="world", stream=None)]
    assert (s.lookup_at, s.outputs, s.regions) == (s0.lookup_at, s0.outputs, s0.regions)
    assert after.provenance == [f"aggregation: input collectives of {EBC} merged (6 -> 2)"]
    assert roles(before) - roles(after) == Counter(input_splits=1, input_lengths=2, input_values=2)
    assert roles(after) - roles(before) == Counter(input_payload=1)
    # per destination: 8 ids x int64 + 1 key x 8 samples x int64, twice: 256 B, already aligned
    assert collectives(after, EBC)[:2] == [("g0+g1/input_splits", MC, MC, [48 + 48] * 2),
                                           ("g0+g1/input_payload", MC, MC, [128 * 4] * 2)]
    assert collectives(after, EBC)[2:] == collectives(before, EBC)[6:]  # outputs and gradients as they were
    assert after.fingerprint() != before.fingerprint()


def test_aggregating_the_output_merges_the_pooled_all_to_alls_and_their_gradients():
    before = load("table_and_column_wise_2ranks")
    after = apply(before, f"aggregation:output@{EBC}")
    s = after.module(EBC).schedule
    assert s.outputs == [OutputExchange([0, 1], "all_to_all_single", MC, process_group="world", stream=None)]
    assert s.inputs == before.module(EBC).schedule.inputs
    assert after.provenance == [f"aggregation: output collectives of {EBC} merged (4 -> 2)"]
    assert roles(after) == Counter(input_splits=2, input_lengths=2, input_values=2, output_pooled=1, grad_pooled=1,
                                   dense_grad=1)
    assert collectives(after, EBC)[6:] == [("g0+g1/output_pooled", MC, MC, [256 + 128] * 2),
                                           ("g0+g1/grad_pooled", MCB, MCB, [256 + 128] * 2)]


def test_aggregating_a_weighted_row_wise_input_pads_each_destination_chunk():
    before = load("row_wise_and_data_parallel_3ranks")
    after = apply(before, f"aggregation:input@{EBC}")
    s = after.module(EBC).schedule
    assert s.inputs == [InputExchange([0], "bytes", MC)]
    assert s.outputs == [OutputExchange([0], "reduce_scatter", MC)]
    assert after.provenance == [f"aggregation: input collectives of {EBC} merged (4 -> 2)"]
    parts = [sum(b[r] for (_, _, _, b) in collectives(before, EBC)[1:4]) for r in range(3)]  # lengths+values+weights
    assert parts == [300, 336, 264]
    # per destination: ids/3 x (int64 + float32) + 2 keys x 4 samples x int64, padded to 8 bytes:
    # member 0: 3 x 12 + 64 = 100 -> 104; member 1: 4 x 12 + 64 = 112; member 2: 2 x 12 + 64 = 88
    assert collectives(after, EBC) == [("g0/input_splits", MC, MC, [96] * 3),
                                       ("g0/input_payload", MC, MC, [3 * 104, 3 * 112, 3 * 88]),
                                       *collectives(before, EBC)[4:]]
    assert [a - b for a, b in zip(collectives(after, EBC)[1][3], parts)] == [12, 0, 0]
    assert roles(after) == Counter(input_splits=1, input_payload=1, output_partial_sums=1, grad_all_gather=1,
                                   dp_table_grad=1, dense_grad=1)


def test_aggregating_one_module_of_two_leaves_the_other_as_it_is():
    before = load("two_modules_2ranks")
    after = apply(before, f"aggregation:input@{ITEM}")
    assert after.module(USER) == before.module(USER) and collectives(after, USER) == collectives(before, USER)
    assert after.module(ITEM).schedule.inputs == [InputExchange([0, 1], "bytes", MC)]
    assert after.provenance == [f"aggregation: input collectives of {ITEM} merged (6 -> 2)"]
    # per destination, member 0: column-wise 8 ids x int64 + 1 key x 4 x int32 = 80, row-wise 2.5 ids x int64 +
    # 1 key x 4 x int32 = 36 -> 116 -> 120; member 1: 3 x 8 + 16 + 3.5 x 8 + 16 = 84 -> 88
    assert collectives(after, ITEM)[:2] == [("g0+g1/input_splits", MC, MC, [96, 96]),
                                            ("g0+g1/input_payload", MC, MC, [240, 176])]
    assert [n.order for n in after.collectives()] == list(range(12))  # 16 - 4, renumbered
    # the single table-wise group of the other module: 3 -> 2, nothing padded (64 + 112, 80 + 48 per destination)
    both = apply(after, f"aggregation:input@{USER}")
    assert collectives(both, USER)[:2] == [("g0/input_splits", MC, MC, [48, 48]),
                                           ("g0/input_payload", MC, MC, [176, 128])]
    assert both.provenance[1] == f"aggregation: input collectives of {USER} merged (3 -> 2)"


@pytest.mark.parametrize("name, cid", [("table_and_column_wise_2ranks", f"aggregation:input@{EBC}"),
                                       ("table_and_column_wise_2ranks", f"aggregation:output@{EBC}"),
                                       ("row_wise_and_data_parallel_3ranks", f"aggregation:input@{EBC}"),
                                       ("two_modules_2ranks", f"aggregation:input@{USER}")])
def test_a_second_aggregation_is_refused(name, cid):
    after = apply(load(name), cid)
    again = candidate(after, cid)
    assert (again.feasible, again.reasons) == (False, ["already aggregated"])
    assert again.cost_inputs["collectives_removed"] == 0
    with pytest.raises(ValueError, match=r"is not feasible: \['already aggregated'\]"):
        AGG.apply(after, again)


# ------------------------------------------------------------------------------------------ latency hiding

def test_early_start_moves_the_lookups_to_the_root_forward():
    before = load("table_and_column_wise_2ranks")
    snapshot = before.to_dict()
    after = apply(before, f"latency_hiding:early_start@{EBC}")
    assert before.to_dict() == snapshot
    s = after.module(EBC).schedule
    assert s.lookup_at == RF
    assert s.inputs == [InputExchange([0], "per_tensor", RF), InputExchange([1], "per_tensor", RF)]
    assert s.outputs == [OutputExchange([0], "all_to_all_single", MC), OutputExchange([1], "all_to_all_single", MC)]
    assert s.regions == before.module(EBC).schedule.regions
    assert after.provenance == [f"latency_hiding: {EBC} starts at the root forward from args[0].sparse; its output "
                                f"and gradient all-to-alls overlap the dense compute in between"]
    found = collectives(after, EBC)
    # the same collectives with the same bytes, at other points
    assert [(i, b) for i, _, _, b in found] == [(i, b) for i, _, _, b in collectives(before, EBC)]
    assert [(i, issue, wait) for i, issue, wait, _ in found] == [
        ("g0/input_splits", RF, RF), ("g1/input_splits", RF, RF),
        ("g0/input_lengths", RF, RF), ("g0/input_values", RF, RF), ("g1/input_lengths", RF, RF),
        ("g1/input_values", RF, RF),
        ("g0/output_pooled", RF, MC), ("g1/output_pooled", RF, MC),  # in flight until the module's call
        ("g1/grad_pooled", MCB, LB), ("g0/grad_pooled", MCB, LB)]  # in flight until just before the fused update
    again = candidate(after, f"latency_hiding:early_start@{EBC}")
    assert (again.feasible, again.reasons) == (False, ["already scheduled"])
    with pytest.raises(ValueError, match=r"is not feasible: \['already scheduled'\]"):
        LH.apply(after, again)
    assert candidate(after, f"latency_hiding:next_batch@{EBC}").feasible


def test_early_start_keeps_a_row_wise_reduce_scatter_synchronous():
    graph = load("two_modules_2ranks")
    graph.module(ITEM).root_input = [["arg", 0], ["attr", "item"]]  # as if the model took it from its arguments
    after = apply(graph, f"latency_hiding:early_start@{ITEM}")
    s = after.module(ITEM).schedule
    assert s.lookup_at == RF and {e.issue for e in s.inputs} == {RF}
    assert s.outputs == [OutputExchange([0], "all_to_all_single", MC), OutputExchange([1], "reduce_scatter", RF)]
    points = [(i, issue, wait) for i, issue, wait, _ in collectives(after, ITEM)[6:]]
    assert points[:2] == [("g0/output_pooled", RF, MC), ("g1/output_partial_sums", RF, RF)]
    # gradients, numbered in the order backward issues them: the all-to-all's at the module call's
    # backward, the all-gather just before the update
    assert points[2:] == [("g0/grad_pooled", MCB, LB), ("g1/grad_all_gather", LB, LB)]
    assert after.module(USER) == graph.module(USER)
    assert after.provenance == [f"latency_hiding: {ITEM} starts at the root forward from args[0].item; its output "
                                f"and gradient all-to-alls overlap the dense compute in between"]


def test_a_candidate_proposed_on_another_graph_is_checked_again():
    identity = load("table_and_column_wise_2ranks")
    stale = candidate(identity, f"aggregation:input@{EBC}")
    once = AGG.apply(identity, stale)
    with pytest.raises(ValueError, match=r"is not feasible: \['already aggregated'\]"):
        AGG.apply(once, stale)


def test_next_batch_issues_the_input_distribution_a_step_ahead():
    before = load("row_wise_and_data_parallel_3ranks")
    after = apply(before, f"latency_hiding:next_batch@{EBC}")
    s = after.module(EBC).schedule
    assert (s.lookup_at, s.inputs, s.input_issue) == (MC, [InputExchange([0], "per_tensor", PS)], PS)
    assert s.outputs == before.module(EBC).schedule.outputs
    assert after.provenance == [f"latency_hiding: {EBC} distributes the next batch's input (batch.sparse of the "
                                f"announced batch) during this step"]
    assert [(i, issue, wait) for i, issue, wait, _ in collectives(after, EBC)] == [
        ("g0/input_splits", PS, PS), ("g0/input_lengths", PS, MC), ("g0/input_values", PS, MC),
        ("g0/input_weights", PS, MC), ("g0/output_partial_sums", MC, MC), ("g0/grad_all_gather", MCB, MCB),
        ("g1/table_grad_all_reduce", DDP, DDP)]
    again = candidate(after, f"latency_hiding:next_batch@{EBC}")
    assert (again.feasible, again.reasons) == (False, ["already scheduled"])
    # aggregated afterwards: the packed payload keeps the point
    packed = apply(after, f"aggregation:input@{EBC}")
    assert packed.module(EBC).schedule.inputs == [InputExchange([0], "bytes", PS)]
    assert collectives(packed, EBC)[:2] == [("g0/input_splits", PS, PS, [96] * 3), ("g0/input_payload", PS, MC, [312, 336, 264])]


def test_every_pass_applied_in_turn():
    graph = load("table_and_column_wise_2ranks")
    order = [f"latency_hiding:next_batch@{EBC}", f"aggregation:input@{EBC}", f"latency_hiding:early_start@{EBC}",
             f"aggregation:output@{EBC}"]
    for cid in order:
        graph = apply(graph, cid)
    s = graph.module(EBC).schedule
    assert s.lookup_at == RF
    assert s.inputs == [InputExchange([0, 1], "bytes", PS)]  # early start leaves a step-ahead input where it is
    assert s.outputs == [OutputExchange([0, 1], "all_to_all_single", MC)]
    assert collectives(graph, EBC) == [("g0+g1/input_splits", PS, PS, [96, 96]),
                                       ("g0+g1/input_payload", PS, RF, [512, 512]),
                                       ("g0+g1/output_pooled", RF, MC, [384, 384]),
                                       ("g0+g1/grad_pooled", MCB, LB, [384, 384])]
    assert [p.split(":")[0] for p in graph.provenance] == ["latency_hiding", "aggregation", "latency_hiding",
                                                          "aggregation"]
    assert [(c.id, c.reasons) for p in (AGG, LH) for c in p.candidates(graph)] == [
        (order[1], ["already aggregated"]), (order[3], ["already aggregated"]),
        (order[2], ["already scheduled"]), (order[0], ["already scheduled"])]
    # the same rewrites in another order give the same structure, with their own provenance
    other = load("table_and_column_wise_2ranks")
    for cid in reversed(order):
        other = apply(other, cid)
    assert other.fingerprint() == graph.fingerprint() and other.provenance == graph.provenance[::-1]


# ------------------------------------------------------------------------------------------ requires / ensures

@pytest.mark.parametrize("cid", [f"aggregation:input@{EBC}", f"aggregation:output@{EBC}",
                                 f"latency_hiding:early_start@{EBC}", f"latency_hiding:next_batch@{EBC}"])
def test_an_infeasible_candidate_is_not_applied(cid):
    graph = load("table_wise_1rank")
    c = candidate(graph, cid)
    with pytest.raises(ValueError, match=rf"^{cid} is not feasible: \['one rank: "):
        (AGG if c.pass_name == "aggregation" else LH).apply(graph, c)


class _DropsAGroup(CommunicationAggregation):
    def rewrite(self, graph, module, candidate):
        super().rewrite(graph, module, candidate)
        module.schedule.inputs[0].groups = [0]
        return "merged, but lost g1"


class _LooksUpAStepAhead(LatencyHiding):
    def rewrite(self, graph, module, candidate):
        module.schedule.lookup_at = PS
        return "too early"


@pytest.mark.parametrize("broken, cid, problem", [
    (_DropsAGroup(), f"aggregation:input@{EBC}", "input buckets [[0]] do not hold each of groups [0, 1] exactly once"),
    (_LooksUpAStepAhead(), f"latency_hiding:early_start@{EBC}",
     "lookups at previous_step: they run at the module call or the root forward; input exchanges issued at "
     "['module_call']: at the lookups (previous_step) or the previous step"),
])
def test_a_rewrite_that_breaks_the_schedule_is_refused(broken, cid, problem):
    graph = load("table_and_column_wise_2ranks")
    snapshot = graph.to_dict()
    with pytest.raises(ScheduleError, match="^" + re.escape(
            f"{cid} gives a schedule the runtime cannot execute: {problem}")):
        broken.apply(graph, candidate(graph, cid))
    assert graph.to_dict() == snapshot


def _item_schedule():
    return copy.deepcopy(load("two_modules_2ranks").module(ITEM).schedule)  # column-wise g0, row-wise g1


def _edit(**changes):
    def edit(s):
        for path, value in changes.items():
            target = s
            *parts, last = path.split("__")
            for part in parts:
                target = target[int(part)] if part.isdigit() else getattr(target, part)
            if last.isdigit():
                target[int(last)] = value
            else:
                setattr(target, last, value)
        return s
    return edit


@pytest.mark.parametrize("edit, world, problems", [
    (_edit(), 2, []),
    (_edit(inputs=[InputExchange([0, 1], "per_tensor", MC)]), 2,
     ["input bucket g0+g1: several groups travel together only byte-packed"]),
    (_edit(inputs=[InputExchange([0, 1], "bytes", MC), InputExchange([1], "per_tensor", MC)]), 2,
     ["input buckets [[0, 1], [1]] do not hold each of groups [0, 1] exactly once"]),
    (_edit(inputs__1__issue=PS), 2, ["input exchanges issued at different points ['module_call', 'previous_step']"]),
    (_edit(inputs__0__issue=RF, inputs__1__issue=RF), 2,
     ["input exchanges issued at ['root_forward']: at the lookups (module_call) or the previous step"]),
    (_edit(outputs__0__groups=[0, 1]), 2, ["output all-to-all buckets [[0, 1]] do not hold each of groups [0] exactly "
                                           "once"]),
    (_edit(outputs__1__wait=PS), 2, ["output g1: a row-wise reduce-scatter is one group's, waited where it is issued",
                                     "output g1 waited at previous_step: at the lookups or the module call"]),
    (_edit(lookup_at=RF, outputs__1__wait=MC), 2,  # early start must keep the reduce-scatter at the lookups
     ["input exchanges issued at ['module_call']: at the lookups (root_forward) or the previous step",
      "output g1: a row-wise reduce-scatter is one group's, waited where it is issued"]),
    (_edit(regions__4__groups=[1]), 2, ["lookup regions cover groups [1, 1], not each of [0, 1] once"]),
    (_edit(), 1, ["input buckets [[0], [1]] do not hold each of groups [] exactly once",
                  "output all-to-all buckets [[0]] do not hold each of groups [] exactly once",
                  "output reduce-scatter buckets [[1]] do not hold each of groups [] exactly once"]),
], ids=["valid", "per-tensor-bucket", "group-twice", "two-issue-points", "issued-elsewhere", "output-extra-group",
        "reduce-scatter-waited-elsewhere", "reduce-scatter-in-flight", "lookup-region", "one-rank"])
def test_check_schedule_names_what_the_runtime_cannot_execute(edit, world, problems):
    assert check_schedule(edit(_item_schedule()), ["column_wise", "row_wise"], world) == problems


# ------------------------------------------------------------------------------------------ fingerprint, JSON

def _changed(edit) -> SparseGraph:
    graph = load("two_modules_2ranks")
    edit(graph)
    return graph


@pytest.mark.parametrize("edit", [
    lambda g: g.module(ITEM).ids_per_step[0].update(x=99.0),
    lambda g: g.module(USER).length_percentiles["a"].update(p99=40.0),
    lambda g: setattr(g.module(ITEM), "next_batch_note", "another reason"),
], ids=["ids_per_step", "length_percentiles", "next_batch_note"])
def test_the_fingerprint_ignores_measured_statistics_and_prose(edit):
    graph = _changed(edit)
    assert graph.to_dict() != load("two_modules_2ranks").to_dict()
    assert graph.fingerprint() == load("two_modules_2ranks").fingerprint()


@pytest.mark.parametrize("edit", [
    lambda g: setattr(g.module(ITEM).schedule.inputs[0], "stream", "comm"),
    lambda g: setattr(g.module(ITEM).schedule.outputs[1], "process_group", "intra_node"),
    lambda g: setattr(g.module(USER).schedule.regions[1], "kernel", "fbgemm_tbe"),
    lambda g: setattr(g.module(USER).schedule.inputs[0], "issue", PS),
    lambda g: setattr(g.module(USER).schedule, "lookup_at", RF),
    lambda g: setattr(g.module(ITEM), "root_input", [["arg", 0], ["attr", "item"]]),
    lambda g: g.module(ITEM).groups[1].block_sizes.__setitem__(0, 5),
    lambda g: setattr(g, "world_size", 3),
    lambda g: g.modules.reverse(),
], ids=["stream", "process_group", "kernel", "issue", "lookup_at", "root_input", "block_sizes", "world_size",
        "module_order"])
def test_the_fingerprint_follows_the_structure_and_the_schedules(edit):
    assert _changed(edit).fingerprint() != load("two_modules_2ranks").fingerprint()


@pytest.mark.parametrize("name, cids", [
    ("row_wise_and_data_parallel_3ranks", [f"aggregation:input@{EBC}", f"latency_hiding:next_batch@{EBC}"]),
    ("two_modules_2ranks", [f"latency_hiding:early_start@{USER}", f"aggregation:input@{ITEM}"]),
])
def test_applied_graphs_round_trip_through_json(name, cids):
    graph = load(name)
    for cid in cids:
        graph = apply(graph, cid)
    again = SparseGraph.from_dict(json.loads(graph.to_json()))
    assert again == graph and again.fingerprint() == graph.fingerprint() and again.provenance == graph.provenance
    assert [vars(n) for n in again.nodes] == [vars(n) for n in graph.nodes]
    assert graph.copy() == graph and graph.copy() is not graph
    data = graph.to_dict()
    assert "nodes" not in data and all("schedule" in m for m in data["modules"])


def test_a_graph_of_another_version_is_refused():
    data = load("table_wise_1rank").to_dict()
    data["version"] = 1
    with pytest.raises(ValueError, match="^sparse graph version 1 is not 3$"):
        SparseGraph.from_dict(data)


# ------------------------------------------------------------------------------------------ a group on TorchRec's path

def _with_group_kept(name: str, module: str, group: int) -> SparseGraph:
    """The fixture with one group marked as keeping TorchRec's path (as lifting marks a group it
    cannot run, e.g. table-row-wise over several hosts), its identity schedule rebuilt."""
    graph = load(name)
    m = graph.module(module)
    m.groups[group].not_lifted = "injected: the executor cannot run it"
    m.schedule = identity_schedule(m.kinds, graph.world_size, bool(m.feature_order))
    return graph


def test_a_group_kept_on_torchrecs_path_has_no_exchange_and_the_passes_leave_it_alone():
    from lightning_sparselift.passes.codegen import CodeGeneration

    graph = _with_group_kept("table_and_column_wise_2ranks", EBC, 1)
    m = graph.module(EBC)
    assert m.kinds == ["table_wise", None] and [g.index for g in m.lifted_groups] == [0]
    assert check_schedule(m.schedule, m.kinds, 2) == []
    # g1's exchanges are TorchRec's own: not in the schedule nor the derived collectives; one node
    # per phase stands for the group
    assert [e.groups for e in m.schedule.inputs] == [[0]] and [e.groups for e in m.schedule.outputs] == [[0]]
    assert m.schedule.region("lookup", 1).kernel == "torchrec"
    assert all(n.groups in ([0], []) for n in graph.collectives())  # ([]: DDP's dense all-reduce)
    kept = [(n.id, n.op, n.kernel) for n in graph.nodes if 1 in n.groups]
    assert kept == [(f"{EBC}/g1/torchrec_forward", "torchrec_group", "torchrec"),
                    (f"{EBC}/g1/torchrec_backward", "torchrec_group", "torchrec")]
    assert "runs TorchRec's input dist, lookup and output dist of the group: injected" in graph.explain()
    # the passes change only g0: its input in one byte-packed payload, codegen only on g0
    packed = apply(graph, f"aggregation:input@{EBC}").module(EBC).schedule
    assert packed.inputs == [InputExchange([0], "bytes", MC)]
    for g in m.groups:
        g.lookup_kernels.append("generated")
    codegen = CodeGeneration()
    (proposed,) = [c for c in codegen.candidates(graph) if c.role == "lookup"]
    applied = codegen.apply(graph, proposed)
    s = applied.module(EBC).schedule
    assert (s.region("lookup", 0).kernel, s.region("lookup", 1).kernel) == ("generated", "torchrec")
    for cid in (f"latency_hiding:early_start@{EBC}", f"latency_hiding:next_batch@{EBC}"):
        applied = apply(applied, cid)
    assert applied.module(EBC).schedule.region("lookup", 1).kernel == "torchrec"
    assert SparseGraph.from_dict(json.loads(applied.to_json())).to_dict() == applied.to_dict()


@pytest.mark.parametrize("edit, problem", [
    (lambda s: setattr(s.region("lookup", 1), "kernel", "generated"), "group(s) [1] keep TorchRec's path"),
    (lambda s: s.inputs.append(InputExchange([1], "per_tensor", MC)), "input buckets [[0], [1]] do not hold"),
])
def test_check_schedule_refuses_a_schedule_that_runs_a_kept_group(edit, problem):
    graph = _with_group_kept("table_and_column_wise_2ranks", EBC, 1)
    m = graph.module(EBC)
    edit(m.schedule)
    assert any(problem in p for p in check_schedule(m.schedule, m.kinds, 2)), check_schedule(m.schedule, m.kinds, 2)
