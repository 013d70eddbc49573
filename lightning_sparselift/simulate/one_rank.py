"""TorchRec's training step of a workload timed at one rank on this machine, for a profile of this
machine (``dense: timed``): what the step-time model cannot derive from bytes. fbgemm's CPU
lookups run at rates no copy bandwidth gives (an EmbeddingCollection's row-wise Adagrad backward
measured 30x its bytes; a 120-table sum pooling half of them), and TorchRec's sharded modules and
optimizers spend host time per step (Python per module and feature, KeyedTensor and awaitable
bookkeeping) that no byte or FLOP counts: the whole of a small model's sparse step here.

The model is sharded by the strategy's own :func:`~lightning_sparselift.sharding.shard_model` in a
one-process gloo group, trained for a few steps with its own optimizers (the tables' fused into
backward, the rest's as ``configure_optimizers`` builds it), and read by the strategy's own capture
(:class:`~lightning_sparselift.frontend.capture.SparseCapture`: TorchRec's lookups on the training
thread's CPU clock, the step's wall time), as the capture steps of a run read it."""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from statistics import median
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from lightning_sparselift.cost.step_record import StepTimings


@dataclass
class OneRankTiming:
    """TorchRec's step at one rank (medians of the steps after the first), on ``threads`` intra-op
    threads, at the workload's batch."""

    step_ms: float  # forward, backward and the optimizers' step
    lookup_ms: dict[str, float]  # per sparse module path: TorchRec's lookups, forward and backward
    threads: int


class _TrainingStep(nn.Module):
    """The module's ``training_step`` as a forward, so that DMP's wrappers run it as a step."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, index: int) -> torch.Tensor:
        return self.module.training_step(batch, index)


def time_one_rank(model: nn.Module, batches: list[Any], embedding_optimizer: Any, threads: int,
                  steps: int = 16) -> OneRankTiming:
    """Shard ``model`` (a LightningModule, its tables on meta; it is consumed) at world size 1, read
    its lookups in 4 captured steps (the first, which builds TorchRec's dists, left out) and time
    ``steps`` more training steps on ``batches`` (cycled) after a warm-up one."""
    from lightning_sparselift.embedding_optimizer import EmbeddingOptimizer, combine_optimizers
    from lightning_sparselift.frontend.capture import SparseCapture
    from lightning_sparselift.sharding import shard_model

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("timing a workload at one rank needs a process of its own (this one is a rank of "
                           f"{dist.get_world_size()})")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    root = _TrainingStep(model)
    try:
        sharded = shard_model(root, 1, torch.device("cpu"), None, EmbeddingOptimizer.parse(embedding_optimizer),
                              dist.group.WORLD, None)
        params = [p for p in sharded.dmp.parameters() if p.requires_grad]  # (the fused tables leave when combined)
        optimizer = combine_optimizers(sharded.dmp, model_optimizer(model, params))
        step = _stepper(sharded.dmp, optimizer, batches)
        # the lookups read by the capture's hooks; the step's wall time without them (on a small
        # model the hooks' own work is a tenth of the step)
        capture = SparseCapture(root, sharded.sparse_module_paths, 0, 1)
        try:
            for i in range(4):
                with capture.step(batches[i % len(batches)], batches[(i + 1) % len(batches)]):
                    step(i)
        finally:
            capture.remove()
        walls = []
        for i in range(steps + 1):
            start = time.perf_counter()
            step(i)
            walls.append((time.perf_counter() - start) * 1e3)
        lookups = StepTimings.from_captures([capture.result()]).lookup_ms
        prefix = "module."  # (the paths under the training step's wrapper)
        return OneRankTiming(median(walls[1:]), {p[len(prefix):]: ms[0] for p, ms in lookups.items()}, threads)
    finally:
        torch.set_num_threads(before)
        if created:
            dist.destroy_process_group()


@contextmanager
def without_trainer() -> Iterator[None]:
    """A LightningModule's ``training_step`` run outside a Trainer: the module logs its loss, and
    there is no trainer to log to (Lightning warns at every call)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.trainer. reference is not registered")
        yield


def _stepper(dmp: nn.Module, optimizer: Any, batches: list[Any]) -> Callable[[int], None]:
    def step(i: int) -> None:
        with without_trainer():
            dmp(batches[i % len(batches)], i).backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def model_optimizer(model: nn.Module, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The model's own optimizer (``configure_optimizers``: its type and settings) over ``params``."""
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    if isinstance(optimizer, (list, tuple)):
        (optimizer,) = optimizer
    return type(optimizer)(params, **optimizer.defaults)
