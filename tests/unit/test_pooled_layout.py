"""The pooled output all-to-all's layout (``runtime/layout.py``) on one process: the gradient that
comes back is divided by world size as TorchRec's is, unless the layout says not (the bench's DLRM
baseline, as the reference DLRM)."""

from __future__ import annotations

import pytest
import torch

from lightning_sparselift.runtime.buffers import Buffers
from lightning_sparselift.runtime.layout import ExchangeBuffers, PooledLayout


def _layout(dims: list[list[int]], divide_grads: bool) -> PooledLayout:
    return PooledLayout(dims, 4, None, [None] * len(dims), 1, ExchangeBuffers.of(Buffers(), [0]),
                        divide_grads=divide_grads)


@pytest.mark.parametrize("dims", [[[3, 2]], [[3, 2], [1, 4]]], ids=["one group", "two groups"])
def test_gradients_are_divided_by_world_size_unless_told_not(dims):
    world, local = 2, sum(4 * d[1] for d in dims)
    received = torch.arange(world * local, dtype=torch.float32)
    divided = _layout(dims, True).unpack_grads(received.clone())
    kept = _layout(dims, False).unpack_grads(received.clone())
    assert [g.shape for g in kept] == [g.shape for g in divided] == [(world * 4, d[1]) for d in dims]
    assert all(torch.equal(d, k / world) for d, k in zip(divided, kept))
    assert sorted(torch.cat([k.reshape(-1) for k in kept]).tolist()) == received.tolist()
