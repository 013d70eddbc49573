"""``sparselift-lightning``: SparseLift through a real ``Trainer.fit``, which drives the whole
schedule: the other systems' rounds run from a callback between its blocks."""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

LIGHTNING_SYSTEM = "sparselift-lightning"


def lightning_env(rank: int, world_size: int) -> None:
    """Environment that makes Lightning treat the benchmark's processes as externally launched
    (TorchElastic-style), so ``Trainer.fit`` runs inside them without starting new ones."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_RUN_ID="sparselift-bench")


class Interleaved(Protocol):
    """What the Trainer's callback needs of the runner's worker: the configuration and data, the
    clocks and results it fills, and the other systems' warmup and rounds to run between blocks."""

    rank: int
    config: Any
    env: Any
    scenario: Any
    control: Any
    clocks: dict[str, Any]
    warmup: dict[str, Any]
    rounds: dict[str, list[list[float]]]
    result: dict[str, dict[str, Any]]

    def warmup_all(self) -> None: ...

    def round(self, r: int) -> None: ...


def run_in_trainer(worker: Interleaved, max_extra_warmup: int) -> None:
    """Runs the whole schedule inside one ``Trainer.fit`` of ``sparselift-lightning``: the
    other systems' rounds run between its blocks, from a callback (``max_extra_warmup``: the
    untimed steps the strategy may take to finish its own warmup)."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_sparselift import SparseLiftStrategy
    from lightning_sparselift.bench.measure import StageTimer, StepClock, record_collectives
    from lightning_sparselift.bench.systems.sparselift import bench_strategy_kwargs, session_report, time_early_starts
    cfg, env = worker.config, worker.env
    name = LIGHTNING_SYSTEM
    k, warm, rounds, bd = cfg.steps_per_round, cfg.warmup_steps, cfg.rounds, cfg.breakdown_steps
    # timed steps start once `warm` steps ran and the strategy's own warmup (capture, calibration) ended
    total = warm + max_extra_warmup + rounds * k + bd + 1
    timer, clock, warm_clock = StageTimer(), StepClock(), StepClock()
    worker.clocks[name], worker.warmup[name] = clock, warm_clock

    class Interleave(L.Callback):
        def __init__(self) -> None:
            self.clock = StepClock()  # the step in progress
            self.profile: Any = None
            self.step_cm: Any = None
            self.offset: Optional[int] = None

        def on_train_start(self, trainer, module) -> None:
            timer.attach(module.model.sparse_arch)
            module.model.register_forward_pre_hook(lambda *_: timer.forward_start())
            worker.warmup_all()

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            session = trainer.strategy.session
            if self.offset is None and batch_idx >= warm and (session is None or session.done):
                self.offset = batch_idx  # the first timed step: start the other systems' round 0 first
                if trainer.strategy.lifted_executor is not None:
                    time_early_starts(trainer.strategy.lifted_executor, timer)
                worker.round(0)
                dist.barrier(group=worker.control)
            i = self.timed_index(batch_idx)
            if i >= rounds * k:
                if i < rounds * k + bd:
                    self.step_cm = timer.step()
                    self.step_cm.__enter__()
                else:
                    self.profile = record_collectives()
                    self.log = self.profile.__enter__()
            self.clock.begin()

        def timed_index(self, batch_idx: int) -> int:
            return -1 if self.offset is None else batch_idx - self.offset

        def on_before_backward(self, trainer, module, loss) -> None:
            timer.forward_end(loss)

        def on_after_backward(self, trainer, module) -> None:
            timer.backward_end()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            i = self.timed_index(batch_idx)
            if i < 0:
                self.clock.end(into=warm_clock)
            elif i < rounds * k:
                self.clock.end(into=clock)
            if self.step_cm is not None:
                self.step_cm.__exit__(None, None, None)
                self.step_cm = None
            if self.profile is not None:
                self.profile.__exit__(None, None, None)
                worker.result[name]["collectives_per_step"] = self.log.summary()
                worker.result[name]["top_ops"] = self.log.top_ops
                worker.result[name]["stages_ms"] = timer.summary()
                self.profile = None
                trainer.should_stop = True
            done = i + 1
            if 0 < done <= rounds * k and done % k == 0:
                worker.rounds.setdefault(name, []).append(clock.wall_ms[-k:])
                if done < rounds * k:
                    worker.round(done // k)
                dist.barrier(group=worker.control)

    lightning_env(worker.rank, cfg.world_size)
    torch.manual_seed(cfg.seed)
    module = worker.scenario.module()
    batches = [env.local_batch(i) for i in range(total)]
    strategy = SparseLiftStrategy(**bench_strategy_kwargs(env))
    start = time.perf_counter()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=cfg.world_size, max_steps=total,
                        precision=cfg.precision,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        use_distributed_sampler=False, callbacks=[Interleave()])
    worker.result[name]["setup_s"] = None
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    worker.result[name]["fit_s"] = time.perf_counter() - start
    worker.result[name].update(session_report(strategy.session))
