"""Triton source of a generated CUDA lookup kernel for one :class:`KernelSpec`.

The emitted module holds two ``@triton.jit`` kernels and two host functions whose launches carry
the rank's tables as compile-time constants (rows, dim, weight and state offsets, output column,
pooling, per-sample weights, id check, optimizer and its hyper-parameters), so Triton specialises
one binary per table shape:
- ``forward``: one program per (bag, feature): the bag's ids in order, ``acc + row`` or
  ``fma(weight, row, acc)``, mean pooling scaled by ``1 / length`` (rounded division); without
  pooling each id's row at its position. An out-of-range id is recorded (smallest position) when
  the kernel checks ids itself.
- ``backward``: the ids' occurrences sorted stably by (table, row) in torch (so each row's
  occurrences are visited in KJT order), then one program per distinct row sums its occurrences'
  gradients in that order and applies the fused update: SGD ``w = fma(g, -lr, w)``; Adagrad
  ``m = fma(g, g, m)``, ``w - lr * g / (sqrt(m) + eps)``; rowwise Adagrad on the row's mean
  square; Adam as fbgemm's CUDA template writes it (moments by ``fma`` after the decay, the bias
  corrections ``1 - beta^iter`` and the step in double).
These are fbgemm's CUDA formulas; whether every rounding matches its kernels (a warp reduces a
row's sum of squares in its own order, and a long run of one id is split over warps) is not
established without a GPU, so the runtime runs them only under ``numerics="fast"``.
With several buckets (subgraph parallelism) each bucket's launches are one function; on a GPU
bucket b runs on side stream b of a small fixed pool (made once per device, reused every step),
after the work queued so far on the caller's stream, which then waits for all of them. The
buckets share no table, feature or output column, and each runs the one-bucket launches of its
tables, so the results are the one-bucket kernel's bit for bit. The buckets allocate nothing on
their streams (the backward's sort runs before them, on the caller's stream), and every tensor they
read or write is recorded on their streams, so the caching allocator reuses none of it before they
are done.
Triton compiles each specialisation on its first launch (the calibration's warmup pair) into its
own cache; ``TRITON_INTERPRET=1`` runs the same source on CPU tensors (how the tests check it).
"""

from __future__ import annotations

from string import Template

from lightning_sparselift.runtime.codegen.spec import KernelSpec

_OPTIMIZER_CODES = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3}
# the side streams a kernel's buckets run on, at most (a small pool: each stream is reused every step)
MAX_STREAMS = 4

_MODULE = r'''
import numpy as np
import torch
import triton
import triton.language as tl

NO_BAD_ID = 2**63 - 1
TOTAL_D = $total_dim
POOLED = $pooled
WEIGHTED = $weighted
MEAN = $mean
CHECK = $check
# per feature (KJT order): its table, and its first output column (pooled)
FEATURE_TABLE = $feature_table
FEATURE_COLUMN = $feature_column
# per table: the first key of its rows (tables' rows side by side), and one past the last
ROW_BASE = $row_base
ADAM = $adam
BETA1 = $beta1
BETA2 = $beta2


@triton.jit
def pool(ids, offsets, psw, weights, out, bad, B,
         FIRST: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
         WEIGHTS_AT: tl.constexpr, COLUMN: tl.constexpr, TOTAL_D: tl.constexpr, POOLED: tl.constexpr,
         WEIGHTED: tl.constexpr, MEAN: tl.constexpr, CHECK: tl.constexpr):
    b = tl.program_id(0)
    f = FIRST + tl.program_id(1)
    begin = tl.load(offsets + f * B + b).to(tl.int64)
    end = tl.load(offsets + f * B + b + 1).to(tl.int64)
    d = tl.arange(0, BLOCK)
    lane = d < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(begin, end):
        row = tl.load(ids + p).to(tl.int64)
        if CHECK:
            outside = (row < 0) | (row >= ROWS)
            tl.atomic_min(bad, p, mask=outside)
            row = tl.where(outside, 0, row)
        values = tl.load(weights + WEIGHTS_AT + row * D + d, mask=lane, other=0.0)
        if POOLED:
            if WEIGHTED:
                acc = tl.fma(tl.load(psw + p), values, acc)
            else:
                acc = acc + values
        else:
            tl.store(out + p * D + d, values, mask=lane)
    if POOLED:
        if MEAN:
            length = tl.maximum(end - begin, 1).to(tl.float32)
            acc = acc * tl.math.div_rn(1.0, length)
        tl.store(out + b * TOTAL_D + COLUMN + (f - FIRST) * D + d, acc, mask=lane)


@triton.jit
def update(order, starts, keys, grad_at, scale, grad, weights, state1, state2, lr, corrections, first_unique,
           BASE: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, WEIGHTS_AT: tl.constexpr,
           STATE1_AT: tl.constexpr, STATE2_AT: tl.constexpr, SCALED: tl.constexpr, OPTIMIZER: tl.constexpr,
           EPS: tl.constexpr, BETA1: tl.constexpr, BETA2: tl.constexpr):
    u = first_unique + tl.program_id(0)
    s0 = tl.load(starts + u)
    s1 = tl.load(starts + u + 1)
    d = tl.arange(0, BLOCK)
    lane = d < D
    g = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(s0, s1):
        p = tl.load(order + s)
        occurrence = tl.load(grad + tl.load(grad_at + p) + d, mask=lane, other=0.0)
        if SCALED:
            g = tl.fma(tl.load(scale + p), occurrence, g)
        else:
            g = g + occurrence
    row = tl.load(keys + u) - BASE
    at = weights + WEIGHTS_AT + row * D + d
    w = tl.load(at, mask=lane, other=0.0)
    if OPTIMIZER == 0:  # SGD
        w = tl.fma(g, -lr, w)
    elif OPTIMIZER == 1:  # Adagrad
        m_at = state1 + STATE1_AT + row * D + d
        m = tl.fma(g, g, tl.load(m_at, mask=lane, other=0.0))
        tl.store(m_at, m, mask=lane)
        w = w - tl.math.div_rn(lr * g, tl.sqrt_rn(m) + EPS)
    elif OPTIMIZER == 2:  # rowwise Adagrad: one state per row
        mean_square = tl.sum(tl.where(lane, g * g, 0.0), axis=0) / D
        h = tl.load(state1 + STATE1_AT + row) + mean_square
        tl.store(state1 + STATE1_AT + row, h)
        multiplier = tl.math.div_rn(lr, tl.sqrt_rn(h) + EPS)
        w = w - multiplier * g
    else:  # Adam
        m1_at = state1 + STATE1_AT + row * D + d
        m2_at = state2 + STATE2_AT + row * D + d
        m1 = tl.fma(g, 1.0 - BETA1, tl.load(m1_at, mask=lane, other=0.0) * BETA1)
        m2 = tl.fma(g * g, 1.0 - BETA2, tl.load(m2_at, mask=lane, other=0.0) * BETA2)
        tl.store(m1_at, m1, mask=lane)
        tl.store(m2_at, m2, mask=lane)
        second = tl.sqrt_rn((m2.to(tl.float64) / tl.load(corrections + 1)).to(tl.float32)) + EPS
        step = (m1.to(tl.float64) / tl.load(corrections) / second.to(tl.float64)) * lr  # lr widened to double
        w = (w.to(tl.float64) - step).to(tl.float32)
    tl.store(at, w, mask=lane)


# side streams per device (at most a handful: buckets beyond it share them, in turn)
STREAMS = $streams
_streams = {}
_constants = {}


def _side_streams(device):
    if device not in _streams:
        _streams[device] = [torch.cuda.Stream(device) for _ in range(STREAMS)]
    return _streams[device]


def _in_buckets(buckets, *args):
    """Each bucket's launches with ``args``: with several buckets on a GPU, each on its side stream
    (see the module's docstring); else one after the other."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(buckets) == 1 or not tensors[0].is_cuda:
        for launch in buckets:
            launch(*args)
        return
    device = tensors[0].device
    caller = torch.cuda.current_stream(device)
    streams = _side_streams(device)[:len(buckets)]
    for stream in streams:
        stream.wait_stream(caller)
    for b, launch in enumerate(buckets):
        with torch.cuda.stream(streams[b % len(streams)]):
            launch(*args)
    for stream in streams:
        for tensor in tensors:
            tensor.record_stream(stream)
        caller.wait_stream(stream)


def _on(device):
    """The spec's per-feature and per-table constants as tensors on ``device`` (made once)."""
    if device not in _constants:
        _constants[device] = (torch.tensor(FEATURE_TABLE, dtype=torch.int64, device=device),
                              torch.tensor(FEATURE_COLUMN, dtype=torch.int64, device=device),
                              torch.tensor(ROW_BASE, dtype=torch.int64, device=device))
    return _constants[device]


def forward(B, ids, offsets, psw, weights, out):
    """Pool (or gather) every feature's bags into ``out``; the position of an out-of-range id, or -1."""
    if B == 0 or ids.numel() == 0:
        if POOLED:
            out.zero_()
        return -1
    # (unused arguments get any tensor)
    bad = torch.full((1,), NO_BAD_ID, dtype=torch.int64, device=ids.device) if CHECK else ids
    psw = psw if psw is not None else weights
    _in_buckets(FORWARD, B, ids, offsets, psw, weights, out, bad)
    if CHECK:
        position = int(bad.item())
        return -1 if position == NO_BAD_ID else position
    return -1


def backward(B, ids, offsets, psw, grad, weights, state1, state2, lr, iteration):
    """Each distinct row's gradient (occurrences in KJT order) and its fused update."""
    n = ids.numel()
    if B == 0 or n == 0:
        return -1
    feature_table, feature_column, row_base = _on(ids.device)
    position = torch.arange(n, device=ids.device)
    bag = torch.searchsorted(offsets.to(torch.int64), position, right=True) - 1
    feature = torch.div(bag, B, rounding_mode="floor")
    key = row_base[feature_table[feature]] + ids.to(torch.int64)
    keys, order = torch.sort(key, stable=True)
    keys, counts = torch.unique_consecutive(keys, return_counts=True)
    starts = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    if POOLED:
        grad_at = (bag - feature * B) * TOTAL_D + feature_column[feature]
    else:
        grad_at = position * TOTAL_D
    if WEIGHTED:
        scale = psw
    elif MEAN and POOLED:
        lengths = (offsets[1:] - offsets[:-1]).to(torch.float64)
        scale = (1.0 / lengths.clamp(min=1.0)).to(torch.float32)[bag]
    else:
        scale = grad
    table_first = torch.searchsorted(keys, row_base).tolist()
    state1 = state1 if state1 is not None else weights
    state2 = state2 if state2 is not None else weights
    # Adam's bias corrections, powf in float then 1 - it in double (as fbgemm's template; a float
    # argument would reach the kernel as float32)
    corrections = torch.tensor([1.0 - float(np.float32(beta) ** np.float32(iteration)) for beta in (BETA1, BETA2)],
                               dtype=torch.float64, device=ids.device) if ADAM else weights
    grad = grad.contiguous()
    _in_buckets(BACKWARD, order, starts, keys, grad_at, scale, grad, weights, state1, state2, lr, corrections,
                table_first)
    return -1


$buckets
'''


def _block(dim: int) -> int:
    """The power of two lanes a row of ``dim`` columns is loaded in."""
    block = 1
    while block < dim:
        block *= 2
    return block


def triton_source(spec: KernelSpec) -> str:
    """The kernel's Python module (Triton kernels, each bucket's launches, the host functions)."""
    pooled = spec.pooling != "none"
    features = spec.features
    scaled = spec.weighted or (spec.pooling == "mean")
    forward, backward = {}, {}
    row_base, rows = [], 0
    for t, table in enumerate(spec.tables):
        row_base.append(rows)
        rows += table.rows
        count = table.end_feature - table.first_feature
        column = features[table.first_feature][2]
        constants = f"D={table.dim}, BLOCK={_block(table.dim)}, WEIGHTS_AT={table.weights_offset}"
        forward[t] = (
            f"    pool[(B, {count})](ids, offsets, psw, weights, out, bad, B, FIRST={table.first_feature}, "
            f"ROWS={table.rows}, {constants}, COLUMN={column}, TOTAL_D=TOTAL_D, POOLED=POOLED, "
            f"WEIGHTED=WEIGHTED, MEAN=MEAN, CHECK=CHECK)" if count else "")
        backward[t] = (
            f"    if table_first[{t + 1}] > table_first[{t}]:\n"
            f"        update[(table_first[{t + 1}] - table_first[{t}],)](order, starts, keys, grad_at, scale, grad, "
            f"weights, state1, state2, lr, corrections, table_first[{t}], BASE={row_base[t]}, "
            f"{constants}, STATE1_AT={table.state_offset}, STATE2_AT={table.state2_offset}, "
            f"SCALED={scaled}, OPTIMIZER={_OPTIMIZER_CODES[spec.optimizer]}, "
            f"EPS={spec.eps!r}, BETA1={spec.beta1!r}, BETA2={spec.beta2!r})")
    row_base.append(rows)
    functions = []
    for b, tables in enumerate(spec.buckets):
        launches = [forward[t] for t in tables if forward[t]] or ["    pass"]
        functions.append(f"def forward{b}(B, ids, offsets, psw, weights, out, bad):\n" + "\n".join(launches))
        functions.append(f"def backward{b}(order, starts, keys, grad_at, scale, grad, weights, state1, state2, lr, "
                         f"corrections, table_first):\n" + "\n".join(backward[t] for t in tables))
    count = len(spec.buckets)
    functions.append(f"FORWARD = [{', '.join(f'forward{b}' for b in range(count))}]\n"
                     f"BACKWARD = [{', '.join(f'backward{b}' for b in range(count))}]")
    return Template(_MODULE).substitute(
        total_dim=spec.total_dim, pooled=pooled, weighted=spec.weighted, mean=spec.pooling == "mean",
        check=spec.check_ids, feature_table=[f[0] for f in features], feature_column=[f[2] for f in features],
        row_base=row_base, buckets="\n\n\n".join(functions), streams=min(count, MAX_STREAMS),
        adam=spec.optimizer == "adam", beta1=repr(spec.beta1), beta2=repr(spec.beta2))
