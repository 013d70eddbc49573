"""The generated Triton lookup kernels (CUDA tables) against torch references: forward pooling and
the backward's fused update for SGD, Adagrad, rowwise Adagrad and Adam (Adam against
``torch.optim.Adam`` on the touched rows). On CPU they run under ``TRITON_INTERPRET=1`` (the same
source, interpreted); with a GPU the ``gpu`` tests run them compiled."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from lightning_sparselift.runtime.codegen.build import build_triton  # noqa: E402
from lightning_sparselift.runtime.codegen.lookup import build_kernel  # noqa: E402
from lightning_sparselift.runtime.codegen.spec import KernelSpec, TableSpec, Unsupported  # noqa: E402
from lightning_sparselift.runtime.codegen.triton_source import triton_source  # noqa: E402

# two tables: t0 (10 x 4) read by features 0 and 1, t1 (7 x 3, an odd dim) by feature 2
SHAPES = [(10, 4, 2), (7, 3, 1)]
BATCH = 3
# per feature, per bag: ids (an empty bag, duplicates within a bag and across features)
BAGS = [[[1, 1, 9], [], [0]], [[9], [4, 1], [1, 2, 3, 1]], [[6], [0, 0], []]]


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (conftest sets it without a GPU)


@pytest.fixture(params=["interpreted", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSELIFT_KERNEL_CACHE", str(tmp_path))
    if (request.param == "interpreted") != INTERPRETED:
        pytest.skip("Triton interprets kernels without a GPU only (decided when triton is imported)")
    return torch.device("cpu" if INTERPRETED else "cuda")


def make_spec(optimizer: str = "sgd", pooling: str = "sum", weighted: bool = False, check_ids: bool = False,
              shapes=SHAPES) -> KernelSpec:
    tables, offset, row_offset, feature = [], 0, 0, 0
    for rows, dim, features in shapes:
        state = row_offset if optimizer == "rowwise_adagrad" else offset
        tables.append(TableSpec(rows=rows, dim=dim, weights_offset=offset, state_offset=state,
                                first_feature=feature, end_feature=feature + features, state2_offset=offset))
        offset, row_offset, feature = offset + rows * dim, row_offset + rows, feature + features
    total = sum(dim * features for _, dim, features in shapes) if pooling != "none" else shapes[0][1]
    return KernelSpec(tables=tuple(tables), total_dim=total, pooling=pooling, weighted=weighted, optimizer=optimizer,
                      eps=1e-8 if optimizer != "adam" else 1e-6, check_ids=check_ids, device="cuda",
                      beta1=0.9 if optimizer == "adam" else 0.0, beta2=0.99 if optimizer == "adam" else 0.0)


def batch(dtype: torch.dtype, device: torch.device, bags=BAGS):
    ids = [i for feature in bags for bag in feature for i in bag]
    lengths = [len(bag) for feature in bags for bag in feature]
    offsets = torch.tensor([0] + lengths, dtype=dtype).cumsum(0).to(dtype)
    return torch.tensor(ids, dtype=dtype, device=device), offsets.to(device)


def tables_of(spec: KernelSpec, flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[t.weights_offset:t.weights_offset + t.rows * t.dim].view(t.rows, t.dim) for t in spec.tables]


def reference_forward(spec, flat, ids, offsets, psw):
    """Pooled bags in float64, feature after feature (KJT order)."""
    tables, out = tables_of(spec, flat.double()), []
    ids, offsets = ids.cpu().long(), offsets.cpu().long()
    psw = psw.cpu().double() if psw is not None else None
    for f, (t, dim, _) in enumerate(spec.features):
        bags = []
        for b in range(BATCH):
            begin, end = int(offsets[f * BATCH + b]), int(offsets[f * BATCH + b + 1])
            rows = tables[t][ids[begin:end]]
            if psw is not None:
                rows = rows * psw[begin:end, None]
            pooled = rows.sum(0) if end > begin else torch.zeros(dim, dtype=torch.float64)
            bags.append(pooled / (end - begin) if spec.pooling == "mean" and end > begin else pooled)
        out.append(torch.stack(bags))
    return torch.cat(out, dim=1)


def row_gradients(spec, ids, offsets, psw, grad):
    """Per (table, row): its summed gradient in float64."""
    ids, offsets, grad = ids.cpu().long(), offsets.cpu().long(), grad.cpu().double()
    out: dict[tuple[int, int], torch.Tensor] = {}
    for f, (t, dim, column) in enumerate(spec.features):
        for b in range(BATCH):
            begin, end = int(offsets[f * BATCH + b]), int(offsets[f * BATCH + b + 1])
            for p in range(begin, end):
                scale = float(psw[p]) if psw is not None else (1 / (end - begin) if spec.pooling == "mean" else 1.0)
                g = grad[b, column:column + dim] * scale
                key = (t, int(ids[p]))
                out[key] = out.get(key, 0) + g
    return out


def run(spec, device, flat, ids, offsets, psw=None, grad=None, state1=None, state2=None, lr=0.1, iteration=1):
    module = build_triton(triton_source(spec), "lookup").library
    out = torch.empty(BATCH, spec.total_dim, device=device)
    assert module.forward(BATCH, ids, offsets, psw, flat, out) == -1
    if grad is not None:
        assert module.backward(BATCH, ids, offsets, psw, grad, flat, state1, state2, lr, iteration) == -1
    return out


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_forward_pools_like_the_reference(device, dtype, pooling, weighted):
    spec = make_spec(pooling=pooling, weighted=weighted)
    torch.manual_seed(0)
    flat = torch.randn(sum(t.rows * t.dim for t in spec.tables), device=device)
    ids, offsets = batch(dtype, device)
    psw = torch.rand(ids.numel(), device=device) if weighted else None
    out = run(spec, device, flat, ids, offsets, psw)
    # a float32 sum of n terms is within n u / (1 - n u) of their absolute sum (u = 2^-24; the mean's
    # scale and division round once more)
    exact = reference_forward(spec, flat.cpu(), ids, offsets, psw)
    magnitude = reference_forward(spec, flat.cpu().abs(), ids, offsets, psw.abs() if weighted else None)
    u, n = 2.0 ** -24, 4 + 2
    assert ((out.cpu().double() - exact).abs() <= n * u / (1 - n * u) * magnitude).all()
    assert (out[1, :4] == 0).all()  # the empty bag


def test_rows_per_id_without_pooling(device):
    spec = make_spec(pooling="none", shapes=[(10, 4, 2), (7, 4, 1)])
    flat = torch.randn(sum(t.rows * t.dim for t in spec.tables), device=device)
    ids, offsets = batch(torch.int64, device)
    module = build_triton(triton_source(spec), "lookup").library
    out = torch.full((ids.numel(), 4), float("nan"), device=device)
    assert module.forward(BATCH, ids, offsets, None, flat, out) == -1
    tables = tables_of(spec, flat)
    expected = [tables[spec.features[f][0]][int(ids[p])] for f in range(3)
                for p in range(int(offsets[f * BATCH]), int(offsets[(f + 1) * BATCH]))]
    assert torch.equal(out, torch.stack(expected))  # copies: exact


def test_an_out_of_range_id_is_reported_when_the_kernel_checks(device):
    spec = make_spec(check_ids=True)
    flat = torch.randn(sum(t.rows * t.dim for t in spec.tables), device=device)
    bags = [feature[:] for feature in BAGS]
    bags[2] = [[6], [0, 7], []]  # table t1 has 7 rows
    ids, offsets = batch(torch.int64, device, bags)
    module = build_triton(triton_source(spec), "lookup").library
    out = torch.empty(BATCH, spec.total_dim, device=device)
    assert module.forward(BATCH, ids, offsets, None, flat, out) == ids.numel() - 1


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_backward_applies_the_fused_update(device, optimizer, pooling, weighted):
    spec = make_spec(optimizer, pooling, weighted)
    torch.manual_seed(1)
    flat = torch.randn(sum(t.rows * t.dim for t in spec.tables), device=device)
    state_size = sum(t.rows for t in spec.tables) if optimizer == "rowwise_adagrad" else flat.numel()
    state1 = torch.rand(state_size, device=device) if optimizer != "sgd" else None
    before, state_before = flat.clone().cpu().double(), state1.clone().cpu().double() if state1 is not None else None
    ids, offsets = batch(torch.int64, device)
    psw = torch.rand(ids.numel(), device=device) if weighted else None
    grad = torch.randn(BATCH, spec.total_dim, device=device)
    lr = 0.05
    run(spec, device, flat, ids, offsets, psw, grad, state1, lr=lr)
    expected, expected_state = before.clone(), state_before.clone() if state_before is not None else None
    for (t, row), g in row_gradients(spec, ids, offsets, psw, grad).items():
        table = spec.tables[t]
        at = slice(table.weights_offset + row * table.dim, table.weights_offset + (row + 1) * table.dim)
        if optimizer == "sgd":
            expected[at] -= lr * g
        elif optimizer == "adagrad":
            expected_state[at] += g * g
            expected[at] -= lr * g / (expected_state[at].sqrt() + spec.eps)
        else:
            h = table.state_offset + row
            expected_state[h] += (g * g).mean()
            expected[at] -= lr * g / (expected_state[h].sqrt() + spec.eps)
    torch.testing.assert_close(flat.cpu().double(), expected, rtol=1e-5, atol=1e-6)
    if state1 is not None:
        torch.testing.assert_close(state1.cpu().double(), expected_state, rtol=1e-5, atol=1e-6)
    untouched = expected == before
    assert torch.equal(flat.cpu().double()[untouched], before[untouched])  # rows no id touched stay as they were


def test_adam_matches_torch_optim_adam_on_the_touched_rows(device):
    """Three steps of lazy Adam (fbgemm's: only the rows a step touches move, with the module's
    step count in the bias corrections) against torch.optim.Adam run on those rows."""
    spec = make_spec("adam", "sum", weighted=True)
    torch.manual_seed(2)
    flat = torch.randn(sum(t.rows * t.dim for t in spec.tables), device=device)
    m1, m2 = torch.zeros_like(flat), torch.zeros_like(flat)
    reference, ref_m1, ref_m2 = flat.cpu().clone(), m1.cpu().clone(), m2.cpu().clone()
    ids, offsets = batch(torch.int64, device)
    lr = 0.01
    for iteration in (1, 2, 3):
        psw = torch.rand(ids.numel(), device=device)
        grad = torch.randn(BATCH, spec.total_dim, device=device)
        run(spec, device, flat, ids, offsets, psw, grad, m1, m2, lr=lr, iteration=iteration)
        for (t, row), g in row_gradients(spec, ids, offsets, psw, grad).items():
            table = spec.tables[t]
            at = slice(table.weights_offset + row * table.dim, table.weights_offset + (row + 1) * table.dim)
            param = torch.nn.Parameter(reference[at].clone())
            param.grad = g.float()
            adam = torch.optim.Adam([param], lr=lr, betas=(spec.beta1, spec.beta2), eps=spec.eps, foreach=False)
            adam.state[param] = {"step": torch.tensor(float(iteration - 1)), "exp_avg": ref_m1[at].clone(),
                                 "exp_avg_sq": ref_m2[at].clone()}
            adam.step()
            reference[at], ref_m1[at], ref_m2[at] = param.detach(), adam.state[param]["exp_avg"], \
                adam.state[param]["exp_avg_sq"]
        torch.testing.assert_close(flat.cpu(), reference, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m1.cpu(), ref_m1, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(m2.cpu(), ref_m2, rtol=1e-5, atol=1e-8)


def test_the_module_is_written_once_and_found_in_the_cache(device):
    spec = make_spec()
    cold = build_triton(triton_source(spec), "lookup")
    warm = build_triton(triton_source(spec), "lookup")
    assert not cold.cached and warm.cached and cold.path == warm.path
    assert warm.library is cold.library
    assert build_triton(triton_source(make_spec("adagrad")), "lookup").path != cold.path


def test_device_tables_run_generated_kernels_only_under_fast_numerics(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSELIFT_KERNEL_CACHE", str(tmp_path))
    spec = make_spec()
    with pytest.raises(Unsupported, match="numerics='fast'"):
        build_kernel(spec, "exact")
    assert build_kernel(spec, "fast").library.TOTAL_D == spec.total_dim
    with pytest.raises(ValueError, match="numerics must be one of"):
        build_kernel(spec, "approximate")


# three tables for buckets: t0 (10 x 4, features 0-1), t1 (7 x 3, feature 2), t2 (5 x 4, feature 3)
THREE = SHAPES + [(5, 4, 1)]
THREE_BAGS = BAGS + [[[4, 4], [0], [3, 1, 4]]]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_buckets_give_the_one_bucket_results_bit_for_bit(device, optimizer, pooling, weighted):
    """Tables in 2 and 3 buckets (on a GPU: each on its own side stream) over three steps: the
    outputs, tables and optimizer state equal one bucket's exactly."""
    base = make_spec(optimizer, pooling, weighted, shapes=THREE)
    torch.manual_seed(5)
    size = sum(t.rows * t.dim for t in base.tables)
    state_size = sum(t.rows for t in base.tables) if optimizer == "rowwise_adagrad" else size
    start = (torch.randn(size), torch.rand(state_size), torch.rand(size))
    ids, offsets = batch(torch.int64, device, THREE_BAGS)
    steps = [(torch.rand(ids.numel(), device=device) if weighted else None,
              torch.randn(BATCH, base.total_dim, device=device)) for _ in range(3)]
    results = {}
    for buckets in [((0, 1, 2),), ((0, 2), (1,)), ((2,), (0,), (1,))]:
        spec = replace(base, buckets=buckets)
        flat, state1, state2 = (t.clone().to(device) for t in start)
        outs = [run(spec, device, flat, ids, offsets, psw, grad, state1 if optimizer != "sgd" else None,
                    state2 if optimizer == "adam" else None, iteration=i + 1) for i, (psw, grad) in enumerate(steps)]
        results[buckets] = [t.cpu() for t in (*outs, flat, state1, state2)]
        if device.type == "cuda":
            library = build_triton(triton_source(spec), "lookup").library
            assert len(library._streams.get(ids.device, [])) == (0 if len(buckets) == 1 else len(buckets))
    reference = results.pop(((0, 1, 2),))
    for buckets, tensors in results.items():
        assert all(torch.equal(a, b) for a, b in zip(reference, tensors)), buckets


def test_bucket_launches_are_grouped_in_the_source():
    spec = replace(make_spec(shapes=THREE), buckets=((0, 2), (1,)))
    source = triton_source(spec)
    forward0 = source[source.index("def forward0"):source.index("def backward0")]
    assert "FIRST=0," in forward0 and "FIRST=3," in forward0 and "FIRST=2," not in forward0
    assert "FORWARD = [forward0, forward1]" in source and "STREAMS = 2" in source
    many = replace(make_spec(shapes=THREE * 2), buckets=tuple((t,) for t in range(6)))
    assert "STREAMS = 4" in triton_source(many)  # a small pool, shared in turn


def test_the_source_bakes_the_tables_in():
    source = triton_source(make_spec("rowwise_adagrad"))
    assert "ROWS=10, D=4, BLOCK=4, WEIGHTS_AT=0" in source and "ROWS=7, D=3, BLOCK=4, WEIGHTS_AT=40" in source
    assert "STATE1_AT=10" in source  # t1's rowwise state starts after t0's 10 rows


def test_the_runtime_runs_the_triton_kernel_on_the_modules_device_storage(device):
    """TableBatchKernel on a device table: forward and autograd backward through the module's own
    weights and Adam state, its step counter advanced as fbgemm's forward advances it."""
    from types import SimpleNamespace

    KeyedJaggedTensor = pytest.importorskip("torchrec.sparse.jagged_tensor").KeyedJaggedTensor
    from lightning_sparselift.runtime.codegen.lookup import TableBatchKernel

    spec = make_spec("adam", "sum", weighted=True)
    torch.manual_seed(3)
    size = sum(t.rows * t.dim for t in spec.tables)
    tbe = SimpleNamespace(weights_dev=torch.randn(size, device=device), momentum1_dev=torch.zeros(size, device=device),
                          momentum2_dev=torch.zeros(size, device=device), learning_rate_tensor=torch.tensor(0.02),
                          iter=torch.zeros(1, dtype=torch.int64), iter_cpu=torch.zeros(1, dtype=torch.int64), step=0,
                          training=True, placeholder_autograd_tensor=torch.zeros(0, requires_grad=True))
    copy = {k: v.clone() for k, v in vars(tbe).items() if k.endswith("_dev")}
    kernel = TableBatchKernel(tbe, spec, build_kernel(spec, "fast"))
    ids, offsets = batch(torch.int64, device)
    lengths = offsets[1:] - offsets[:-1]
    for iteration in (1, 2):
        psw = torch.rand(ids.numel(), device=device)
        kjt = KeyedJaggedTensor(["f0", "f1", "f2"], ids, weights=psw, lengths=lengths)
        grad = torch.randn(BATCH, spec.total_dim, device=device)
        out = kernel(kjt)
        out.backward(grad)
        expected = run(spec, device, copy["weights_dev"], ids, offsets, psw, grad, copy["momentum1_dev"],
                       copy["momentum2_dev"], lr=0.02, iteration=iteration)
        assert torch.equal(out.detach(), expected)
        assert int(tbe.iter) == int(tbe.iter_cpu) == iteration
        for name, value in copy.items():
            assert torch.equal(getattr(tbe, name), value), name
