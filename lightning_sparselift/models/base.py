"""``RecModule``: what every click-through-rate model of this package shares as a LightningModule
(BCE on logits weighted by the batch's sample weights, AUC / logloss through torchmetrics, the dense
optimizer and its schedule). A model family subclasses it and builds ``self.model``, an
``nn.Module`` called as ``model(dense, sparse_features) -> logits [B, 1]``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_sparselift.data import RecBatch
from lightning_sparselift.metrics import RecMetrics

DENSE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam,
                    "adamw": torch.optim.AdamW}


class RecModule(pl.LightningModule):
    """Training, evaluation and optimizers of a model family; ``self.model`` is the subclass's.

    Args (the subclass passes them through):
        dense_optimizer: ``sgd`` / ``adagrad`` / ``adam`` / ``adamw`` for the dense part (the
            tables are updated by the strategy's fused embedding optimizer).
        dense_lr: its learning rate.
        lr_scheduler: ``None`` or ``"cosine"`` (cosine decay per step), applied to the dense
            optimizer (the strategy's ``embedding_lr_schedule="follow_dense"`` makes it drive the
            embedding LR too).
        lr_scheduler_steps: length of the cosine decay; default: the run's total steps.
    """

    model: nn.Module

    def __init__(self, dense_optimizer: str = "sgd", dense_lr: float = 0.1, lr_scheduler: Optional[str] = None,
                 lr_scheduler_steps: Optional[int] = None):
        super().__init__()
        if dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"dense_optimizer must be one of {sorted(DENSE_OPTIMIZERS)}, got {dense_optimizer!r}")
        if lr_scheduler not in (None, "cosine"):
            raise ValueError(f"lr_scheduler must be None or 'cosine', got {lr_scheduler!r}")
        self.dense_optimizer, self.dense_lr = dense_optimizer, dense_lr
        self.lr_scheduler, self.lr_scheduler_steps = lr_scheduler, lr_scheduler_steps
        self.loss_fn = nn.BCEWithLogitsLoss(reduction="none")
        self.val_metrics = RecMetrics(prefix="val/")
        self.test_metrics = RecMetrics(prefix="test/")

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                             strict: Optional[bool] = None, **kwargs: Any) -> "RecModule":
        """Lightning's, for a SparseLift checkpoint folder too: the model rebuilt without the
        strategy, every table whole (:func:`lightning_sparselift.load_from_checkpoint`), on CPU or
        ``map_location``."""
        if not (isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_dir()):
            return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                                strict=strict, **kwargs)
        from lightning_sparselift.checkpoint.export import load_from_checkpoint

        if hparams_file is not None:
            raise ValueError("hparams_file: a SparseLift checkpoint folder holds its own hyper-parameters; pass "
                             "overrides as keyword arguments")
        kwargs.pop("weights_only", None)  # (a folder is always read as plain data)
        module = load_from_checkpoint(cls, checkpoint_path, strict=strict is not False, **kwargs)
        return module.to(map_location) if map_location is not None else module

    def forward(self, batch: RecBatch) -> torch.Tensor:
        return self.model(batch.dense, batch.sparse).squeeze(-1)

    def _loss(self, logits: torch.Tensor, batch: RecBatch) -> torch.Tensor:
        per_sample = self.loss_fn(logits, batch.labels) * batch.weights
        return per_sample.sum() / batch.weights.sum().clamp_min(1.0)

    def training_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        _warn_if_nan(batch.dense, "training batch")
        loss = self._loss(self(batch), batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        return loss

    def _evaluate(self, batch: RecBatch, metrics: RecMetrics) -> None:
        _warn_if_nan(batch.dense, "evaluation batch")
        logits = self(batch)
        metrics.update(torch.sigmoid(logits), batch.labels, batch.weights)
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=True)

    def validation_step(self, batch: RecBatch, batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: RecBatch, batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics)

    def predict_step(self, batch: RecBatch, batch_idx: int) -> dict[str, torch.Tensor]:
        keep = batch.weights > 0
        return {"probability": torch.sigmoid(self(batch))[keep], "label": batch.labels[keep]}

    def configure_optimizers(self) -> Any:
        # The strategy removes the embedding tables from this optimizer (they are updated by the
        # fused embedding optimizer in backward), so asking for all parameters is fine.
        optimizer = DENSE_OPTIMIZERS[self.dense_optimizer](self.parameters(), lr=self.dense_lr)
        if self.lr_scheduler is None:
            return optimizer
        total = self.lr_scheduler_steps or max(int(self.trainer.estimated_stepping_batches), 1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _warn_if_nan(dense: torch.Tensor, where: str) -> None:
    bad = int(torch.isnan(dense).sum())
    if bad:
        warnings.warn(f"{where}: {bad} NaN value(s) in the dense features; the loss and gradients of this step "
                      f"will be NaN. Clean or impute the inputs.", RuntimeWarning, stacklevel=3)
