"""The capture times a lookup's whole backward: an EmbeddingCollection's lookup returns a view of
fbgemm's output (several groups: a cat of theirs), so the output's own autograd node is a view
whose backward is nothing; fbgemm's backward with the fused update runs in the node below it."""

from __future__ import annotations

import time

import torch

from lightning_sparselift.frontend.capture import _lookup_nodes


class _Lookup(torch.autograd.Function):
    """Stands in for fbgemm's lookup: a backward that costs CPU."""

    @staticmethod
    def forward(ctx, weights):
        return weights * 2

    @staticmethod
    def backward(ctx, grad):
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return grad * 2


def test_the_nodes_below_a_lookups_view_are_timed():
    weights = torch.ones(4, 3, requires_grad=True)
    output = _Lookup.apply(weights).view(-1)
    nodes = _lookup_nodes(output)
    names = [type(n).__name__ for n in nodes]
    assert names[0] == "ViewBackward0" and any("_Lookup" in n for n in names)
    assert not any(n == "AccumulateGrad" for n in names)  # (the tables' own: not the lookup's work)
    spent: list[float] = []
    for node in nodes:
        started: list[float] = []
        node.register_prehook(lambda *_, started=started: started.append(time.thread_time()))
        node.register_hook(lambda *_, started=started: spent.append(time.thread_time() - started.pop()))
    output.sum().backward()
    assert sum(spent) >= 0.018  # the view's node alone took microseconds


def test_an_output_without_a_gradient_has_no_nodes():
    assert _lookup_nodes(torch.ones(3)) == [] and _lookup_nodes(None) == []
