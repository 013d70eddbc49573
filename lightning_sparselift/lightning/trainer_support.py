"""Which of the Trainer's features the strategy can honour: what it cannot is refused with the
reason, never silently run otherwise, at setup and again where a setting can change later
(an accumulation factor a callback sets per epoch)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

_FUSED = ("the embedding optimizer is fused into backward and updates the tables at every backward pass, while "
          "the dense optimizer would step once per {n} batches on a loss divided by {n}")


def check_trainer(trainer: Any, module: Any, precision_plugin: Precision) -> None:
    """At setup: the Trainer's settings and callbacks, and (to fit) the LightningModule's
    optimization mode."""
    check_accumulation(trainer)
    if trainer.state.fn != TrainerFn.FITTING:
        check_precision(precision_plugin)
        return
    for callback in trainer.callbacks:
        if isinstance(callback, GradientAccumulationScheduler) and callback.going_to_accumulate_grad_batches():
            n = max(callback.scheduling.values())
            raise MisconfigurationException(
                f"SparseLiftStrategy cannot accumulate gradients (GradientAccumulationScheduler"
                f"({callback.scheduling})): {_FUSED.format(n=n)}. Use a larger batch size instead.")
    if not module.automatic_optimization:
        raise MisconfigurationException(
            "SparseLiftStrategy does not support manual optimization (automatic_optimization=False): on that path "
            "the dense gradients are not averaged across ranks, so the ranks' dense weights drift apart. Use "
            "automatic optimization; the embedding optimizer is set on the strategy (embedding_optimizer=...).")
    check_precision(precision_plugin)


def check_precision(precision_plugin: Precision) -> None:
    if type(precision_plugin) is not Precision:
        raise MisconfigurationException(f"SparseLiftStrategy supports only precision='32-true', got "
                                        f"{type(precision_plugin).__name__}")


def check_accumulation(trainer: Any) -> None:
    """Before every training step too: a callback may set the factor when an epoch starts."""
    n = trainer.accumulate_grad_batches
    if n != 1:
        raise MisconfigurationException(f"SparseLiftStrategy cannot accumulate gradients (accumulate_grad_batches={n}): "
                                        f"{_FUSED.format(n=n)}. Use a larger batch size instead.")
