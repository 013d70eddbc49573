"""What the scripts that time the bench's systems on 2 local ranks share: the ranks' gloo process
group (one intra-op thread each), the scenario's bench data, and a system run past its own warmup."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _start(rank: int, port: int, worker: Callable[..., None], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    worker(rank, *args)
    dist.destroy_process_group()


def spawn(worker: Callable[..., None], *args: Any) -> None:
    """``worker(rank, *args)`` on 2 spawned ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_start, args=(port, worker, args), nprocs=2)


def bench_env(rank: int, scenario: str) -> Any:
    """The bench's environment of ``scenario`` for ``rank`` (its data generated or cached)."""
    from lightning_sparselift.bench import scenarios
    from lightning_sparselift.bench.runner import BenchConfig, _data
    from lightning_sparselift.bench.systems import BenchEnv

    loaded = scenarios.load(scenario)
    return BenchEnv(loaded, rank, 2, _data(BenchConfig(scenario=scenario, world_size=2), loaded).split("train"))


def warmed_up(system: Any, steps: int = 8) -> int:
    """Set ``system`` up and train it until its own warmup (capture, calibration) is over and at
    least ``steps`` steps ran; returns the next step's index."""
    system.setup()
    step = 0
    while not system.ready or step < steps:
        system.step(step)
        step += 1
    return step
