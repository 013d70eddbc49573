"""The communication-precision pass (``passes/communication_precision.py``) on graph fixtures,
and its BF16 cast in the output layouts (``runtime/layout.py``) on one process: feasible only
under ``numerics="fast"``, the graph's derived collectives follow the wire, the step-time model
prices the cast, and the layouts' fused copies give exactly what the same layouts give with
TorchRec's BF16 codec in its own calls, the gradient divided by world size after decoding."""

from __future__ import annotations

import pytest
import torch

from graph_fixtures import EBC, four_tables_two_ranks, load, step_model, unmeasured_plan
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
