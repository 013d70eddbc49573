"""Worker of the non-finite guard tests: the parity harness's model and batches, trained with the
strategy's step check around every step (inspect, forward, verdict, backward, the check before
the update), with a non-finite dense value, label or KJT weight on one rank after the lifted
executor is installed, on TorchRec's path, the identity plan and every forced-pass variant.

- ``raise``: the step with the bad batch raises on every rank; every tensor on every rank
  (tables, their optimizer state, dense weights) is what it was when the step began.
- ``skip``: the three bad steps in a row are skipped on every rank; the run ends where a run on
  TorchRec's path that never saw those batches ends.

Run in spawned processes (one spawn runs every case)."""

from __future__ import annotations

import os
import traceback
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

import lifted_parity as lp

CASE = "mixed"  # table-wise, row-wise, column-wise and data-parallel groups in one module
# one weighted module (rowwise Adagrad: tables and momentum): with a second module whose output the
# model concatenates after it, that module's values would be reached in backward first
VARIANT = dict(weighted=True, multi_hot=True, two_modules=False)
BAD_AT = lp.WARMUP_STEPS + 1  # the second step on the lifted executor (the first ran the plan once)
STEPS = BAD_AT + 4  # skip: the bad steps, then a good one
# corruption -> (the rank whose batch has it, what the error names)
CORRUPTIONS = {"dense": (0, r"rank 0: 1 in batch\[0\] \(feature 2, first at sample 3\), the loss is not finite"),
               "label": (1, r"rank 1: 1 in batch\[1\] \(first at sample 5\), the loss is not finite"),
               "weight": (0, r"rank 0: 1 in batch\[2\]\.weights\(\) \(feature 'fa3', first at sample {sample}\), "
                             r"the loss is not finite")}
EXECUTORS: dict[str, Optional[tuple[str, ...]]] = {"torchrec": None, "lifted": (), **lp.OPTIMIZED}


def corrupt(batch: tuple, what: str) -> tuple[tuple, int]:
    """``batch`` with one non-finite value of kind ``what``, and the sample a weight's lies in."""
    dense, labels, a, b = batch
    if what == "dense":
        dense = dense.clone()
        dense[3, 2] = float("inf")
        return (dense, labels, a, b), -1
    if what == "label":
        labels = labels.clone()
        labels[5] = float("nan")
        return (dense, labels, a, b), -1
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    # the first id of feature fa3 (its 4th key)
    lengths = a.lengths().view(len(a.keys()), -1)[3]
    sample = int((lengths > 0).nonzero()[0])
    weights = a.weights().clone()
    weights[a.offset_per_key()[3]] = float("inf")
    a = KeyedJaggedTensor(keys=a.keys(), values=a.values(), lengths=a.lengths(), weights=weights)
    return (dense, labels, a, b), sample


def run(optimizations: Optional[tuple[str, ...]], policy: str, bad: dict[int, str], world: int,
        device: torch.device, drop_bad: bool = False) -> dict[str, Any]:
    """Train STEPS steps (``optimizations`` None: TorchRec's path) whose steps ``bad`` hold the
    corruption named, on its rank; ``drop_bad``: without those steps' batches at all."""
    from lightning_sparselift.frontend.capture import SparseCapture
    from lightning_sparselift.lightning.step_check import NonFiniteError, StepCheck

    case = lp.CASES[CASE]
    model, sharded = lp.sharded_model(case, VARIANT, world, device)
    dmp = sharded.dmp
    dense_opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if not hasattr(p, "_in_backward_optimizers")],
                                lr=0.05)
    check = StepCheck(dist.group.WORLD, policy, model, sharded.sparse_module_paths)
    rank = dist.get_rank()
    steps = lp.batches(rank, VARIANT, STEPS)
    sample = -1
    for step, what in bad.items():
        if rank == CORRUPTIONS[what][0]:
            steps[step], sample = corrupt(steps[step], what)
    if drop_bad:
        steps = [batch for step, batch in enumerate(steps) if step not in bad]
    capture = SparseCapture(model, sharded.sparse_module_paths, rank, world) if optimizations is not None else None
    installed = None
    result: dict[str, Any] = {"sample": sample}
    for step, batch in enumerate(steps):
        dense, labels, a, _ = (x.to(device) if x is not None else None for x in batch)
        next_batch = steps[step + 1] if step + 1 < len(steps) else None
        if installed is not None:
            installed.announce(next_batch)
        captured = capture is not None and step < lp.WARMUP_STEPS
        before = lp.local_state(dmp, dmp.fused_optimizer)
        with capture.step((dense, labels, a), next_batch) if captured else nullcontext():
            check.inspect((dense, labels, a))
            logits, _ = dmp(dense, a)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
            try:
                loss = check.verdict(loss, step, step)
                loss.backward()
                check.before_update()
            except NonFiniteError as error:
                after = lp.local_state(dmp, dmp.fused_optimizer)
                result.update(error=str(error), changed=[k for k in before if not torch.equal(before[k], after[k])])
                break  # (backward stopped half-way: the run cannot go on)
        dense_opt.step()
        dense_opt.zero_grad()
        if captured and step == lp.WARMUP_STEPS - 1:
            installed = lp.install_forced(model, sharded, capture, world, device, optimizations)
            installed.guard_updates(check.before_update)  # as the session does
    result.update(final=lp.local_state(dmp, dmp.fused_optimizer), skipped=check.skipped)
    if installed is not None:
        result["concatenated_steps"] = sum(e.concatenated_steps for e in installed.executors.values())
        installed.discard()
    return result


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    device = torch.device("cpu")
    try:
        res: dict[str, Any] = {}
        try:
            res["without_bad"] = run(None, "skip", {BAD_AT + i: w for i, w in enumerate(CORRUPTIONS)}, world, device,
                                     drop_bad=True)
            for name, passes in EXECUTORS.items():
                for what in CORRUPTIONS:
                    res[name, "raise", what] = run(passes, "raise", {BAD_AT: what}, world, device)
                res[name, "skip"] = run(passes, "skip", {BAD_AT + i: w for i, w in enumerate(CORRUPTIONS)}, world,
                                        device)
        except Exception:  # reported; every rank fails the same way or the test times out
            res = {"error": traceback.format_exc()}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
