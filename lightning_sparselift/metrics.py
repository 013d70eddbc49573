"""Click-prediction quality metrics (ROC-AUC, logloss, accuracy), synced across ranks by torchmetrics."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC


class LogLoss(MeanMetric):
    """Mean binary cross-entropy of probabilities, weighted per sample (weight 0 = padding)."""

    def update(self, probs: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> None:  # type: ignore[override]
        loss = torch.nn.functional.binary_cross_entropy(probs.double(), target.double(), reduction="none")
        super().update(loss, weight.double())


class RecMetrics(MetricCollection):
    """``auc``, ``logloss`` and ``accuracy`` of predicted click probabilities.

    Samples with weight 0 (the padding that evens out ranks) are excluded, so every sample of
    the split is counted exactly once however it was distributed.
    """

    def __init__(self, prefix: str):
        super().__init__({"auc": BinaryAUROC(), "logloss": LogLoss(), "accuracy": BinaryAccuracy()}, prefix=prefix,
                         compute_groups=False)

    def update(self, probs: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> None:  # type: ignore[override]
        keep = weight > 0
        if not bool(keep.any()):
            return  # an all-padding batch (only there to keep ranks in step)
        probs, target, weight = probs[keep], target[keep], weight[keep]
        self["auc"].update(probs, target.long())
        self["logloss"].update(probs, target, weight)
        self["accuracy"].update(probs, target.long())


__all__ = ["LogLoss", "RecMetrics"]
