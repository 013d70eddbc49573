"""The generated input kernel (code generation's ``input`` role): its permute, bucketize and recat
against TorchRec's / fbgemm's reference kernels on one process, and the pass's feasibility (the parity
harness runs it on 1-3 ranks against TorchRec)."""

from __future__ import annotations

import pytest
import torch

from graph_fixtures import EBC, load
from lightning_sparselift.ir.schedule import GENERATED_KERNEL, INPUT_KERNEL_GROUP, INPUT_REGIONS
from lightning_sparselift.passes.codegen import CodeGeneration
from lightning_sparselift.plan.types import KernelBuild
from lightning_sparselift.runtime.input_layout import InputKernel
from lightning_sparselift.runtime.kernels import bucketize_fbgemm, permute_torchrec, recat_fbgemm
from lightning_sparselift.session import mark_generated


def _kjt(keys: int, batch: int, lengths_dtype, values_dtype, weighted: bool, seed: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (keys * batch,), generator=g).to(lengths_dtype)  # empty bags included
    lengths[:batch] = 0  # a key without ids
    n = int(lengths.sum())
    values = torch.randint(0, 1000, (n,), generator=g).to(values_dtype)
    values[: n // 3] = 7  # duplicate ids
    weights = torch.rand(n, generator=g) if weighted else None
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(keys)], values=values, weights=weights, lengths=lengths,
                             stride=batch)


def _same_kjt(got, want):
    assert got.keys() == want.keys() and got.stride() == want.stride()
    for part in ("lengths", "values", "offsets", "weights_or_none"):
        a, b = getattr(got, part)(), getattr(want, part)()
        assert (a is None) == (b is None), part
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), part
    assert got.length_per_key() == want.length_per_key()
    assert got.offset_per_key() == want.offset_per_key()


DTYPES = [(torch.int64, torch.int64), (torch.int32, torch.int32), (torch.int32, torch.int64)]


@pytest.mark.parametrize("lengths_dtype, values_dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("order", [[2, 0, 3, 1], [3, 3, 1], [0]])
def test_the_generated_permute_is_torchrecs(lengths_dtype, values_dtype, weighted, order):
    features = _kjt(4, 5, lengths_dtype, values_dtype, weighted, seed=len(order))
    kernel = InputKernel(order, 4, [1], 1, torch.device("cpu"))
    want = permute_torchrec(features, order, torch.tensor(order, dtype=torch.int32))
    got = kernel.permute(features, order, torch.tensor(order, dtype=torch.int32))
    _same_kjt(got, want)
    # what the input distribution does next reads the per-key sums the kernel gave
    for a, b in zip(got.split([2, len(order) - 2] if len(order) > 2 else [len(order)]),
                    want.split([2, len(order) - 2] if len(order) > 2 else [len(order)])):
        _same_kjt(a, b)


@pytest.mark.parametrize("lengths_dtype, values_dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("world, keys", [(1, 3), (2, 3), (3, 2), (3, 1)])
def test_the_generated_recat_is_fbgemms(lengths_dtype, values_dtype, weighted, world, keys):
    batch = 4
    # what arrived: [source][key][sample] lengths, each source's ids key after key
    arrived = _kjt(world * keys, batch, lengths_dtype, values_dtype, weighted, seed=world * 10 + keys)
    names = [f"k{i}" for i in range(keys)]
    recat = (torch.tensor([i + j * keys for i in range(keys) for j in range(world)], dtype=torch.int32)
             if world > 1 else None)
    args = (names, recat, arrived.lengths(), arrived.values(), arrived.weights_or_none(), batch, world)
    kernel = InputKernel([], world * keys, [5, keys], world, torch.device("cpu"))
    _same_kjt(kernel.recat(1, *args), recat_fbgemm(*args))


@pytest.mark.parametrize("lengths_dtype, values_dtype", DTYPES + [(torch.int64, torch.int32)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("world, blocks", [(2, [3, 500]), (3, [1, 334]), (1, [1000, 1000])])
@pytest.mark.parametrize("captured", [True, False])
def test_the_generated_bucketize_is_fbgemms(lengths_dtype, values_dtype, weighted, sequence, world, blocks, captured):
    features = _kjt(2, 6, lengths_dtype, values_dtype, weighted, seed=world)
    # ids past the last block (TorchRec's blocks cover every row; fbgemm sends the rest round-robin)
    features.values()[-2:] = torch.tensor([5000, 3 * world * max(blocks)], dtype=values_dtype)
    sizes = torch.tensor(blocks, dtype=torch.int64)
    # with the captured dtypes the block sizes are compiled in; with others they are read at run time
    types = (str(lengths_dtype)[6:], str(values_dtype)[6:]) if captured else \
        ("int32" if lengths_dtype == torch.int64 else "int64", str(values_dtype)[6:])
    kernel = InputKernel([], 2, [4, 2], world, torch.device("cpu"), [None, blocks], types)
    got, got_positions = kernel.bucketize(1, features, sizes, world, sequence)
    want, want_positions = bucketize_fbgemm(features, sizes, world, sequence)
    _same_kjt(got, want)
    assert (got_positions is None) == (want_positions is None) == (not sequence)
    if sequence:
        assert got_positions.dtype == want_positions.dtype and torch.equal(got_positions, want_positions)


def test_the_generated_input_kernel_refuses_what_it_was_not_built_for():
    kernel = InputKernel([1, 0], 2, [2], 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="built for 2 keys, the features have 3"):
        kernel.permute(_kjt(3, 2, torch.int64, torch.int64, False, 0), [1, 0], torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="built for 2 ranks, called for 3"):
        kernel.recat(0, ["a"], None, torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None, 1, 3)
    lengths = torch.zeros(4, dtype=torch.int16)
    with pytest.raises(TypeError, match="lengths of dtype torch.int16"):
        kernel.recat(0, ["a", "b"], None, lengths, torch.zeros(0, dtype=torch.int64), None, 1, 2)
    with pytest.raises(ValueError, match="group 0 was built with row blocks None"):
        kernel.bucketize(0, _kjt(2, 2, torch.int64, torch.int64, False, 0), torch.tensor([1, 1]), 2, False)
    with pytest.raises(ValueError, match="a block of at least one row"):
        InputKernel([1, 0], 2, [2], 2, torch.device("cpu"), [[4, 0]])
    with pytest.raises(Exception, match="dtypes \\('int16', 'int64'\\)"):
        InputKernel([0], 1, [1], 1, torch.device("cpu"), None, ("int16", "int64"))
    with pytest.raises(Exception, match="C\\+\\+ over host memory"):
        InputKernel([0], 1, [1], 1, torch.device("meta"))


def test_the_pass_proposes_the_input_kernel_only_where_every_rank_built_it():
    graph = load("two_modules_2ranks")
    module = graph.modules[0]

    def inputs(g):
        return {c.module: c for c in CodeGeneration().candidates(g) if c.role == "input"}

    assert inputs(graph)[module.path].reasons == ["no input kernel was built (the session builds them from the "
                                                   "lift on)"]
    mark_generated(graph, [KernelBuild(module.path, INPUT_KERNEL_GROUP, 0, "", 0.1, False),
                           KernelBuild(module.path, INPUT_KERNEL_GROUP, 1, "no compiler", 0.0, False)])
    assert inputs(graph)[module.path].reasons == ["rank 1: no compiler"]
    graph = load("two_modules_2ranks")
    module = graph.modules[0]
    mark_generated(graph, [KernelBuild(module.path, INPUT_KERNEL_GROUP, r, "", 0.1, r == 1) for r in range(2)])
    assert module.input_kernels == [GENERATED_KERNEL]
    candidate = inputs(graph)[module.path]
    assert candidate.feasible
    assert candidate.cost_inputs["ids"] == max(sum(s.values()) for s in module.ids_per_step)
    assert CodeGeneration().protocol_for("input").region == "input"
    applied = CodeGeneration().apply(graph, candidate)
    regions = [r for r in applied.module(module.path).schedule.regions if r.name in INPUT_REGIONS]
    assert regions and all(r.kernel == GENERATED_KERNEL for r in regions)
    assert "the input side runs its generated kernel" in applied.provenance[-1]
    assert inputs(applied)[module.path].reasons == ["already scheduled"]
    # the other module's regions are untouched
    other = applied.modules[1]
    assert all(r.kernel != GENERATED_KERNEL for r in other.schedule.regions if r.name in INPUT_REGIONS)


def test_a_row_wise_groups_bucketize_runs_the_input_kernel_too():
    graph = load("row_wise_and_data_parallel_3ranks")
    module = graph.module(EBC)
    mark_generated(graph, [KernelBuild(EBC, INPUT_KERNEL_GROUP, r, "", 0.1, True) for r in range(3)])
    (candidate,) = [c for c in CodeGeneration().candidates(graph) if c.role == "input"]
    applied = CodeGeneration().apply(graph, candidate)
    assert [(r.name, r.kernel) for r in applied.module(EBC).schedule.regions if r.name in INPUT_REGIONS] == [
        ("permute", GENERATED_KERNEL), ("bucketize", GENERATED_KERNEL), ("recat", GENERATED_KERNEL)]
    assert "(bucketize, permute, recat:" in applied.provenance[-1]
    assert module.schedule.region("bucketize", 0).kernel == "fbgemm"  # (the pass rewrote a copy)


def test_a_module_that_neither_permutes_nor_exchanges_has_no_input_candidate():
    graph = load("table_wise_1rank")
    module = graph.module(EBC)
    module.schedule.regions = [r for r in module.schedule.regions if r.name not in INPUT_REGIONS]
    (candidate,) = [c for c in CodeGeneration().candidates(graph) if c.role == "input"]
    assert candidate.reasons == ["no permute, bucketize or recat region: the features are neither reordered nor "
                                 "exchanged"]
