"""Every rank must run the same number of sharded forwards, else a collective hangs: the batch
counts of a stage are compared across ranks before it starts."""

from __future__ import annotations

from typing import Any

import torch


def check_equal_batch_counts(trainer: Any, stage: str, device: torch.device, world_size: int) -> None:
    """RuntimeError naming every rank's count and the fix when the ranks' ``stage`` loops
    (``fit``, ``validate``, ``test``, ``predict``) would run different numbers of batches."""
    if stage == "fit":
        counts = [float(trainer.num_training_batches)]
    else:
        # during fit, validation runs in the fit loop's own evaluation loop
        loop = trainer.predict_loop if stage == "predict" else trainer._evaluation_loop
        counts = [float(c) for c in (loop.max_batches if isinstance(loop.max_batches, list) else [loop.max_batches])]
    local = torch.tensor(counts, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, local)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        fix = ("give every rank the same number of training batches (e.g. DistributedSampler with drop_last=True, "
               "or limit_train_batches)" if stage == "fit" else
               "use lightning_sparselift.EvenDistributedSampler (pads with zero-weight batches) for this dataloader")
        raise RuntimeError(
            f"ranks have different numbers of {stage} batches ({[g.tolist() for g in gathered]}); sharded "
            f"embeddings need every rank to run the same number of forwards: {fix}.")
