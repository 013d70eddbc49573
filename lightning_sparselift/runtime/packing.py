"""Byte packing: tensors of different dtypes moved by one all-to-all. Per destination rank, its
slice of every section, sections ordered by element size (largest first, so every section starts
aligned to its element size), each destination's chunk padded to the packing alignment."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_sparselift.ir.vocab import aligned


def packed_sizes(layout: list[tuple[torch.dtype, list[int]]], world: int) -> list[int]:
    """Bytes per rank of a packed buffer holding, per rank, ``counts[rank]`` elements of each section."""
    return [aligned(sum(counts[rank] * dtype.itemsize for dtype, counts in layout)) for rank in range(world)]


def _section_order(dtypes: list[torch.dtype]) -> list[int]:
    return sorted(range(len(dtypes)), key=lambda i: -dtypes[i].itemsize)


def pack_by_destination(sections: list[tuple[Tensor, list[int]]], world: int) -> tuple[Tensor, list[int]]:
    """One uint8 buffer holding, for each destination rank in turn, its slice of every section
    (``counts[rank]`` consecutive elements of each 1-D tensor): a lossless byte-level packing.
    Returns the buffer and bytes per destination.

    Example (2 ranks; values int64 counts [2, 1], lengths int32 counts [1, 1])::

        [v0 v1 | l0 pad] [v2 | l1 pad]     each destination chunk 8-byte aligned
    """
    order = _section_order([t.dtype for t, _ in sections])
    pieces: list[list[Tensor]] = [[] for _ in range(world)]
    for i in order:
        tensor, counts = sections[i]
        for rank, piece in enumerate(tensor.contiguous().view(torch.uint8).split(
                [c * tensor.element_size() for c in counts])):
            pieces[rank].append(piece)
    sizes = packed_sizes([(t.dtype, c) for t, c in sections], world)
    device = sections[0][0].device
    chunks = []
    for rank in range(world):
        used = sum(p.numel() for p in pieces[rank])
        chunks.extend(pieces[rank])
        if sizes[rank] > used:
            chunks.append(torch.zeros(sizes[rank] - used, dtype=torch.uint8, device=device))
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=device), sizes


def unpack_by_source(buffer: Tensor, layout: list[tuple[torch.dtype, list[int]]], sizes: list[int]) -> list[Tensor]:
    """Inverse of :func:`pack_by_destination` on the receiving side: per section, the elements
    every source rank sent, concatenated in source order."""
    order = _section_order([dtype for dtype, _ in layout])
    parts: list[list[Tensor]] = [[] for _ in layout]
    for rank, chunk in enumerate(buffer.split(sizes)):
        offset = 0
        for i in order:
            dtype, counts = layout[i]
            nbytes = counts[rank] * dtype.itemsize
            parts[i].append(chunk[offset:offset + nbytes].view(dtype))
            offset += nbytes
    return [torch.cat(p) if len(p) > 1 else p[0].clone() for p in parts]
