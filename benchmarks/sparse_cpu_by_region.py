"""Where the sparse path's CPU time goes, region by region, on the training thread: dense-only,
torchrec and sparselift (a plan with the given passes, applied without calibration) from the bench,
on 2 ranks, one after the other; rank 0's means per step.

    .venv/bin/python benchmarks/sparse_cpu_by_region.py --scenario dlrm --steps 40
    .venv/bin/python benchmarks/sparse_cpu_by_region.py --scenario sparse-heavy --optimizations aggregation,latency_hiding

Regions are timed with ``time.thread_time`` around the lifted executor's methods (thread CPU, not
profiler self time, which inflates under contention); "process" minus "training thread" is the
other threads' CPU (gloo's exchanges).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from two_ranks import bench_env, spawn, warmed_up


def _timed(acc: dict[str, float], key: str, fn: Callable[..., Any],
           wrap_result: Optional[Callable[[Any], Any]] = None) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        result = fn(*args, **kwargs)
        acc[key] += (time.thread_time() - start) * 1e3
        return wrap_result(result) if wrap_result is not None and result is not None else result
    return timed


def _instrument(session: Any, acc: dict[str, float]) -> None:
    from lightning_sparselift.cost.calibration import RegionClock

    region = RegionClock.region

    @contextmanager
    def timed_region(self: RegionClock) -> Iterator[None]:
        start = time.thread_time()
        with region(self):
            yield
        acc["measured regions (forward chain + backward collectives)"] += (time.thread_time() - start) * 1e3

    RegionClock.region = timed_region
    for ex in session.installed.executors.values():
        ex._run = _timed(acc, "forward chain (input wait, lookups forward, output issue)", ex._run)
        ex.inputs.start = _timed(acc, "input distribution issue (permute, splits, payload)", ex.inputs.start,
                                 lambda complete: _timed(acc, "input distribution wait + recat", complete))
        ex._look_up = _timed(acc, "lookups forward", ex._look_up)
        ex.outputs.wait = _timed(acc, "output distribution wait + layout", ex.outputs.wait)
        ex.output = _timed(acc, "KeyedTensor", ex.output)


def _worker(rank: int, scenario: str, steps: int, optimizations: list[str]) -> None:
    from lightning_sparselift.bench.systems.dense_only import DenseOnly
    from lightning_sparselift.bench.systems.sparselift import SparseLift
    from lightning_sparselift.bench.systems.torchrec import TorchRecSparseDist

    env = bench_env(rank, scenario)
    results = {}
    for system in (DenseOnly(env), TorchRecSparseDist(env),
                   SparseLift(env, {"optimizations": optimizations, "calibrate": False})):
        step = warmed_up(system)
        acc: dict[str, float] = defaultdict(float)
        clock = None
        if isinstance(system, SparseLift):
            _instrument(system.session, acc)
            clock = system.session.installed.clock
            clock.take_lookup()
        thread, process = time.thread_time(), time.process_time()
        for i in range(steps):
            system.step(step + i)
        out = {"training thread": (time.thread_time() - thread) * 1e3 / steps,
               "process": (time.process_time() - process) * 1e3 / steps}
        if clock is not None:
            out["lookups forward + backward"] = clock.take_lookup()[0] / steps
        out.update({k: v / steps for k, v in acc.items()})
        results[system.name] = out
    if rank == 0:
        for name, regions in results.items():
            print(name)
            for key, ms in regions.items():
                print(f"  {key:<58s} {ms:8.2f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="dlrm")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--optimizations", default="aggregation,latency_hiding,codegen")
    args = parser.parse_args()
    spawn(_worker, args.scenario, args.steps, args.optimizations.split(","))


if __name__ == "__main__":
    main()
