"""The step check's forward hook on every sparse module (no processes): the module's output
gradient waits for the check, and a TorchRec module's lazy output (its exchange in flight until the
model reads it) is not waited by the hook, so TorchRec's overlap of that exchange stays."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sparselift.lightning.step_check import StepCheck


def _lazy(values: torch.Tensor):
    """A module output as TorchRec's sharded modules return theirs: waited when first read."""
    from torchrec.distributed.types import LazyAwaitable
    from torchrec.sparse.jagged_tensor import KeyedTensor

    class Lazy(LazyAwaitable):
        def __init__(self) -> None:
            super().__init__()
            self.waits = 0

        def _wait_impl(self) -> KeyedTensor:
            self.waits += 1
            return KeyedTensor(["f"], [values.shape[1]], values)

    return Lazy()


class _Sparse(nn.Module):
    def __init__(self, lazy: bool) -> None:
        super().__init__()
        self.weight, self.lazy = nn.Parameter(torch.ones(2, 3)), lazy

    def forward(self, x: torch.Tensor):
        from torchrec.sparse.jagged_tensor import KeyedTensor

        values = self.weight * x
        return _lazy(values) if self.lazy else KeyedTensor(["f"], [3], values)


def _checked(lazy: bool) -> tuple[nn.Module, list[str]]:
    model = nn.Sequential()
    model.add_module("sparse", _Sparse(lazy))
    check = StepCheck(None, "raise", model, ["sparse"])
    order: list[str] = []
    check.before_update = lambda: order.append("check")  # (what the hook calls in backward)
    model.sparse.weight.register_hook(lambda grad: order.append("update"))
    return model, order


def test_a_lazy_output_is_not_waited_by_the_hook_and_its_gradient_still_waits_for_the_check():
    model, order = _checked(lazy=True)
    out = model.sparse(torch.ones(2, 3))
    assert out.waits == 0
    loss = out.values().sum()  # the model reads it: waited once, here
    assert out.waits == 1
    loss.backward()
    assert order == ["check", "update"]


def test_a_plain_output_is_hooked_at_once():
    model, order = _checked(lazy=False)
    model.sparse(torch.ones(2, 3)).values().sum().backward()
    assert order == ["check", "update"]


def test_nothing_is_hooked_outside_training():
    model, order = _checked(lazy=True)
    model.eval()
    out = model.sparse(torch.ones(2, 3))
    out.values().sum().backward()
    assert order == ["update"]
