"""The point every lifted schedule's backward passes before anything is updated.

A module's fused embedding update runs inside backward, after its gradients' exchanges; whether
the step may update at all (e.g. a non-finite batch on some rank) is known only once the ranks
have compared what they saw. The gradient of a module's output reaches the output region's
backward first, whatever the schedule: the output kernel (TorchRec's KeyedTensor, or the consumer
layout that writes the gradient straight into the exchange's send buffers), then the gradient
exchanges, then the lookups' fused updates. So the executor hands the output region what the
output exchanges received through :func:`guarded`, whose backward calls the check before passing
the gradients on: no schedule a pass can write reaches an update without passing it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

UpdateCheck = Callable[[], None]  # raises to stop the step before any update


def no_check() -> None:
    pass


class _BeforeUpdate(torch.autograd.Function):
    """Identity on the module's received outputs; backward calls the check, then passes the gradients on."""

    @staticmethod
    def forward(ctx: Any, check: UpdateCheck, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.check = check
        ctx.set_materialize_grads(False)  # (a received tensor whose output the model never read gets no gradient)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        ctx.check()
        return (None, *grads)


def guarded(check: UpdateCheck, outs: list[Optional[Tensor]]) -> list[Optional[Tensor]]:
    """``outs`` (None for a group whose output lies in another's buffer) as the output region
    must receive them: their gradients go on only after ``check`` returned."""
    present = [i for i, t in enumerate(outs) if t is not None and t.requires_grad]
    if not present:
        return outs
    through = _BeforeUpdate.apply(check, *(outs[i] for i in present))
    out = list(outs)
    for i, tensor in zip(present, through):
        out[i] = tensor
    return out
