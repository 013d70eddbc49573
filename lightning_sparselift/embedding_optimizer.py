"""The embedding optimizer: what the sharded tables run fused into their backward (fbgemm's
table-batched kernels, through TorchRec), how it is combined with the user's dense optimizer into
the one optimizer Lightning steps, and how its learning rate follows the dense one's schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


@dataclass
class EmbeddingOptimizer:
    """The optimizer fused into the sharded tables' backward (fbgemm TBE), with its settings.

    ``name``: ``sgd``, ``adagrad``, ``rowwise_adagrad`` or ``adam`` (on CPU tables fbgemm has
    no Adam: a generated kernel runs it, see :mod:`~lightning_sparselift.runtime.codegen.host_adam`).
    ``lr`` is its learning rate; ``eps``, ``betas`` and ``weight_decay`` apply where the optimizer
    has them.
    """

    name: str = "sgd"
    lr: float = 0.1
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in EMBEDDING_OPTIMIZERS:
            raise ValueError(f"unknown embedding optimizer {self.name!r}; choose one of {EMBEDDING_OPTIMIZERS}")
        if not self.lr > 0:
            raise ValueError(f"embedding optimizer lr must be > 0, got {self.lr}")
        self.betas = tuple(self.betas)

    @classmethod
    def parse(cls, value: "EmbeddingOptimizer | dict[str, Any] | str") -> "EmbeddingOptimizer":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(name=value)
        if isinstance(value, dict):
            unknown = set(value) - {"name", "lr", "eps", "betas", "weight_decay"}
            if unknown:
                raise ValueError(f"unknown embedding_optimizer option(s) {sorted(unknown)}")
            return cls(**value)
        raise TypeError(f"embedding_optimizer must be a name, a dict or EmbeddingOptimizer, got {type(value)}")

    def apply_in_backward(self, params: list[nn.Parameter]) -> None:
        """Attach the optimizer to ``params`` so TorchRec picks the fused kernel for them."""
        from torch.distributed.optim import _apply_optimizer_in_backward
        from torchrec import optim as trec_optim

        # TorchRec's placeholder optimizer classes pass their kwargs straight to fbgemm's TBE,
        # so they use fbgemm's argument names (beta1/beta2, not betas).
        if self.name == "sgd":
            cls, kwargs = trec_optim.SGD, {"lr": self.lr, "weight_decay": self.weight_decay}
        elif self.name == "adagrad":
            cls, kwargs = trec_optim.Adagrad, {"lr": self.lr, "eps": self.eps, "weight_decay": self.weight_decay}
        elif self.name == "rowwise_adagrad":
            cls, kwargs = trec_optim.RowWiseAdagrad, {"lr": self.lr, "eps": self.eps,
                                                      "weight_decay": self.weight_decay}
        else:
            cls, kwargs = trec_optim.Adam, {"lr": self.lr, "eps": self.eps, "beta1": self.betas[0],
                                            "beta2": self.betas[1], "weight_decay": self.weight_decay}
        _apply_optimizer_in_backward(cls, params, kwargs)


def combine_optimizers(dmp: nn.Module, dense: torch.optim.Optimizer) -> Any:
    """TorchRec's CombinedOptimizer over the fused table optimizer and ``dense``, after taking
    the fused tables out of ``dense`` (they are updated in backward; a second update is wrong)."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    names = {id(p): n for n, p in dmp.named_parameters()}
    for group in dense.param_groups:
        fused = [p for p in group["params"] if hasattr(p, "_in_backward_optimizers")]
        group["params"] = [p for p in group["params"] if not hasattr(p, "_in_backward_optimizers")]
        for p in fused:
            dense.state.pop(p, None)  # optimizers such as Adagrad create state at construction
    params = [p for g in dense.param_groups for p in g["params"]]
    unknown = [p for p in params if id(p) not in names]
    if unknown:
        raise ValueError(f"the dense optimizer holds {len(unknown)} tensor(s) that are not parameters of the model")
    keyed_dense = KeyedOptimizerWrapper({names[id(p)]: p for p in params}, lambda _: dense)
    _name_groups("embedding", dmp.fused_optimizer.param_groups)
    _name_groups("dense", dense.param_groups)
    return CombinedOptimizer([("embedding", dmp.fused_optimizer), ("dense", keyed_dense)])


def _name_groups(optimizer: str, groups: list[dict[str, Any]]) -> None:
    """Name each param group after its optimizer (``embedding``, ``dense``; ``/pgN`` when there are
    several), unless it has a name: Lightning's LearningRateMonitor logs a group's LR under its name
    (else under ``pgN`` of the one combined optimizer, which does not say whose LR it is)."""
    for i, group in enumerate(groups):
        group.setdefault("name", optimizer if len(groups) == 1 else f"{optimizer}/pg{i + 1}")


EMBEDDING_LR_SCHEDULES = ("constant", "follow_dense")


class EmbeddingLRSchedule:
    """``constant`` keeps the embedding LR as configured; ``follow_dense`` scales it every step by
    the dense optimizer's current/initial LR ratio, so the scheduler from ``configure_optimizers``
    (which drives the dense optimizer) drives both."""

    def __init__(self, kind: str) -> None:
        if kind not in EMBEDDING_LR_SCHEDULES:
            raise ValueError(f"embedding_lr_schedule must be one of {EMBEDDING_LR_SCHEDULES}, got {kind!r}")
        self.kind = kind
        self._dense: Any = None
        self._fused: Any = None
        self._dense_base = 1.0
        self._embedding_bases: list[float] = []

    def start(self, dense: torch.optim.Optimizer, fused: Any) -> None:
        """The optimizers of this fit, and their initial LRs: the reference of ``follow_dense``."""
        self._dense, self._fused = dense, fused
        self._dense_base = dense.param_groups[0]["lr"]
        self._embedding_bases = [g["lr"] for g in fused.param_groups]

    def step(self) -> None:
        """Before an update (and after a resume): set the embedding LR the schedule gives now."""
        if self.kind != "follow_dense":
            return
        factor = self._dense.param_groups[0]["lr"] / self._dense_base
        for group, base in zip(self._fused.param_groups, self._embedding_bases):
            group["lr"] = base * factor
