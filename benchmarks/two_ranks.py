"""What the scripts that time the bench's systems on 2 local ranks share: the ranks' gloo process
group (one intra-op thread each), the scenario's bench data, a system run past its own warmup, and
two settings of one run compared in mirrored runs of steps."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Optional

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
    from lightning_sparselift.bench.systems.base import BenchEnv

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


def mirrored_steps(system: Any, step: int, pairs: int, run: int, use: Callable[[bool], None],
                   probe: Optional[Callable[[], float]] = None) -> torch.Tensor:
    """Train ``system`` from ``step`` in runs of ``run`` steps, ``use(second)`` called before each
    run (first, second, second, first, ...: mirrored), the first step of each run unmeasured, until
    each arm has at least ``pairs`` measured steps. Per arm (0: first, 1: second) and measured step:
    wall, training thread CPU and process CPU ms, and the growth of ``probe()`` (seconds) in ms."""
    measured = run - 1
    samples: list[list[list[float]]] = [[], []]
    for k in range(2 * -(-pairs // measured)):
        second = (k % 4) in (1, 2)
        use(second)
        system.step(step)
        step += 1
        for _ in range(measured):
            dist.barrier()
            before = probe() if probe is not None else 0.0
            wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            system.step(step)
            step += 1
            samples[second].append([(time.perf_counter() - wall) * 1e3, (time.thread_time() - thread) * 1e3,
                                    (time.process_time() - process) * 1e3,
                                    ((probe() if probe is not None else 0.0) - before) * 1e3])
    return torch.tensor(samples, dtype=torch.float64)


def print_pairs(local: torch.Tensor, first: str, second: str) -> list[tuple[str, torch.Tensor]]:
    """Gather both ranks' :func:`mirrored_steps` and, on rank 0, print rank 0's and the slowest
    rank's paired differences (second - first) of wall, training thread and process CPU time;
    returns those two views ([arm, pair, metric]) by name."""
    from lightning_sparselift.cost.decision import paired_estimate

    gathered = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(gathered, local)
    views = [("rank 0", gathered[0]), ("slowest rank", torch.stack(gathered).amax(dim=0))]
    if dist.get_rank() == 0:
        for who, values in views:
            for m, metric in enumerate(("step wall", "training thread CPU", "process CPU")):
                a, b = values[0, :, m].tolist(), values[1, :, m].tolist()
                e = paired_estimate(a, b, 0.95, 1)
                print(f"  {who:<12s} {metric:<20s} {first} {sorted(a)[len(a) // 2]:7.2f} ms, {second} "
                      f"{sorted(b)[len(b) // 2]:7.2f} ms: {second} - {first} {e.increment_ms:+.3f} ms "
                      f"[{e.interval_ms[0]:+.3f}, {e.interval_ms[1]:+.3f}] ({e.pairs} pairs, {e.outliers} outliers)")
    return views
