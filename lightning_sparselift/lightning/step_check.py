"""Non-finite values in a training step, caught on every rank before backward updates anything.

The embedding optimizer is fused into backward, so one ``inf`` in a dense feature on one rank
turns that rank's loss, then every rank's tables (through the all-to-alls) and dense weights
(through DDP's all-reduce) into NaN for good. So after the forward and before backward, every
rank shares what it saw: non-finite values in the floating-point tensors of its batch (dense
features, labels, sample weights, the weights of its KeyedJaggedTensors; the ids and lengths are
checked by :mod:`lightning_sparselift.validation`), whether its loss is finite, and whether its
batch has any sample. Then all ranks raise the same error before the first update, or
(``non_finite="skip"``) all skip the step; a step where every rank's batch is empty is skipped too
(its loss has no samples to average).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparselift.kjt import describe_path, find_objects, kjts_with_paths

NON_FINITE_POLICIES = ("raise", "skip")
# what a rank found in its batch: the first tensor with non-finite values (its index among the
# batch's floating-point tensors, then its KJTs' weights), the column (a KJT's: the feature) and
# row (the sample) of its first one, and how many it holds
_NOTHING_FOUND = (-1, -1, -1, 0)


class NonFiniteError(RuntimeError):
    pass


def dense_leaves(batch: Any) -> list[tuple[list[list[Any]], Tensor]]:
    """The floating-point tensors of a batch with their access paths (KJTs are not entered)."""
    return find_objects((batch,), {}, lambda obj: isinstance(obj, Tensor) and obj.is_floating_point(), depth=3)


def _first_non_finite(tensor: Tensor) -> Optional[tuple[int, int, int]]:
    """(column or -1, row, count) of the non-finite values of ``tensor``; None: all finite."""
    bad = ~torch.isfinite(tensor)
    count = int(bad.sum())
    if not count:
        return None
    where = bad.nonzero()[0].tolist()
    return (where[1] if tensor.dim() > 1 else -1), where[0], count


def _first_non_finite_weight(kjt: Any) -> Optional[tuple[int, int, int]]:
    """(feature index, sample, count) of the non-finite weights of ``kjt``; None: all finite or unweighted."""
    weights = kjt.weights_or_none()
    found = _first_non_finite(weights) if weights is not None and weights.is_floating_point() else None
    if found is None:
        return None
    _, position, count = found
    bag = int(torch.searchsorted(kjt.lengths().cumsum(0), position, right=True))
    for feature, stride in enumerate(kjt.stride_per_key()):
        if bag < stride:
            return feature, bag, count
        bag -= stride
    raise AssertionError("a weight outside the KeyedJaggedTensor's bags")  # (validation checks lengths vs values)


def _loss_of(output: Any) -> Optional[Tensor]:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


class StepCheck:
    """Run :meth:`inspect` on the batch before the training step's forward, :meth:`verdict` on
    its output before backward and :meth:`before_update` before any parameter changes; all
    ranks call all three for every training step.

    The ranks' findings travel in one all-gather started by :meth:`verdict`. Skipping a step has
    to be decided before backward, so with ``skip`` (or an empty batch) :meth:`verdict` waits for
    it. Raising can wait until the first update, so the all-gather runs while backward computes
    the dense part: :meth:`before_update` is called where each sparse module's gradients enter
    backward, before any exchange or fused embedding update (on TorchRec's path: the gradient of
    the module's output values; on the lifted executor, whatever its schedule: the guard of
    :mod:`~lightning_sparselift.runtime.update_guard`, which the session installs), and before the
    optimizer step."""

    def __init__(self, group: Any, policy: str, model: nn.Module, sparse_module_paths: list[str]) -> None:
        # policy: one of NON_FINITE_POLICIES (the strategy checks the option when it is constructed)
        self.group, self.policy = group, policy
        self.skipped = 0  # steps skipped on every rank
        self._dense: list[tuple[list[list[Any]], Tensor]] = []
        self._kjts: list[tuple[list[list[Any]], Any]] = []
        self._found = list(_NOTHING_FOUND)
        self._pending: Optional[tuple[Any, list[Tensor], str]] = None  # all-gather in flight, its rows, the step
        for path in sparse_module_paths:
            model.get_submodule(path).register_forward_hook(self._wait_in_backward)

    def inspect(self, batch: Any) -> None:
        self._dense, self._kjts = dense_leaves(batch), kjts_with_paths((batch,), {}, depth=3)
        self._found = list(_NOTHING_FOUND)
        findings = [_first_non_finite(t) for _, t in self._dense] + [_first_non_finite_weight(k) for _, k in self._kjts]
        first = next((i for i, found in enumerate(findings) if found is not None), None)
        if first is not None:
            self._found = [first, *findings[first]]

    def verdict(self, output: Any, batch_idx: int, global_step: int) -> Any:
        """``output`` if the step may go on to backward (a finding raises later, in
        :meth:`before_update`); otherwise, the same on every rank, :class:`NonFiniteError` or a
        loss that reaches no parameter (the skip: Lightning refuses a ``None`` step output in
        distributed training, and backward on it updates nothing)."""
        loss = _loss_of(output)
        loss_bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        size = self._kjts[0][1].stride() if self._kjts else -1  # the samples as the sparse features count them
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
        """A sparse module's forward hook: its output's gradient waits for the check first. A
        TorchRec module's output is an awaitable whose exchange stays in flight until the model
        reads it (TorchRec overlaps it with the model's next work, e.g. the next sparse module's
        input distribution): reading it here would wait at once, so the hook joins its callbacks."""
        from torchrec.distributed.types import Awaitable

        if not (module.training and torch.is_grad_enabled()):
            return
        if isinstance(output, Awaitable):
            output.callbacks.append(self._hook_values)
        else:
            self._hook_values(output)

    def _hook_values(self, output: Any) -> Any:
        values = output.values() if hasattr(output, "values") and callable(output.values) else None
        if isinstance(values, Tensor) and values.requires_grad:
            values.register_hook(lambda grad: self.before_update())
        return output

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
            kjt = leaf - len(self._dense)
            if 0 <= leaf < len(self._dense):
                path = describe_path(self._dense[leaf][0], "batch")
            elif 0 <= kjt < len(self._kjts):  # (every rank's KJTs have the same keys: validation checks it)
                path = describe_path(self._kjts[kjt][0], "batch") + ".weights()"
                keys = self._kjts[kjt][1].keys()
                column = repr(keys[column]) if 0 <= column < len(keys) else column
            else:
                path = "the batch"
            feature = f" (feature {column}, first at sample {first_row})" if column != -1 else \
                f" (first at sample {first_row})"
            parts.append(f"{count} in {path}{feature}")
        if loss_bad:
            parts.append("the loss is not finite")
        return f"rank {rank}: " + ", ".join(parts)
