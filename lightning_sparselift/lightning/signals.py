"""SIGTERM handling that starts no collective from inside the signal handler.

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
"""

from __future__ import annotations

from types import FrameType
from typing import Optional

from lightning.pytorch.trainer.connectors.signal_connector import _SIGNUM, _SignalConnector, log
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message


class SignalConnector(_SignalConnector):
    """Lightning's signal connector whose SIGTERM handler issues no collective."""

    def _sigterm_notifier_fn(self, signum: _SIGNUM, _frame: Optional[FrameType]) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        launcher = self.trainer.strategy.launcher
        if not self.received_sigterm and launcher is not None:
            launcher.kill(signum)
        self.received_sigterm = True
