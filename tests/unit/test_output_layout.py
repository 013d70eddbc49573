"""The output layout (code generation's ``output`` role): what capture finds about the model's use
of a pooled output, the pass's feasibility, and the layout's tensor against TorchRec's copies on
one process (the parity harness runs it on 1-3 ranks against TorchRec)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graph_fixtures import EBC, load
from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.frontend.consumer import OutputTrace
from lightning_sparselift.ir import OutputConsumer
from lightning_sparselift.ir.schedule import CONSUMER_KERNEL
from lightning_sparselift.passes.codegen import CodeGeneration
from lightning_sparselift.plan.types import KernelBuild
from lightning_sparselift.runtime.buffers import Buffers
from lightning_sparselift.runtime.codegen.layout_kernel import LayoutKernel
from lightning_sparselift.runtime.consumer_layout import ConsumerOutput
from lightning_sparselift.session import mark_generated

KEYS, DIMS = ["a", "b", "c"], [4, 2, 3]


def _kt(keys=KEYS, dims=DIMS, batch=5, seed=0):
    from torchrec.sparse.jagged_tensor import KeyedTensor

    values = torch.randn(batch, sum(dims), generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return KeyedTensor(keys=keys, length_per_key=dims, values=values * 1.0, key_dim=1)


def _traced(consume, **kt):
    kt = _kt(**kt)
    trace = OutputTrace(list(kt.keys()), list(kt.length_per_key()))
    reference = consume(kt)
    traced = consume(trace.wrap(kt))
    # tracing computes exactly what the plain tensors do
    assert all(torch.equal(a, b) for a, b in zip(reference, traced))
    return trace.result()


def _dlrm(kt):  # TorchRec's DLRM SparseArch: to_dict, then one torch.cat in the model's feature order
    d = kt.to_dict()
    return [torch.cat([d[k] for k in ["c", "a", "b"]], dim=1).reshape(kt.values().size(0), -1)]


def _concat_interaction(kt):  # the bottom MLP's output first, then every key by name
    dense = torch.ones(kt.values().size(0), 7)
    return [torch.cat([dense] + [kt[k] for k in ["b", "c", "a"]], dim=1)]


@pytest.mark.parametrize("consume, found", [
    (_dlrm, [["c", "a", "b"], 0, 0]),
    (_concat_interaction, [["b", "c", "a"], 7, 0]),
    (lambda kt: [torch.cat([kt.to_dict()[k] for k in KEYS] + [torch.zeros(5, 2)], dim=-1)], [KEYS, 0, 2]),
])
def test_capture_finds_the_models_concatenation_of_every_key(consume, found):
    assert _traced(consume) == (found, "")


@pytest.mark.parametrize("consume, note", [
    (lambda kt: [kt.values().sum(dim=1)], "reads the pooled values with"),
    (lambda kt: [torch.cat([kt["a"], kt["b"]], dim=1)], "holds 2 of the 3 keys"),
    (lambda kt: [kt["a"] * 2], "reads the pooled values with"),
    (lambda kt: [torch.cat([kt["a"], torch.zeros(5, 1), kt["b"], kt["c"]], dim=1)], "(in one run: False)"),
    (lambda kt: [torch.cat([kt[k] for k in KEYS], 1), torch.cat([kt[k] for k in KEYS], 1)], "concatenates the pooled "
                                                                                            "values 2 times"),
    (lambda kt: [torch.stack([kt["a"], kt["a"]])], "reads the pooled values with"),
    (lambda kt: [kt["a"]], "does not concatenate"),
    (lambda kt: [kt.values().narrow(1, 1, 3)], "not one key's columns"),
])
def test_capture_says_what_else_the_model_did_with_the_output(consume, note):
    found, why = _traced(consume)
    assert found is None and note in why, why


def test_capture_leaves_a_concatenation_after_another_modules_values_to_that_module():
    a, b = _kt(), _kt(keys=["x", "y"], dims=[2, 2], seed=1)
    ta, tb = OutputTrace(KEYS, DIMS), OutputTrace(["x", "y"], [2, 2])
    a, b = ta.wrap(a), tb.wrap(b)
    torch.cat([a[k] for k in KEYS] + [b[k] for k in ["x", "y"]], dim=1)
    assert ta.result() == ([KEYS, 0, 4], "")
    assert tb.result()[0] is None and "after another sharded module's values" in tb.result()[1]


def _with_consumer(consumer: OutputConsumer):
    """The one-rank fixture (table-wise, keys a, b) whose capture found ``consumer``."""
    graph = load("table_wise_1rank")
    m = graph.module(EBC)
    m.consumer = consumer
    return graph, m


def test_the_pass_proposes_the_layout_only_where_capture_found_the_concatenation():
    graph = load("table_wise_1rank")
    output = [c for c in CodeGeneration().candidates(graph) if c.role == "output"]
    assert [c.reasons for c in output] == [["no concatenation to write into: capture recorded none"]]
    graph, m = _with_consumer(OutputConsumer(["b", "a"], 3, 0))
    (unbuilt,) = [c for c in CodeGeneration().candidates(graph) if c.role == "output"]
    assert unbuilt.reasons == ["no layout kernel was built (the session builds them from the lift on)"]
    mark_generated(graph, [KernelBuild(EBC, -1, 0, "", 0.1, False)])  # as the session records the build
    assert m.output_kernels == ["torchrec", CONSUMER_KERNEL]
    (candidate,) = [c for c in CodeGeneration().candidates(graph) if c.role == "output"]
    assert candidate.feasible and candidate.cost_inputs["pooled_bytes"] == 8 * 8 * 4
    assert CodeGeneration().protocol_for("output").region == "layout_cpu"
    applied = CodeGeneration().apply(graph, candidate)
    assert applied.module(EBC).schedule.region("output").kernel == CONSUMER_KERNEL
    assert "written straight into the model's concatenation (2 keys after 3" in applied.provenance[-1]
    assert "output concatenated by the model: 2 keys in one torch.cat, after 3" in applied.explain()
    assert [c.reasons for c in CodeGeneration().candidates(applied) if c.role == "output"] == [["already scheduled"]]
    m.mean_after_reduce = True
    (candidate,) = [c for c in CodeGeneration().candidates(graph) if c.role == "output"]
    assert "rescales the whole output" in candidate.reasons[0]
    # a rank whose build failed: no candidate anywhere, with that rank's reason
    graph, m = _with_consumer(OutputConsumer(["b", "a"], 3, 0))
    mark_generated(graph, [KernelBuild(EBC, -1, 0, "", 0.1, False), KernelBuild(EBC, -1, 1, "no compiler", 0, False)])
    (candidate,) = [c for c in CodeGeneration().candidates(graph) if c.role == "output"]
    assert candidate.reasons == ["rank 1: no compiler"]


class _OpsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _layout_and_reference(order, before):
    graph, m = _with_consumer(OutputConsumer(order, before, 0))
    m.schedule.region("output").kernel = CONSUMER_KERNEL
    out = torch.randn(6, 8, requires_grad=True)  # the group's output: keys a, b (4 columns each)
    cpu = torch.device("cpu")
    return ConsumerOutput(m, m.schedule, LayoutKernel(m, 1, cpu), Buffers(), RegionClock(cpu)), m, out


@pytest.mark.parametrize("before", [0, 3])
def test_the_models_concatenation_is_the_layouts_tensor_and_bitwise_torchrecs(before):
    from lightning_sparselift.runtime.kernels import output_torchrec

    calls = []
    layout, m, out = _layout_and_reference(["b", "a"], before)
    layout.on_concatenated = lambda: calls.append(1)
    dense = torch.randn(6, before, requires_grad=True)
    results, grads = [], []
    cats = []
    for kernel in (output_torchrec, layout):
        kt = kernel(m, [out * 1.0], [])
        d = kt.to_dict()
        with _OpsSeen() as seen:
            cat = torch.cat(([dense] if before else []) + [d["b"], d["a"]], dim=1)
        cats.append(seen.ops.count("aten.cat.default"))
        (cat * torch.arange(cat.numel()).view_as(cat)).sum().backward()
        results.append(cat.detach().clone())
        grads.append((out.grad.clone(), dense.grad.clone() if before else None))
        out.grad = dense.grad = None
    assert calls == [1] and cats == [1, 0]  # the second run's concatenation was the layout's tensor, nothing copied
    assert torch.equal(results[0], results[1])
    assert torch.equal(grads[0][0], grads[1][0]) and (not before or torch.equal(grads[0][1], grads[1][1]))


def test_both_arms_copies_are_timed_where_they_are_made_and_compute_as_before():
    """``layout_cpu``: the layout's kernel (an exchange's copy) and its writing of the other
    operands; the reference's output built from the groups' outputs, the model's concatenation and
    its backward (the split's, which concatenates the keys' gradients). Timing changes no value."""
    from lightning_sparselift.runtime.consumer_layout import timed_reference
    from lightning_sparselift.runtime.kernels import output_torchrec

    graph, m = _with_consumer(OutputConsumer(["b", "a"], 3, 0))
    m.schedule.region("output").kernel = CONSUMER_KERNEL
    cpu = torch.device("cpu")
    out = torch.randn(200_000, 8, requires_grad=True)  # (large enough for each copy to take thread CPU time)
    dense = torch.randn(200_000, 3, requires_grad=True)
    weights = torch.randn(200_000, 11)
    results, taken = [], []
    for arm in ("plain", "timed", "layout"):
        clock = RegionClock(cpu)
        clock.start_step()
        if arm == "layout":
            kt = ConsumerOutput(m, m.schedule, LayoutKernel(m, 1, cpu), Buffers(), clock)(m, [out * 1.0], [])
        else:
            kt = output_torchrec(m, [out * 1.0], [])
            kt = timed_reference(kt, clock) if arm == "timed" else kt
        d = kt.to_dict()
        cat = torch.cat([dense, d["b"], d["a"]], dim=1)
        forward = clock.concatenation_ms + clock.exchange_ms
        assert type(cat) is torch.Tensor
        (cat * weights).sum().backward()
        results.append((cat.detach().clone(), out.grad.clone(), dense.grad.clone()))
        out.grad = dense.grad = None
        taken.append((forward, clock.end_step()["layout_cpu_ms"]))
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
    assert taken[0] == (0.0, 0.0)  # the plain reference: nothing timed
    for forward, step in taken[1:]:  # each arm's forward copies, then its backward's too
        assert 0 < forward < step


def test_any_other_concatenation_copies_as_usual():
    layout, m, out = _layout_and_reference(["b", "a"], 0)
    kt = layout(m, [out], [])
    swapped = torch.cat([kt["a"], kt["b"]], dim=1)  # not the captured order: an ordinary copy
    assert type(swapped) is torch.Tensor and torch.equal(swapped, out)
    first = torch.cat([kt["b"], kt["a"]], dim=1)
    again = torch.cat([kt["b"], kt["a"]], dim=1)  # a second one must not share the first one's memory
    assert first.data_ptr() == kt.values().data_ptr() and again.data_ptr() != first.data_ptr()
    assert torch.equal(first, again) and type(again) is torch.Tensor


def test_device_tensors_get_no_layout_kernel():
    """The layout kernel writes host memory: on CUDA the candidate is infeasible with the reason."""
    from lightning_sparselift.runtime.codegen import Unsupported

    _, m = _with_consumer(OutputConsumer(["a", "b"], 0, 0))
    with pytest.raises(Unsupported, match="on cuda the model's concatenation copies"):
        LayoutKernel(m, 1, torch.device("cuda"))


def test_the_layout_is_decided_on_its_copies_cpu_clock():
    """What the layout saves is the training thread's copies: its candidate is judged on that clock
    (``layout_cpu``), whatever the steps' wall time or the rest of the thread's step say; the
    model's concatenations are timed only while the design varies it."""
    from lightning_sparselift.passes import select_passes
    from lightning_sparselift.plan import PlanFingerprint, Planner, PlanningLoop

    graph, m = _with_consumer(OutputConsumer(["a", "b"], 0, 0))
    mark_generated(graph, [KernelBuild(EBC, -1, 0, "", 0.1, False)])
    fingerprint = PlanFingerprint(graph.fingerprint(), "sharding", 1, "gloo", {}, ["codegen:output"])
    loop = PlanningLoop(Planner(select_passes(["codegen:output"]), None, calibrate=True), fingerprint, graph, None)
    loop.propose()
    assert loop.measures("layout_cpu") and not loop.measures("step_cpu")
    while not loop.done:
        layout = loop.next_graph().module(EBC).schedule.region("output").kernel == CONSUMER_KERNEL
        # the wall time is 1 ms slower with the layout, the training thread's step as fast, its copies 2 ms faster
        loop.feedback(81.0 if layout else 80.0, 10.0, step_cpu_ms=60.0, layout_cpu_ms=3.0 if layout else 5.0)
    (decision,) = loop.plan.decisions
    assert decision.accepted and decision.measured_ms == pytest.approx(-2.0)
    assert not loop.measures("layout_cpu")
    loop = PlanningLoop(Planner(select_passes(["codegen:output"]), None, calibrate=True), fingerprint, graph, None)
    loop.propose()
    with pytest.raises(ValueError, match=r"calibration on \['layout_cpu'\] needs"):
        loop.feedback(80.0, 10.0)
