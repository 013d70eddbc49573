"""Non-finite values in a training step, caught on every rank before backward updates anything.

The embedding optimizer is fused into backward, so one ``inf`` in a dense feature on one rank
turns that rank's loss, then every rank's tables (through the all-to-alls) and dense weights
(through DDP's all-reduce) into NaN for good. So after the forward and before backward, every
rank shares what it saw: non-finite values in the floating-point tensors of its batch (dense
features, labels, sample weights; the sparse features are checked by
:mod:`lightning_sparselift.validation`), whether its loss is finite, and whether its batch has any
sample. Then all ranks raise the same error before the first update, or (``non_finite="skip"``)
all skip the step; a step where every rank's batch is empty is skipped too (its loss has no
samples to average).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparselift.frontend.capture import describe_path, find_objects

NON_FINITE_POLICIES = ("raise", "skip")
# what a rank found in its batch: the first tensor with non-finite values (its index among the
# batch's floating-point tensors), the column and row of its first one, and how many it holds
_NOTHING_FOUND = (-1, -1, -1, 0)


class NonFiniteError(RuntimeError):
    pass


def dense_leaves(batch: Any) -> list[tuple[list[list[Any]], Tensor]]:
    """The floating-point tensors of a batch with their access paths (KJTs are not entered)."""
    return find_objects((batch,), {}, lambda obj: isinstance(obj, Tensor) and obj.is_floating_point(), depth=3)


def _loss_of(output: Any) -> Optional[Tensor]:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def _batch_size(batch: Any) -> int:
    """Samples in the batch as its sparse features count them (-1: it holds no KJT)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjts = find_objects((batch,), {}, lambda obj: isinstance(obj, KeyedJaggedTensor), depth=3)
    return kjts[0][1].stride() if kjts else -1


class StepCheck:
    """Run :meth:`inspect` on the batch before the training step's forward, :meth:`verdict` on
    its output before backward and :meth:`before_update` before any parameter changes; all
    ranks call all three for every training step.

    The ranks' findings travel in one all-gather started by :meth:`verdict`. Skipping a step has
    to be decided before backward, so with ``skip`` (or an empty batch) :meth:`verdict` waits for
    it. Raising can wait until the first update: the gradient of each sparse module's output
    (computed before any embedding update, which happens in backward) and the optimizer step call
    :meth:`before_update`, so the all-gather runs while backward computes the dense part."""

    def __init__(self, group: Any, policy: str, model: nn.Module, sparse_module_paths: list[str]) -> None:
        # policy: one of NON_FINITE_POLICIES (the strategy checks the option when it is constructed)
        self.group, self.policy = group, policy
        self.skipped = 0  # steps skipped on every rank
        self._batch: Any = None
        self._dense: list[tuple[list[list[Any]], Tensor]] = []
        self._found = list(_NOTHING_FOUND)
        self._pending: Optional[tuple[Any, list[Tensor], str]] = None  # all-gather in flight, its rows, the step
        for path in sparse_module_paths:
            model.get_submodule(path).register_forward_hook(self._wait_in_backward)

    def inspect(self, batch: Any) -> None:
        self._batch, self._dense = batch, dense_leaves(batch)
        self._found = list(_NOTHING_FOUND)
        for index, (_, tensor) in enumerate(self._dense):
            bad = ~torch.isfinite(tensor)
            count = int(bad.sum())
            if count:
                where = bad.nonzero()[0].tolist() + [0, 0]
                self._found = [index, where[1] if tensor.dim() > 1 else -1, where[0], count]
                break

    def verdict(self, output: Any, batch_idx: int, global_step: int) -> Any:
        """``output`` if the step may go on to backward (a finding raises later, in
        :meth:`before_update`); otherwise, the same on every rank, :class:`NonFiniteError` or a
        loss that reaches no parameter (the skip: Lightning refuses a ``None`` step output in
        distributed training, and backward on it updates nothing)."""
        loss = _loss_of(output)
        loss_bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        size = _batch_size(self._batch)
        local = torch.tensor(self._found + [int(loss_bad), size], dtype=torch.int64,
                             device=loss.device if loss is not None else "cpu")
        step = f"training batch {batch_idx} (global step {global_step})"
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            rows = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
            self._pending = (dist.all_gather(rows, local, group=self.group, async_op=True), rows, step)
        else:
            self._pending = (None, [local], step)
        if self.policy == "raise" and size != 0:
            return output
        table = self._wait()
        if all(row[5] == 0 for row in table):
            warnings.warn(f"{step} has no samples on any rank; the step is skipped", RuntimeWarning)
            return self._skip(local.device)
        message = self._findings(table, step)
        if message is None:
            return output
        if self.policy == "skip":
            warnings.warn(f"{message}; the step is skipped on every rank (non_finite='skip')", RuntimeWarning)
            return self._skip(local.device)
        raise self._error(message)

    def before_update(self) -> None:
        """Raise :class:`NonFiniteError` on every rank if any rank found something this step."""
        if self._pending is None:
            return
        step = self._pending[2]
        message = self._findings(self._wait(), step)
        if message is not None:
            raise self._error(message)

    def _wait_in_backward(self, module: nn.Module, args: tuple, output: Any) -> None:
        values = output.values() if hasattr(output, "values") and callable(output.values) else None
        if module.training and torch.is_grad_enabled() and isinstance(values, Tensor) and values.requires_grad:
            values.register_hook(lambda grad: self.before_update())

    def _wait(self) -> list[list[int]]:
        work, rows, _ = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        return [row.tolist() for row in rows]

    def _findings(self, table: list[list[int]], step: str) -> Optional[str]:
        findings = [self._describe(rank, row) for rank, row in enumerate(table) if row[3] or row[4]]
        return f"non-finite values in {step}: " + "; ".join(findings) if findings else None

    @staticmethod
    def _error(message: str) -> NonFiniteError:
        return NonFiniteError(f"{message}. No update of this step was applied. Clean the inputs, or pass "
                              f"SparseLiftStrategy(non_finite='skip') to skip such steps on every rank.")

    def _skip(self, device: torch.device) -> Tensor:
        self.skipped += 1
        return torch.zeros((), device=device, requires_grad=True)

    def _describe(self, rank: int, row: list[int]) -> str:
        leaf, column, first_row, count, loss_bad = row[:5]
        parts = []
        if count:
            path = describe_path(self._dense[leaf][0], "batch") if 0 <= leaf < len(self._dense) else "the batch"
            feature = f" (feature {column}, first at sample {first_row})" if column >= 0 else \
                f" (first at sample {first_row})"
            parts.append(f"{count} in {path}{feature}")
        if loss_bad:
            parts.append("the loss is not finite")
        return f"rank {rank}: " + ", ".join(parts)
