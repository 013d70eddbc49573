"""Callbacks: a run report. (SparseLift's session needs none: ``SparseLiftStrategy`` drives and reports it
from its own hooks.)"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def samples_in(batch: Any) -> int:
    """The samples of a training batch: as its (first) KeyedJaggedTensor counts them, else the
    first dimension of its first tensor (a dict, tuple or dataclass of tensors is entered), else
    ``len(batch)``."""
    import torch

    from lightning_sparselift.kjt import find_objects, kjts_with_paths

    kjts = kjts_with_paths((batch,), {}, depth=3)
    if kjts:
        return int(kjts[0][1].stride())
    tensors = find_objects((batch,), {}, lambda obj: isinstance(obj, torch.Tensor) and obj.dim() > 0, depth=3)
    return int(tensors[0][1].shape[0]) if tensors else len(batch)


class RunReport(pl.Callback):
    """Prints steady-state training throughput (all ranks' samples per second of wall time,
    excluding the first ``warmup_steps``) and the final validation metrics, and logs the
    throughput to the Lightning logger as ``train/samples_per_s``."""

    def __init__(self, warmup_steps: int = 10):
        self.warmup_steps = warmup_steps
        self._start: float | None = None
        self._samples = 0
        self._steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.warmup_steps and self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._start is not None:
            self._samples += samples_in(batch) * trainer.world_size
            self._steps += 1

    def throughput(self) -> float | None:
        if self._start is None or self._steps == 0:
            return None
        return self._samples / (time.perf_counter() - self._start)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rate = self.throughput()
        if rate is not None:
            pl_module.log("train/samples_per_s", rate, sync_dist=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rate = self.throughput()
        if rate is None:
            rank_zero_info(f"throughput: not measured (fewer than {self.warmup_steps} warmup steps ran)")
        else:
            rank_zero_info(f"throughput: {rate:,.0f} samples/s over {self._steps} steps on {trainer.world_size} "
                           f"process(es), after {self.warmup_steps} warmup steps "
                           f"({rate / trainer.world_size:,.0f} samples/s per process)")
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics:
            rank_zero_info("validation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
