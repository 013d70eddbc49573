"""What every system shares: the bench environment (the scenario's batches, prepared before
timing), the scenario's model and optimizers, and :class:`System`, whose ``step()`` runs one full
training step with the stage timer's hook points."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_sparselift.bench.measure import StageTimer
from lightning_sparselift.bench.scenarios import FAMILIES, Scenario
from lightning_sparselift.data.batch import RecArrays, RecBatch


# the Trainer precisions the systems run (each system's forward under :func:`autocast`)
PRECISIONS = ("32-true", "bf16-mixed")


def autocast(precision: str) -> Any:
    """The forward's context under ``precision``, as Lightning's precision plugin sets it on CPU:
    bf16-mixed autocasts the dense part's matmuls to bfloat16."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")


@dataclass
class BenchEnv:
    scenario: Scenario
    rank: int
    world_size: int
    arrays: RecArrays
    seed: int = 0
    pool: int = 32  # distinct batches per rank, cycled
    warmup_steps: int = 5  # untimed steps before measuring
    precision: str = "32-true"  # one of PRECISIONS
    # every system's tables placed as float32 exchanges place them (a parity run: only the wire differs)
    placed_as_exact: bool = False
    _local: list[RecBatch] = field(default_factory=list)
    _global: list[list[RecBatch]] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.scenario.batch_size

    def _batch(self, index: int) -> RecBatch:
        b = self.batch_size
        count = len(self.arrays) // b
        if count < self.world_size:
            raise ValueError(f"{len(self.arrays)} samples are fewer than one batch per rank")
        index %= (count // self.world_size) * self.world_size
        return self.arrays.batch(index * b, (index + 1) * b)

    def local_batch(self, step: int) -> RecBatch:
        if not self._local:
            self._local = [self._batch(i * self.world_size + self.rank) for i in range(self.pool)]
        return self._local[step % self.pool]

    def global_batch(self, step: int) -> list[RecBatch]:
        """The batches of all ranks at ``step`` (rank order): what DLRM-Baseline's replicated
        sparse inputs read."""
        if not self._global:
            self._global = [[self._batch(i * self.world_size + r) for r in range(self.world_size)]
                            for i in range(self.pool)]
        return self._global[step % self.pool]

    def local_iterator(self) -> Iterator[RecBatch]:
        step = 0
        while True:
            yield self.local_batch(step)
            step += 1


def build_rec_model(scenario: Scenario, seed: int) -> nn.Module:
    """The scenario's recommendation model (tables on meta), seeded so every system starts
    from the same dense weights."""
    torch.manual_seed(seed)
    return scenario.module().model


class WithLoss(nn.Module):
    """``model(batch) -> (loss, logits)``, the interface TorchRec's train pipelines expect."""

    def __init__(self, rec: nn.Module, precision: str):
        super().__init__()
        self.rec = rec
        self.precision = precision

    def forward(self, batch: RecBatch) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(self.precision):
            logits = self.rec(batch.dense, batch.sparse).squeeze(-1)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def dense_optimizer(scenario: Scenario, params: Any) -> torch.optim.Optimizer:
    from lightning_sparselift.models.base import DENSE_OPTIMIZERS

    return DENSE_OPTIMIZERS[scenario.optimizer.get("dense", "sgd")](params, lr=scenario.optimizer.get("dense_lr", 0.1))


class System:
    name = ""
    families: tuple[str, ...] = FAMILIES  # the scenario families it can run

    def __init__(self, env: BenchEnv):
        self.env = env
        self.timer = StageTimer()
        self.losses: list[float] = []  # training loss of every step (this rank's batch)

    def setup(self) -> None:
        raise NotImplementedError

    def step(self, step: int) -> None:
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        """What the system wants in its result beside the timings."""
        return {}

    @property
    def ready(self) -> bool:
        """False while the system still runs its own warmup (timing waits for it)."""
        return True

    def _timed_model(self, model: nn.Module, sparse: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Hook the stage timer into ``model`` (forward), its loss (backward start), ``sparse``
        (the sparse path) and ``optimizer`` (backward end)."""
        self.timer.attach(sparse)
        model.register_forward_pre_hook(lambda *_: self.timer.forward_start())
        model.register_forward_hook(lambda _m, _i, out: self._forward_done(out[0]))
        if optimizer is not None:
            optimizer.register_step_pre_hook(lambda *_: self.timer.backward_end())

    def _timed_sharded(self, wrapped: "WithLoss", combined: Any) -> None:
        """:meth:`_timed_model` for a DMP-sharded model and its CombinedOptimizer (the dense
        optimizer's step marks the end of backward)."""
        self._timed_model(wrapped, wrapped.rec.sparse_arch, dict(combined.optimizers)["dense"]._optimizer)

    def _forward_done(self, loss: torch.Tensor) -> None:
        self.timer.forward_end(loss)
        if loss.requires_grad:  # training forwards only
            self.losses.append(float(loss.detach()))


class LoopSystem(System):
    """A plain loop: forward, backward, optimizer step."""

    model: nn.Module
    optimizer: Any

    def step(self, step: int) -> None:
        loss, _ = self.model(self.env.local_batch(step))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def build_sharded(env: BenchEnv, validate_inputs: bool, sharding_types: Optional[dict[str, str]] = None,
                  embedding_optimizer: Optional[Any] = None, generated_adam: bool = True,
                  qcomms_config: Optional[Any] = None) -> tuple[nn.Module, Any, nn.Module, list[str]]:
    """The scenario's model sharded by TorchRec's DMP: (the DMP, its combined optimizer, the
    :class:`WithLoss` it wraps, the sparse modules' paths); ``qcomms_config``: TorchRec's
    quantized output exchanges."""
    from lightning_sparselift.embedding_optimizer import EmbeddingOptimizer, combine_optimizers
    from lightning_sparselift.sharding import shard_model

    wrapped = WithLoss(build_rec_model(env.scenario, env.seed), env.precision)
    sharded = shard_model(wrapped, env.world_size, torch.device("cpu"), sharding_types,
                          EmbeddingOptimizer.parse(embedding_optimizer or env.scenario.embedding_optimizer()),
                          dist.group.WORLD, dist.group.WORLD if validate_inputs else None, generated_adam,
                          qcomms_config, env.placed_as_exact)
    dense = dense_optimizer(env.scenario, sharded.dmp.parameters())
    return sharded.dmp, combine_optimizers(sharded.dmp, dense), wrapped, sharded.sparse_module_paths
