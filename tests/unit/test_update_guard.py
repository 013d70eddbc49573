"""The update guard the lifted executor puts before every module's output region: its check runs
once per backward, before any gradient reaches what lies behind it (the exchanges, the fused
updates), and the gradients pass on unchanged, in the memory they were written to."""

from __future__ import annotations

import pytest
import torch

from lightning_sparselift.runtime.update_guard import guarded


class Stop(Exception):
    pass


def _received() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Two leaf tensors standing for what the exchanges received; ``order`` records their gradients' arrival."""
    order: list[str] = []
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    a.register_hook(lambda g: order.append("a") if g is not None else None)
    b.register_hook(lambda g: order.append("b") if g is not None else None)
    return a, b, order


def test_the_check_runs_once_before_the_gradients_go_on_unchanged():
    a, b, order = _received()
    def check():
        order.append("check")

    out = guarded(check, [a, None, b])
    assert out[1] is None
    (out[0] * 2).sum().backward(retain_graph=True)
    assert order == ["check", "a"] and b.grad is None  # (b's output was not used: no gradient, not zeros)
    order.clear()
    torch.cat([out[0], out[2]], dim=1).pow(2).sum().backward()
    assert order[0] == "check" and sorted(order[1:]) == ["a", "b"]
    assert torch.equal(a.grad, 2 * torch.ones_like(a) + 2 * a.detach())


def test_the_gradient_passes_in_its_own_memory():
    """The consumer layout writes the gradient into the gradient all-to-all's send buffer: the
    guard hands that very buffer on."""
    a, _, _ = _received()
    written = torch.randn(4, 3)
    seen: list[int] = []

    class Source(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad.data_ptr())
            return grad

    class Layout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return written

    (out,) = guarded(lambda: None, [Source.apply(a)])
    Layout.apply(out).sum().backward()
    assert seen == [written.data_ptr()]


def test_a_check_that_raises_stops_backward_before_any_gradient_passes():
    a, b, order = _received()

    def check():
        raise Stop("not this step")

    out = guarded(check, [a, b])
    with pytest.raises(Stop, match="not this step"):
        torch.cat(out, dim=1).sum().backward()
    assert order == [] and a.grad is None and b.grad is None


def test_without_gradients_nothing_is_wrapped():
    x = torch.randn(2, 2)
    with torch.no_grad():
        y = torch.randn(2, 2, requires_grad=True) * 1
    assert guarded(lambda: None, [x, y, None]) == [x, y, None]
