"""The memory of a buffer the runtime fills every step (a generated lookup's output, what an
all-to-all receives, the consumer layout's tensor, a gradient's send buffer, a pipelined bucket's
copies), kept from step to step on CPU.

glibc maps large blocks on allocation and may hand them back to the kernel on free, so a fresh
multi-megabyte CPU tensor can be paid in page faults again every step: alone, writing a fresh
7 MB tensor cost ~4x writing the same bytes into a kept one on the development machine (1.29 vs
0.34 ms). Inside a training step glibc reuses most freed blocks itself, and keeping the buffers
saved less (``benchmarks/buffer_reuse.py``: ~5 ms of rank 0's CPU per sparse-heavy step, within
noise on dlrm). CUDA's caching allocator already keeps such blocks (and knows their streams), so
on CUDA every buffer is a fresh tensor.

A kept buffer is handed out again only when nothing else holds its memory: no tensor or view of
it (a model that keeps a step's output, an autograd node that saved it, a collective still in
flight) shows in its storage's use count, and then the next step gets other memory (a site keeps
up to two blocks). So reuse never changes a value anyone can read; only bytes that would have
been freed are written again.
"""

from __future__ import annotations

import math
from typing import Hashable

import torch
from torch import Tensor

# (a private function of torch's; without it nothing is reused)
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _holders(base: Tensor) -> int:
    return _use_count(base.untyped_storage()._cdata)


# memory kept per site: a second block serves a site whose buffer of the step before is still held
# when the next is needed (the next batch's input distribution, started while the current step's
# ids are saved for its backward)
KEPT = 2


class Buffer:
    """One allocation site's memory (a fresh tensor every call when ``reuse`` is off)."""

    def __init__(self, reuse: bool = True) -> None:
        self.reuse = reuse
        self._kept: list[tuple[Tensor, int]] = []  # (bytes never handed out themselves, their idle use count)
        self.reused = 0  # calls that got kept memory

    def release(self) -> None:
        """Let go of the kept memory (what a holder still uses stays theirs)."""
        self._kept = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialized contiguous tensor of ``shape`` (as ``torch.empty``)."""
        if not self.reuse or _use_count is None or device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * dtype.itemsize
        free = [i for i, (base, idle) in enumerate(self._kept) if _holders(base) == idle]
        fits = [i for i in free if self._kept[i][0].numel() >= nbytes]
        if fits:
            base = self._kept[fits[0]][0]
            self.reused += 1
        else:
            base = torch.empty(nbytes, dtype=torch.uint8)
            kept = (base, _holders(base))
            if free:  # (a free block too small is replaced)
                self._kept[free[0]] = kept
            elif len(self._kept) < KEPT:
                self._kept.append(kept)
            else:  # every kept block is held: the oldest is left to its holder
                self._kept = self._kept[1:] + [kept]
        # a tensor of its own on the kept storage (not a view: autograd sees an ordinary tensor)
        return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), 0, shape)


class Buffers:
    """A lifted module's buffers by site: they outlive the plan switches of calibration (which
    rebuild the exchanges every step), as the module's generated kernels do."""

    def __init__(self, reuse: bool = True) -> None:
        self._reuse = reuse
        self._sites: dict[Hashable, Buffer] = {}

    @property
    def reuse(self) -> bool:
        return self._reuse

    @reuse.setter
    def reuse(self, on: bool) -> None:
        """Every site's (off: fresh tensors, the kept memory let go)."""
        self._reuse = on
        for buffer in self._sites.values():
            buffer.reuse = on
            if not on:
                buffer.release()

    @property
    def reused(self) -> int:
        """Buffers handed out on kept memory so far."""
        return sum(b.reused for b in self._sites.values())

    def at(self, site: Hashable) -> Buffer:
        if site not in self._sites:
            self._sites[site] = Buffer(self.reuse)
        return self._sites[site]
