"""Which of the Trainer's features the strategy can honour: what it cannot is refused at setup with
the reason, never silently run otherwise."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException


def check_trainer(trainer: Any, precision_plugin: Precision) -> None:
    if trainer.accumulate_grad_batches != 1:
        raise MisconfigurationException(
            f"SparseLiftStrategy cannot accumulate gradients (accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches}): the embedding optimizer is fused into backward and updates "
            f"the tables at every backward pass. Use a larger batch size instead.")
    if type(precision_plugin) is not Precision:
        raise MisconfigurationException(f"SparseLiftStrategy supports only precision='32-true', got "
                                        f"{type(precision_plugin).__name__}")
