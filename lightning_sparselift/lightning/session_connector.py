"""What the strategy's hooks do for the compiler session (one job, as Lightning's connectors):
open it when training starts, begin and end each training step, hand it the batch after the one
being trained (the training loader read one batch ahead), report what it decided, and stop it when
training stops before it finished."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lightning_sparselift.lightning.lookahead import LookaheadLoader
from lightning_sparselift.lightning.report import log_metrics, report_events, report_metrics, report_round
from lightning_sparselift.options import SessionOptions

PROGRESS_EVERY = 10  # training steps between two logs of the calibration's progress

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_sparselift.session import SparseLiftSession


def check_uneven_batch(trainer: pl.Trainer, step: int) -> None:
    """A training step whose ranks passed different batch sizes ran TorchRec's path: the epoch's
    short last batch is taken so; any other is per-rank batch sizes, an input error. Every rank
    raises alike (they exchanged their sizes; their epochs have as many batches)."""
    if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
        return
    from lightning_sparselift.validation import SparseInputError

    raise SparseInputError(
        f"training step {step}: the ranks passed different batch sizes, and not in the epoch's last batch. The "
        f"lifted executor runs one batch size on every rank (a short last batch runs TorchRec's path, alone), so "
        f"per-rank batch sizes would train every step on TorchRec's path while calibration measured nothing. Give "
        f"every rank the same batch size, or train with SparseLiftStrategy(executor='torchrec'), whose path takes "
        f"per-rank batch sizes (not on row-wise tables).")


class SessionConnector:
    def __init__(self) -> None:
        self.session: Optional[SparseLiftSession] = None  # kept once done (its executor and plan)
        self._lookahead: Optional[LookaheadLoader] = None  # the training dataloader, read one batch ahead
        self._next_batch: Any = None  # the batch after the one being moved to the device for training

    def read_ahead(self, dataloader: object) -> LookaheadLoader:
        """The training loader, read one batch ahead (for the ``next_batch`` schedule)."""
        self._lookahead = LookaheadLoader(dataloader)
        return self._lookahead

    def moving(self, batch: Any) -> None:
        """``batch`` (exactly as the training loader yielded it) is moved to the device for its step."""
        self._next_batch = self._lookahead.after(batch) if self._lookahead is not None else None

    def open(self, module: pl.LightningModule, sharding_plan: Any, paths: list[str], device: torch.device,
             options: SessionOptions, check_group: Any, before_update: Callable[[], None]) -> None:
        """Training starts: an installed executor is kept across fits; a session that kept TorchRec's
        path tries again. Either way it learns how many training steps are left."""
        if self.session is None or self.session.installed is None:
            from lightning_sparselift.session import SparseLiftSession

            self.session = SparseLiftSession(module, sharding_plan, paths, torch.distributed.group.WORLD, device,
                                             options, check_group, before_update)
        trainer = module.trainer
        # (no gradient accumulation under the strategy: a training step is an optimizer step)
        self.session.expect(float(trainer.estimated_stepping_batches) - trainer.global_step)

    def begin_step(self, batch: Any, batch_idx: int) -> None:
        if self.session is None:
            return
        if batch_idx == 0:
            # the previous epoch's last step may have announced a batch it never reached
            # (limit_train_batches, on_train_batch_start returning -1): an epoch starts from scratch
            self.discard_started_work()
        # announced as the loader yields it: the transfer hooks run once, when its step comes
        # (capture checked that the model receives exactly these features, else the schedule is
        # not proposed; the executor moves them to its device)
        self.session.begin_step(batch, self._next_batch)

    def end_step(self, module: pl.LightningModule) -> None:
        """The step's forward, backward and optimizer step ran: the session records it and
        advances; its progress is reported from here (a hook where Lightning allows logging)."""
        if self.session is None:
            return
        uneven = self.session.torchrec_path_steps
        finished = self.session.end_step()
        if self.session.torchrec_path_steps > uneven:
            check_uneven_batch(module.trainer, self.session.steps)
        report_events(self.session)
        # (a LightningModule.log costs ~1 ms a call here, a tenth of a small model's step: the
        # progress bar's count moves every PROGRESS_EVERY training steps)
        progress = self.session.calibration_progress if self.session.steps % PROGRESS_EVERY == 0 else None
        if progress is not None:
            log_metrics(module, {"sparselift/calibration_step": float(progress[0])}, prog_bar=True)
        if finished:
            report_round(self.session, module)
        report_metrics(self.session, module)

    def stop(self, why: str) -> None:
        """Training stopped: a session still running keeps what it has (see ``abandon``)."""
        if self.session is not None and not self.session.done:
            self.session.abandon(why)
            report_events(self.session)

    def discard_started_work(self) -> None:
        """Complete and drop what the lifted executor started for a step that will not run (the
        batch announced last was never trained on: training ended, or the epoch was cut short)."""
        if self.session is not None and self.session.installed is not None:
            self.session.installed.discard()
