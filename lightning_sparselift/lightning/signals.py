"""Signal handling that starts no collective from inside a signal handler: SIGTERM, and SLURM's
auto-requeue signal (SIGUSR1).

Lightning's SIGTERM handler broadcasts a flag over the world process group. A Python signal
handler runs wherever the rank's main thread happens to be, so that broadcast enters the rank's
sequence of collectives at an arbitrary point, e.g. between the lifted executor's all-to-alls
or the step's non-finite check, while the peers are in another collective (or in their own
handler's broadcast at another point). The collectives pair up wrongly and every rank waits for
the whole collective timeout (30 minutes by default) instead of stopping.

:class:`SignalConnector` keeps the rest of Lightning's behaviour: the handler records the signal
and forwards it to the processes the launcher started; the ranks agree at the next step
boundary, where the training loop broadcasts rank 0's flag on every rank at the same point of
the step and all ranks then raise ``SIGTERMException`` together. A rank signalled alone stops
at the end of its step; its exit closes its connections, so the peers' next collective fails
at once instead of waiting.

Lightning's SLURM requeue handler saves a checkpoint inside the handler, and a sharded save is
collectives: the same hazard. Here the handler records the signal; between two training steps
(:meth:`SignalConnector.requeue_if_signalled`, from the strategy's ``on_train_batch_start``)
every rank takes rank 0's record, and if it holds the signal every rank saves the checkpoint and
rank 0 requeues the job: Lightning's handler, run where every rank runs it alike.
"""

from __future__ import annotations

from types import FrameType
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _SIGNUM, _SignalConnector, log
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message


class SignalConnector(_SignalConnector):
    """Lightning's signal connector whose SIGTERM and SLURM requeue handlers issue no collective."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.requeue_signal: Optional[_SIGNUM] = None  # received; the save and requeue not done yet
        self._requeueing = False  # SLURM's auto-requeue is on

    def register_signal_handlers(self) -> None:
        super().register_signal_handlers()
        environment = self.trainer._accelerator_connector.cluster_environment
        self._requeueing = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        self.requeue_signal = None

    def _slurm_sigusr_handler_fn(self, signum: _SIGNUM, _frame: Optional[FrameType]) -> None:
        log.info(rank_prefixed_message(f"Received the requeue signal {signum}: the checkpoint is saved between two "
                                       f"training steps", self.trainer.local_rank))
        self.requeue_signal = signum

    def requeue_if_signalled(self) -> None:
        """Between training steps, on every rank: when rank 0 received the requeue signal, save
        the checkpoint and requeue the job (Lightning's handler). One small broadcast per step
        while SLURM's auto-requeue is on; nothing otherwise."""
        if not self._requeueing:
            return
        signum = torch.tensor([int(self.requeue_signal or 0)], device=self.trainer.strategy.root_device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(signum, src=0)
        if signum.item():
            self.requeue_signal = None
            super()._slurm_sigusr_handler_fn(int(signum.item()), None)

    def _sigterm_notifier_fn(self, signum: _SIGNUM, _frame: Optional[FrameType]) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        launcher = self.trainer.strategy.launcher
        if not self.received_sigterm and launcher is not None:
            launcher.kill(signum)
        self.received_sigterm = True
