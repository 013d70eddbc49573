"""The communication-precision pass (``passes/communication_precision.py``) on graph fixtures,
and its BF16 cast in the output layouts (``runtime/layout.py``) on one process: feasible only
under ``numerics="fast"``, the graph's derived collectives follow the wire, the step-time model
prices the cast, and the layouts' fused copies give exactly what the same layouts give with
TorchRec's BF16 codec in its own calls, the gradient divided by world size after decoding."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from graph_fixtures import EBC, four_tables_two_ranks, load, step_model, unmeasured_plan
from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.ir import check_schedule
from lightning_sparselift.passes import InfeasibleCandidate, select_passes
from lightning_sparselift.passes.communication_precision import CommunicationPrecision
from lightning_sparselift.passes.subgraph_parallelism import SubgraphParallelism
from lightning_sparselift.plan import PlanFileError, Planner
from lightning_sparselift.runtime.buffers import Buffers
from lightning_sparselift.runtime.layout import ExchangeBuffers, PooledLayout, Wire


def _candidates(graph, numerics="fast"):
    return {c.name: c for c in CommunicationPrecision(numerics=numerics).candidates(graph)}


def test_exact_numerics_keep_every_exchange_float32():
    graph = load("table_and_column_wise_2ranks")
    for c in _candidates(graph, "exact").values():
        assert not c.feasible
        assert c.reasons[0].startswith("numerics='exact' keeps every value bit-identical")
    with pytest.raises(InfeasibleCandidate):
        CommunicationPrecision().apply(graph, _candidates(graph)["output@" + EBC])


def test_the_output_all_to_alls_send_bf16_both_ways_and_the_graph_and_model_follow():
    identity = load("table_and_column_wise_2ranks")
    assert set(_candidates(identity)) == {f"output@{EBC}"}  # (one candidate: both directions, see the pass)
    candidate = _candidates(identity)[f"output@{EBC}"]
    assert candidate.feasible, candidate.reasons
    after = CommunicationPrecision(numerics="fast").apply(identity, candidate)
    narrowed = ("output_pooled", "grad_pooled")
    assert after.module(EBC).schedule.wire == dict.fromkeys(narrowed, "bf16")
    assert all(f"{role}=bf16" in after.explain() for role in narrowed)
    assert identity.module(EBC).schedule.wire == {}  # (the input graph is not modified)
    before = {n.id: n for n in identity.collectives()}
    for node in after.collectives():
        old = before[node.id]
        if node.role in narrowed:
            assert node.dtype == "bfloat16" and node.bytes_per_member == [b // 2 for b in old.bytes_per_member]
        else:
            assert node.dtype == old.dtype and node.bytes_per_member == old.bytes_per_member
    nodes = [n for n in identity.collectives() if n.role in narrowed]
    assert candidate.cost_inputs["bytes_saved"] == max(sum(n.bytes_per_member[r] for n in nodes) for r in range(2)) / 2
    # the model: each all-to-all half its bytes on the wire, less one pass of its float32 values each side
    model = step_model(identity, alpha_ms=0.0, beta_ms_per_byte=1e-4)
    wire = sum(1e-4 * max(n.bytes_per_member) / 2 for n in nodes)
    cast = sum(model.copy_ms(max(n.bytes_per_member), 1.0) for n in nodes)
    assert model.increment_ms(identity, after) == pytest.approx(cast - wire)
    assert not _candidates(after)[f"output@{EBC}"].feasible
    assert _candidates(after)[f"output@{EBC}"].reasons == ["already BF16"]


@pytest.mark.parametrize("cores", [1.0, 2.0])
def test_the_backends_cpu_for_the_bytes_saved_counts_where_it_shares_the_core(cores):
    identity = load("table_and_column_wise_2ranks")
    after = CommunicationPrecision(numerics="fast").apply(identity, _candidates(identity)[f"output@{EBC}"])
    plain = step_model(identity, alpha_ms=0.0, beta_ms_per_byte=0.0, cores=cores)
    busy = step_model(identity, alpha_ms=0.0, beta_ms_per_byte=0.0, cores=cores)
    busy.inputs.timings.backend_cpu_ms = [2.0, 1.0]  # measured beyond the training thread per step
    busy = type(busy)(busy.inputs, identity)
    per_rank = [sum(n.bytes_per_member[r] for n in identity.collectives()) for r in range(2)]
    rate = max(2.0 / per_rank[0], 1.0 / per_rank[1]) if cores < 2 else 0.0
    assert busy.backend_ms_per_byte == pytest.approx(rate)
    saved = sum(max(n.bytes_per_member) / 2 for n in identity.collectives() if n.role in ("output_pooled", "grad_pooled"))
    assert busy.increment_ms(identity, after) == pytest.approx(plain.increment_ms(identity, after) - saved * rate)


def test_reduce_scatters_torchrec_codecs_and_pipelined_buckets_are_left_alone():
    rw = load("row_wise_and_data_parallel_3ranks")
    for c in CommunicationPrecision(numerics="fast").candidates(rw):
        if not any(n.module == c.module and n.op == "all_to_all_single" for n in rw.collectives()):
            assert not c.feasible and c.reasons[0].startswith("no output all-to-all")
    quantized = load("table_and_column_wise_2ranks")
    quantized.module(EBC).wire = {"output_pooled": "fp16", "grad_pooled": "fp16"}
    assert "TorchRec's quantized communication already encodes" in _candidates(quantized)[f"output@{EBC}"].reasons[0]
    # pipelined buckets and the cast exclude each other, whichever comes first
    graph = four_tables_two_ranks()
    pipelined = SubgraphParallelism(numerics="fast")
    split = pipelined.apply(graph, next(c for c in pipelined.candidates(graph) if c.name.startswith("pipelined2")))
    assert "pipelined per bucket" in _candidates(split)[f"output@{EBC}"].reasons[0]
    cast = CommunicationPrecision(numerics="fast").apply(graph, _candidates(graph)[f"output@{EBC}"])
    again = next(c for c in pipelined.candidates(cast) if c.name.startswith("pipelined2"))
    assert not again.feasible and "communication precision" in " ".join(again.reasons)
    schedule = split.module(EBC).schedule
    schedule.wire = {"output_pooled": "bf16", "output_partial_sums": "bf16"}
    problems = check_schedule(schedule, split.module(EBC).kinds, 2)
    assert any("output_partial_sums=bf16" in p for p in problems) and any("pipelined" in p for p in problems)


def test_a_plan_that_casts_is_not_reused_under_exact_numerics():
    identity = load("table_and_column_wise_2ranks")
    plan = unmeasured_plan(identity, ["communication_precision"], numerics="fast")
    assert len(plan.accepted) == 1
    fast = Planner(select_passes(["communication_precision"], "fast"), None, calibrate=False)
    assert fast.rebuild(plan, identity).fingerprint() == plan.graph.fingerprint()
    with pytest.raises(PlanFileError, match="not a feasible candidate"):
        Planner(select_passes(["communication_precision"]), None, calibrate=False).rebuild(plan, identity)


def _torchrecs_bf16():
    """TorchRec's BF16 codec (its CPU registry would turn it into FP16: built as for CUDA)."""
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    config = QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.BF16)
    return get_qcomm_codecs_registry(config)["POOLED_EMBEDDINGS_ALL_TO_ALL"]


def _layout(dims, wire, raw=False):
    return PooledLayout(dims, 4, None, [None] * len(dims), 1, ExchangeBuffers.of(Buffers(), [0]), raw=raw,
                        wire=wire)


@pytest.mark.parametrize("dims, raw", [([[3, 2]], False), ([[3, 2], [1, 4]], False), ([[3, 2]], True)],
                         ids=["one group (cast alone)", "two groups (fused)", "consumer layout (raw)"])
def test_the_layouts_cast_is_torchrecs_bf16_codec(dims, raw):
    torch.manual_seed(0)
    world, b = 2, 4
    cast = Wire(cast={True: torch.bfloat16, False: torch.bfloat16})
    locals_ = tuple(torch.randn(world * b, d[1]) * 100 for d in dims)
    plain, narrow = _layout(dims, Wire(_torchrecs_bf16()), raw), _layout(dims, cast.for_step(), raw)
    send, recv_sizes, send_sizes = plain.send_outputs(locals_)
    sent, recv_q, send_q = narrow.send_outputs(locals_)
    assert sent.dtype == torch.bfloat16 and (recv_q, send_q) == (recv_sizes, send_sizes)
    assert torch.equal(sent, send)
    arrived = torch.randn(sum(recv_sizes)).bfloat16()
    outputs = narrow.unpack_outputs(arrived)
    expected = plain.unpack_outputs(arrived)
    assert all(o.dtype == torch.float32 and torch.equal(o, e) for o, e in zip(outputs, expected))
    grads = tuple(torch.randn_like(o) for o in expected)
    g_send, g_recv_sizes, _ = plain.send_grads(grads)
    g_sent, *_ = narrow.send_grads(grads)
    assert g_sent.dtype == torch.bfloat16 and torch.equal(g_sent, g_send)
    g_arrived = torch.randn(sum(g_recv_sizes)).bfloat16()
    back = narrow.unpack_grads(g_arrived)
    reference = plain.unpack_grads(g_arrived)  # decoded, then divided by world size
    assert all(g.dtype == torch.float32 and torch.equal(g, r) for g, r in zip(back, reference))


def test_only_float32_values_are_cast():
    wire = Wire(cast={True: torch.bfloat16})
    half = torch.randn(8).half()
    assert wire.for_step().encode(half, True).dtype == torch.float16
    assert wire.for_step().encode(half.float(), False).dtype == torch.float32  # (that direction is not cast)


def _burn(ms: float) -> None:
    """Spend ``ms`` of this thread's CPU time."""
    start = time.thread_time()
    while time.thread_time() - start < ms / 1e3:
        pass


def test_the_cast_is_measured_on_the_exchanges_cpu_time():
    """The layouts' copies on the training thread and every other thread's CPU time (the
    collectives' threads) make ``exchange_cpu``; the rest of the training thread's step does not."""
    assert CommunicationPrecision.protocol.region == "exchange_cpu"
    clock = RegionClock(torch.device("cpu"))
    clock.start_step()
    with clock.exchange():
        _burn(20)  # a layout's copy
    other = threading.Thread(target=_burn, args=(30,))  # a collective's thread
    other.start()
    other.join()
    _burn(25)  # the rest of the step
    regions = clock.end_step()
    assert 49 < regions["exchange_cpu_ms"] < 70
    assert 44 < regions["step_cpu_ms"] < 65  # (the training thread's only)
    clock.start_step()
    assert clock.end_step()["exchange_cpu_ms"] < 5  # every step counts from its start
