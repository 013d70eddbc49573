"""Runs the systems side by side in one set of processes, interleaved round by round.

Each round runs ``steps_per_round`` steps of every system in a fixed order (A, B, C, ...), so
slow phases of a noisy machine hit all systems alike. Warmup steps are excluded and reported
separately; the stage breakdown and the collective log come from extra steps after the timed
rounds (hooks and the profiler never run inside timed steps).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from lightning_sparselift.bench import scenarios
from lightning_sparselift.bench.measure import StepClock, quantiles, record_collectives
from lightning_sparselift.bench.systems import ALL_SYSTEMS, SYSTEMS
from lightning_sparselift.bench.systems.base import PRECISIONS, BenchEnv, System
from lightning_sparselift.bench.systems.lightning import LIGHTNING_SYSTEM, run_in_trainer
from lightning_sparselift.bench.systems.sparselift import ABLATIONS

DEFAULT_SYSTEMS = ["dlrm-baseline", "torchrec-base", "torchrec", "dense-only", "sparselift", LIGHTNING_SYSTEM]


def default_systems(scenario: scenarios.Scenario) -> list[str]:
    """:data:`DEFAULT_SYSTEMS` that run the scenario's model family."""
    return [n for n in DEFAULT_SYSTEMS if n not in SYSTEMS or scenario.family in SYSTEMS[n].families]
ABLATION_SYSTEMS = [cls.name for cls in ABLATIONS]


@dataclass
class BenchConfig:
    scenario: str = "dlrm"
    world_size: int = 2
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    rounds: int = 8
    steps_per_round: int = 5
    warmup_steps: int = 5
    breakdown_steps: int = 4
    threads_per_rank: int = 1
    pin_cores: bool = False  # pin rank r to core r (os.sched_setaffinity)
    # glibc keeps freed memory for reuse in every rank's process (retain_freed_memory()): by default it
    # returns large blocks to the OS, and whichever system allocates afresh each step then pays a page
    # fault per 4 kB touched, as much as the allocator's history (which system ran before) decides
    retain_freed_memory: bool = False
    seed: int = 0
    precision: str = "32-true"  # the Trainer's precision every system's step runs under (PRECISIONS)
    num_samples: Optional[int] = None  # default: 64 batches per rank
    cache_dir: Optional[str] = None
    timeout_s: float = 600.0
    optimizer: dict[str, Any] = field(default_factory=dict)  # overrides of the scenario's (scenarios.OPTIMIZER_KEYS)

    def load_scenario(self) -> scenarios.Scenario:
        """The scenario, with this run's optimizer overrides."""
        scenario = scenarios.load(self.scenario)
        return scenario.with_optimizer(self.optimizer) if self.optimizer else scenario

    def validate(self) -> None:
        if self.scenario not in scenarios.available() and not Path(self.scenario).exists():
            raise ValueError(f"unknown scenario {self.scenario!r}; available: {scenarios.available()}")
        unknown = sorted(set(self.systems) - set(ALL_SYSTEMS))
        if unknown:
            raise ValueError(f"unknown system(s) {unknown}; available: {ALL_SYSTEMS}")
        if not self.systems:
            raise ValueError("no systems selected")
        family = self.load_scenario().family
        unfit = [n for n in self.systems if n in SYSTEMS and family not in SYSTEMS[n].families]
        if unfit:
            raise ValueError(f"system(s) {unfit} run only {sorted({f for n in unfit for f in SYSTEMS[n].families})} "
                             f"scenarios; {self.scenario!r} is a {family} scenario")
        cores = os.cpu_count() or 1
        if not 1 <= self.world_size <= cores:
            raise ValueError(f"world size {self.world_size} does not fit this machine: it has {cores} core(s), and "
                             f"oversubscribed ranks would measure the scheduler, not the systems")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: the systems run {PRECISIONS}")
        for name in ("rounds", "steps_per_round"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def _data(config: BenchConfig, scenario: scenarios.Scenario):
    samples = config.num_samples or 64 * config.world_size * scenario.batch_size
    dm = scenario.datamodule(samples, max(samples // 4, scenario.batch_size), config.seed, config.cache_dir)
    dm.prepare_data()
    return dm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Worker:
    """Everything one rank does."""

    def __init__(self, rank: int, config: BenchConfig):
        self.rank, self.config = rank, config
        self.scenario = config.load_scenario()
        self.control = dist.new_group(backend="gloo")  # decisions travel apart from the systems' collectives
        self.env = BenchEnv(self.scenario, rank, config.world_size, _data(config, self.scenario).split("train"),
                            seed=config.seed, warmup_steps=config.warmup_steps, precision=config.precision)
        self.systems: dict[str, System] = {}
        self.result: dict[str, dict[str, Any]] = {name: {"status": "ok", "error": None} for name in config.systems}
        self.clocks: dict[str, StepClock] = {}
        self.rounds: dict[str, list[list[float]]] = {}
        self.warmup: dict[str, StepClock] = {}

    # -- failure handling: every rank must agree, else the next collective hangs
    def _guard(self, name: str, what: str, fn: Callable[[], Any]) -> None:
        error = None
        if self.result[name]["status"] == "ok":
            try:
                fn()
            except Exception:  # a failing system is recorded, the others go on
                error = f"{what} failed on rank {self.rank}:\n{traceback.format_exc(limit=8)}"
        errors: list[Optional[str]] = [None] * self.config.world_size
        dist.all_gather_object(errors, error, group=self.control)
        first = next((e for e in errors if e), None)
        if first and self.result[name]["status"] == "ok":
            self.result[name].update(status="failed", error=first)
            self.systems.pop(name, None)

    def _active(self) -> list[str]:
        return [n for n in self.config.systems if n != LIGHTNING_SYSTEM and self.result[n]["status"] == "ok"]

    def setup(self) -> None:
        for name in self.config.systems:
            if name == LIGHTNING_SYSTEM:
                continue
            start = time.perf_counter()

            def build(name: str = name) -> None:
                system = SYSTEMS[name](self.env)
                system.setup()
                self.systems[name] = system

            self._guard(name, "setup", build)
            self.result[name]["setup_s"] = time.perf_counter() - start

    def run_block(self, name: str, round_index: int, steps: int, clock: StepClock) -> None:
        system = self.systems[name]
        dist.barrier(group=self.control)
        offset = round_index * steps

        def block() -> None:
            for i in range(steps):
                with clock.time():
                    system.step(offset + i)

        self._guard(name, f"round {round_index}", block)

    def warmup_all(self) -> None:
        for name in self._active():
            self.warmup[name] = StepClock()
            self.run_block(name, 0, self.config.warmup_steps, self.warmup[name])
            # SparseLift's own warmup (capture, calibration) must end before timing starts
            for _ in range(_MAX_EXTRA_WARMUP):
                if name not in self._active() or self.systems[name].ready:
                    break
                self.run_block(name, 0, 1, self.warmup[name])
            if name in self._active() and not self.systems[name].ready:
                def not_ready(name: str = name) -> None:
                    raise RuntimeError(f"{name} was not ready after {_MAX_EXTRA_WARMUP} extra warmup steps")

                self._guard(name, "warmup", not_ready)

    def round(self, r: int) -> None:
        for name in self._active():
            clock = self.clocks.setdefault(name, StepClock())
            before = len(clock.wall_ms)
            self.run_block(name, r + 1, self.config.steps_per_round, clock)
            self.rounds.setdefault(name, []).append(clock.wall_ms[before:])

    def breakdown_and_collectives(self) -> None:
        for name in self._active():
            system = self.systems[name]

            def measure(system: System = system) -> None:
                base = 10_000
                for i in range(self.config.breakdown_steps):
                    with system.timer.step():
                        system.step(base + i)
                with record_collectives() as log:
                    system.step(base + self.config.breakdown_steps)
                self.result[system.name]["stages_ms"] = system.timer.summary()
                self.result[system.name]["collectives_per_step"] = log.summary()
                self.result[system.name]["top_ops"] = log.top_ops
                self.result[system.name].update(system.report())

            dist.barrier(group=self.control)
            self._guard(name, "breakdown", measure)

    def gathered(self) -> dict[str, Any]:
        """Per-step times, max over ranks (a step is as slow as its slowest rank)."""
        local = {name: {"wall": c.wall_ms, "cpu": c.cpu_ms, "thread_cpu": c.thread_cpu_ms, "page_faults": c.page_faults,
                        "rounds": [len(r) for r in self.rounds.get(name, [])],
                        "warmup": self.warmup[name].wall_ms if name in self.warmup else []}
                 for name, c in self.clocks.items()}
        everyone: list[Any] = [None] * self.config.world_size
        dist.all_gather_object(everyone, local, group=self.control)
        merged = {}
        for name in local:
            if any(name not in e for e in everyone) or len({len(e[name]["wall"]) for e in everyone}) != 1:
                continue
            merged[name] = {
                "wall": np.max([e[name]["wall"] for e in everyone], axis=0).tolist(),
                "cpu": np.mean([e[name]["cpu"] for e in everyone], axis=0).tolist(),
                "thread_cpu": np.mean([e[name]["thread_cpu"] for e in everyone], axis=0).tolist(),
                "page_faults": np.mean([e[name]["page_faults"] for e in everyone], axis=0).tolist(),
                "warmup": np.max([e[name]["warmup"] for e in everyone], axis=0).tolist() if local[name]["warmup"] else [],
                "rounds": local[name]["rounds"],
            }
        return merged


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MOST_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest on 64-bit hosts


def retain_freed_memory() -> None:
    """This process's glibc malloc serves blocks up to 32 MB from its heap and never trims it, so
    memory a step frees is reused by the next without faulting its pages in again (the dynamic
    thresholds it replaces start at 128 kB and move with what was freed last)."""
    import ctypes

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):
        raise RuntimeError("--retain-freed-memory needs glibc's mallopt (this process's C library has none)")
    if not (libc.mallopt(_M_MMAP_THRESHOLD, _MOST_MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        raise RuntimeError("glibc refused the malloc thresholds of --retain-freed-memory")


def _worker_main(rank: int, config: BenchConfig, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if config.pin_cores:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    if config.retain_freed_memory:
        retain_freed_memory()
    torch.set_num_threads(config.threads_per_rank)
    dist.init_process_group("gloo", rank=rank, world_size=config.world_size,
                            timeout=timedelta(seconds=config.timeout_s))
    worker = _Worker(rank, config)
    worker.setup()
    if LIGHTNING_SYSTEM in config.systems:
        worker._guard(LIGHTNING_SYSTEM, "Trainer.fit", lambda: run_in_trainer(worker, _MAX_EXTRA_WARMUP))
    # Without Lightning driving the schedule (absent, or failed part way), finish it here.
    if not worker.warmup:
        worker.warmup_all()
    done = min((len(worker.rounds.get(n, [])) for n in worker._active()), default=config.rounds)
    for r in range(done, config.rounds):
        worker.round(r)
    worker.breakdown_and_collectives()
    merged = worker.gathered()
    if rank == 0:
        _write_atomically(out, {"result": worker.result, "steps": merged})
    dist.barrier(group=worker.control)
    dist.destroy_process_group()


# cap on the untimed steps a system may add to finish its own warmup (SparseLift's capture, its
# calibration and the steady-state check): five candidates at the default budget (256 pairs, next
# batch's with a settle step each) take ~3,100 steps at most; typical is a third of it
_MAX_EXTRA_WARMUP = 4000


def _write_atomically(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.partial"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)  # the file exists only once it is complete


def summarize(config: BenchConfig, raw: dict[str, Any], scenario: scenarios.Scenario, wall_s: float) -> dict[str, Any]:
    global_batch = scenario.batch_size * config.world_size
    systems = {}
    for name in config.systems:
        res = dict(raw["result"][name])
        steps = raw["steps"].get(name)
        if res["status"] == "ok" and steps:
            wall = steps["wall"]
            res.update(
                step_ms=quantiles(wall), samples_per_s=quantiles([global_batch / (w / 1e3) for w in wall]),
                cpu_ms=quantiles(steps["cpu"]), thread_cpu_ms=quantiles(steps["thread_cpu"]),
                # (a step either finds its fresh memory mapped or maps it all: the mean is what a step pays)
                page_faults=quantiles(steps["page_faults"]), page_faults_mean=float(np.mean(steps["page_faults"])),
                step_times_ms=wall, warmup_ms=steps["warmup"],
                round_median_ms=[float(np.median(r)) for r in _split(wall, steps["rounds"])],
            )
        elif res["status"] == "ok":
            res.update(status="failed", error=res.get("error") or "no timed steps were recorded")
        res.setdefault("calibration_s", 0.0)  # systems without a planner
        systems[name] = res
    dense = systems.get("dense-only", {})
    if dense.get("status") == "ok":
        # the sparse path's CPU cost: a system's CPU time per step beyond the dense-only bound's, in
        # all and on the training thread (the rest is other threads': gloo's exchanges)
        for res in systems.values():
            if res["status"] == "ok":
                res["sparse_cpu_ms"] = res["cpu_ms"]["median"] - dense["cpu_ms"]["median"]
                res["sparse_thread_cpu_ms"] = res["thread_cpu_ms"]["median"] - dense["thread_cpu_ms"]["median"]
    ratios = {}
    ok = [n for n, r in systems.items() if r["status"] == "ok"]
    for a in ok:
        for b in ok:
            if a != b:
                per_round = np.array(systems[b]["round_median_ms"]) / np.array(systems[a]["round_median_ms"])
                ratios[f"{a} / {b}"] = quantiles(per_round.tolist())
    return {
        "schema": "sparselift-bench/1",
        "scenario": {"name": scenario.name, "description": scenario.description, "batch_size_per_rank": scenario.batch_size,
                     "num_features": scenario.num_features, "optimizer": scenario.optimizer},
        "world_size": config.world_size,
        "config": asdict(config),
        "global_batch": global_batch,
        "wall_s": wall_s,
        "systems": systems,
        "ratios": ratios,
        "ratio_definition": "'A / B' = median over rounds of (B's median step time / A's): A's speedup over B",
    }


def _split(values: list[float], sizes: list[int]) -> list[list[float]]:
    out, i = [], 0
    for n in sizes:
        out.append(values[i:i + n])
        i += n
    return out


def run(config: BenchConfig) -> dict[str, Any]:
    """Run the benchmark in ``config.world_size`` fresh processes and return its summary."""
    config.validate()
    scenario = config.load_scenario()
    _data(config, scenario)  # generate once here, so ranks only memory-map
    start = time.perf_counter()
    raw, teardown_error = spawn_workers(_worker_main, config, "raw.json")
    summary = summarize(config, raw, scenario, time.perf_counter() - start)
    summary["teardown_error"] = teardown_error
    return summary


def spawn_workers(fn: Callable[..., None], config: BenchConfig, name: str) -> tuple[dict[str, Any], Optional[str]]:
    """Run ``fn(rank, config, port, out)`` on every rank and read what rank 0 wrote to ``out``.

    A rank that dies after the results were written (seen: an abort in a C++ destructor while
    the process exits) does not void the results; its error is returned alongside them.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, name)
        teardown_error = None
        try:
            mp.start_processes(fn, args=(config, _free_port(), out), nprocs=config.world_size, start_method="spawn")
        except mp.ProcessExitedException as e:
            if not Path(out).exists():
                raise
            teardown_error = str(e)
        return json.loads(Path(out).read_text()), teardown_error
