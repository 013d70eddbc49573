"""Callbacks: SparseLift's warmup (capture -> lift -> calibrate -> plan -> install) and a run report."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


def _report_events(warmup: Any) -> None:
    for event in warmup.events:
        rank_zero_info(f"SparseLift: {event}")
    warmup.events.clear()


class LiftWarmup(pl.Callback):
    """Runs SparseLift's loop on the first training steps (:mod:`lightning_sparselift.warmup`):
    capture on TorchRec's path, lift, calibrate the candidates on real steps, install the plan.
    ``SparseLiftStrategy`` adds this callback itself when ``executor="sparselift"``. Progress goes
    to the log (and ``sparselift/calibration_step`` to the progress bar); the decisions go to
    the Lightning logger (``sparselift/...`` metrics) and, with a logger that has a ``log_dir``,
    the plan to ``<log_dir>/sparselift_plan.json``."""

    def __init__(self) -> None:
        self._active: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.start_warmup()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the previous epoch's last step may have announced a batch it never reached
        # (limit_train_batches, on_train_batch_start returning -1): a new epoch starts from scratch
        trainer.strategy.discard_started_work()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._active = trainer.strategy.sparse_step(batch)
        self._active.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._leave_step()
        warmup = trainer.strategy.warmup
        if warmup is None:
            return
        finished = warmup.after_step()
        _report_events(warmup)
        progress = warmup.calibration_progress
        if progress is not None:
            pl_module.log("sparselift/calibration_step", float(progress[0]), prog_bar=True, rank_zero_only=True)
        if not finished:
            return
        if warmup.installed is None:
            rank_zero_warn(f"SparseLift could not lift the sparse path, continuing on TorchRec's "
                           f"(executor='torchrec'): {warmup.fallback_reason}")
            return
        plan = warmup.plan
        rank_zero_info("SparseLift " + plan.explain())
        metrics = {"sparselift/lift_s": warmup.lift_seconds,
                   "sparselift/collectives_per_step": float(len(plan.graph.collectives())),
                   "sparselift/calibration_steps": float(plan.calibration_steps),
                   "sparselift/calibration_s": plan.calibration_s,
                   "sparselift/planning_s": plan.planning_s,
                   "sparselift/plan_reused": float(warmup.plan_reused)}
        for decision in plan.decisions:
            key = f"sparselift/{decision.candidate.replace(':', '/').replace('@', '/')}"
            metrics[f"{key}/accepted"] = float(decision.accepted)
            if decision.measured_ms is not None:
                metrics[f"{key}/measured_ms"] = decision.measured_ms
        pl_module.log_dict(metrics, rank_zero_only=True)
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        if log_dir and trainer.is_global_zero:
            plan.save_as_cache(f"{log_dir}/sparselift_plan.json")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warmup = trainer.strategy.warmup
        if warmup is not None:
            warmup.abandon(f"training ended after {trainer.global_step} step(s)")
            _report_events(warmup)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._leave_step()

    def _leave_step(self) -> None:
        if self._active is not None:
            active, self._active = self._active, None
            active.__exit__(None, None, None)


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
            self._samples += len(batch) * trainer.world_size
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
