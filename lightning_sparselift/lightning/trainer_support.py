"""Which of the Trainer's features the strategy can honour: what it cannot is refused with the
reason, never silently run otherwise, at setup and again where a setting can change later
(an accumulation factor a callback sets per epoch)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
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


# what the tables' own dtype is set with (the dense part's precision does not reach them)
_TABLE_DTYPE = "table weights in FP16 are set per table: EmbeddingBagConfig(data_type=DataType.FP16)"


def check_precision(precision_plugin: Precision) -> None:
    """'32-true' and 'bf16-mixed' (the dense part under autocast; the sparse path in the tables'
    own dtype, fp32 outputs) run; any other precision is refused with the reason."""
    flag = getattr(precision_plugin, "precision", type(precision_plugin).__name__)
    if type(precision_plugin) is Precision:
        return
    if type(precision_plugin) is MixedPrecision:
        if precision_plugin.precision == "bf16-mixed":
            return
        raise MisconfigurationException(
            f"SparseLiftStrategy cannot train with precision={flag!r}: its loss scaling (GradScaler) unscales the "
            f"gradients, or skips the step on an overflow, after backward, but the embedding optimizer is fused into "
            f"backward and would already have applied the scaled gradients to the tables. Use precision='bf16-mixed' "
            f"(no loss scaling); {_TABLE_DTYPE}.")
    raise MisconfigurationException(
        f"SparseLiftStrategy supports precision='32-true' and 'bf16-mixed', got precision={flag!r} "
        f"({type(precision_plugin).__name__}): a '-true' precision converts every parameter, the sharded tables' "
        f"included, which TorchRec's fused tables do not take; {_TABLE_DTYPE}.")


def check_accumulation(trainer: Any) -> None:
    """Before every training step too: a callback may set the factor when an epoch starts."""
    n = trainer.accumulate_grad_batches
    if n != 1:
        raise MisconfigurationException(f"SparseLiftStrategy cannot accumulate gradients (accumulate_grad_batches={n}): "
                                        f"{_FUSED.format(n=n)}. Use a larger batch size instead.")
