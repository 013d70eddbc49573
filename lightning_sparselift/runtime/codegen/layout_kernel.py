"""The consumer layout's generated kernel (:mod:`~lightning_sparselift.runtime.consumer_layout`):
C++ with the module's blocks and their runs of columns unrolled, which copies every received block
into the consumer's rows and the gradient back, built once per module (whatever its schedule) and
cached by the hash of its source."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_sparselift.ir import LiftedModule
from lightning_sparselift.ir.vocab import output_collective
from lightning_sparselift.runtime.codegen.build import build
from lightning_sparselift.runtime.codegen.spec import Unsupported

Runs = list[tuple[int, int, int]]  # (first column in the block, first column in the consumer's tensor, width)


def _runs(destinations: list[int]) -> Runs:
    """Per column of a block, its column in the consumer's tensor, as runs of consecutive columns."""
    runs: Runs = []
    for col, dst in enumerate(destinations):
        if runs and runs[-1][0] + runs[-1][2] == col and runs[-1][1] + runs[-1][2] == dst:
            first, to, width = runs[-1]
            runs[-1] = (first, to, width + 1)
        else:
            runs.append((col, dst, 1))
    return runs


@dataclass(frozen=True)
class Block:
    """A [B, width] piece of a group's output as it arrives: one source rank's columns of an
    all-to-all group (``rank``), or the whole output of a group that is not exchanged that way."""

    group: int
    rank: Optional[int]
    width: int
    runs: tuple[tuple[int, int, int], ...]


def layout_blocks(spec: LiftedModule, world: int) -> tuple[int, list[int], list[Block]]:
    """The consumer tensor's width, the widths of the keys in the consumer's order, and the blocks
    the module's output arrives in, each with the runs of its columns' places there. Independent
    of the schedule: buckets only change where a block lies in memory."""
    consumer = spec.consumer
    if consumer is None or not spec.pooled or spec.mean_after_reduce:
        raise LookupError(f"{spec.path}: no consumer layout: " + (
            spec.consumer_note or "not pooled" if consumer is None or not spec.pooled else
            "the mean after the reduce-scatter rescales the whole output afterwards"))
    dims: dict[str, int] = {}  # (a key's column shards, if listed one by one, add up)
    for key, dim in zip(spec.embedding_names, spec.embedding_dims):
        dims[key] = dims.get(key, 0) + dim
    if sorted(dims) != sorted(consumer.keys):
        raise LookupError(f"{spec.path}: the captured concatenation holds keys {consumer.keys}, the module outputs "
                          f"{sorted(dims)}")
    at, column = {}, consumer.before
    for key in consumer.keys:
        at[key], column = column, column + dims[key]
    width = column + consumer.after
    blocks = []
    for g in spec.groups:
        to: list[int] = []  # each output column's place in the consumer's tensor
        for key, dim in zip(g.embedding_names, g.embedding_dims):
            to += range(at[key], at[key] + dim)
            at[key] += dim
        if world > 1 and output_collective(g.kind, True) == "all_to_all_single":
            # column c of the group's blocks, concatenated by source rank, is output column j where order[j] == c
            order = g.column_order or list(range(sum(g.dim_sum_per_rank)))
            output_col = {c: j for j, c in enumerate(order)}
            start = 0
            for rank, w in enumerate(g.dim_sum_per_rank):
                blocks.append(Block(g.index, rank, w, tuple(_runs([to[output_col[start + k]] for k in range(w)]))))
                start += w
        else:
            blocks.append(Block(g.index, None, len(to), tuple(_runs(to))))
    return width, [dims[k] for k in consumer.keys], [b for b in blocks if b.width]


def layout_source(width: int, blocks: list[Block]) -> str:
    """C++ that copies every block's rows into the consumer's rows and back, the runs unrolled;
    the ``_bf16`` entry points also convert the exchanged blocks (an all-to-all's, ``Block.rank``
    set) from and to BF16 as they copy them (the communication-precision pass's wire), with
    torch's rounding (to nearest, ties to even)."""
    def copies(forward: bool, bf16: bool) -> str:
        lines = []
        for k, b in enumerate(blocks):
            for first, to, n in b.runs:
                at = f"b * {b.width} + {first}"  # the run's first element in the block
                if not bf16:  # bytes (E per element)
                    block, here = f"blocks[{k}] + ({at}) * E", f"row + {to} * E"
                    lines.append(f"            std::memcpy({here}, {block}, {n} * E);" if forward else
                                 f"            std::memcpy({block}, {here}, {n} * E);")
                elif b.rank is None:  # float32, not exchanged
                    const = "const " if forward else ""
                    block = f"reinterpret_cast<{const}float*>(blocks[{k}]) + {at}"
                    lines.append(f"            std::memcpy(row + {to}, {block}, {n} * 4);" if forward else
                                 f"            std::memcpy({block}, row + {to}, {n} * 4);")
                else:  # exchanged as BF16
                    const = "const " if forward else ""
                    copy = "row[{to} + c] = sl_float(block[c])" if forward else "block[c] = sl_bf16(row[{to} + c])"
                    lines.append(f"            {{ auto* block = reinterpret_cast<{const}uint16_t*>(blocks[{k}]) + {at}; "
                                 f"for (int64_t c = 0; c < {n}; ++c) {copy.format(to=to)}; }}")
        return "\n".join(lines)

    return f"""// generated by lightning_sparselift: a module's pooled output into its consumer's layout
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float sl_float(uint16_t h) {{
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}}

static inline uint16_t sl_bf16(float f) {{  // torch's (c10::BFloat16): to nearest, ties to even
    if (std::isnan(f)) return UINT16_C(0x7FC0);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + ((u >> 16) & 1) + UINT32_C(0x7FFF)) >> 16);
}}

template <int64_t E>
static void forward(int64_t B, char* const* blocks, char* out) {{
    for (int64_t b = 0; b < B; ++b) {{
        char* row = out + b * {width} * E;
{copies(True, False)}
    }}
}}

template <int64_t E>
static void backward(int64_t B, int64_t stride, const char* grad, char* const* blocks) {{
    for (int64_t b = 0; b < B; ++b) {{
        const char* row = grad + b * stride * E;
{copies(False, False)}
    }}
}}

static void forward_bf16(int64_t B, char* const* blocks, float* out) {{
    for (int64_t b = 0; b < B; ++b) {{
        float* row = out + b * {width};
{copies(True, True)}
    }}
}}

static void backward_bf16(int64_t B, int64_t stride, const float* grad, char* const* blocks) {{
    for (int64_t b = 0; b < B; ++b) {{
        const float* row = grad + b * stride;
{copies(False, True)}
    }}
}}

extern "C" int64_t sl_layout_forward(int64_t B, int64_t element, char* const* blocks, char* out) {{
    switch (element) {{
        case 2: forward<2>(B, blocks, out); return 0;
        case 4: forward<4>(B, blocks, out); return 0;
        case 8: forward<8>(B, blocks, out); return 0;
    }}
    return 1;
}}

extern "C" int64_t sl_layout_backward(int64_t B, int64_t element, int64_t stride, const char* grad,
                                      char* const* blocks) {{
    switch (element) {{
        case 2: backward<2>(B, stride, grad, blocks); return 0;
        case 4: backward<4>(B, stride, grad, blocks); return 0;
        case 8: backward<8>(B, stride, grad, blocks); return 0;
    }}
    return 1;
}}

extern "C" void sl_layout_forward_bf16(int64_t B, char* const* blocks, float* out) {{
    forward_bf16(B, blocks, out);
}}

extern "C" void sl_layout_backward_bf16(int64_t B, int64_t stride, const float* grad, char* const* blocks) {{
    backward_bf16(B, stride, grad, blocks);
}}
"""


_ENTRY_POINTS = {"sl_layout_forward": (ctypes.c_int64, [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                        ctypes.c_void_p]),
                 "sl_layout_backward": (ctypes.c_int64, [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                         ctypes.c_void_p, ctypes.c_void_p]),
                 "sl_layout_forward_bf16": (None, [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]),
                 "sl_layout_backward_bf16": (None, [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p])}


class LayoutKernel:
    """A module's generated layout kernel (built once per module, whatever its schedule)."""

    def __init__(self, spec: LiftedModule, world: int, device: torch.device) -> None:
        if device.type != "cpu":
            raise Unsupported(f"the layout kernel is C++ over host memory; on {device.type} the model's concatenation "
                              f"copies as with TorchRec")
        self.width, self.dims, self.blocks = layout_blocks(spec, world)
        self.built = build(layout_source(self.width, self.blocks), _ENTRY_POINTS, "layout")
