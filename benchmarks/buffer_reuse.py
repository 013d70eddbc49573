"""What keeping the executor's per-step buffers saves (``reuse_buffers``): one SparseLift run on
2 ranks (a plan with the given passes, applied without calibration), the buffers' reuse switched
on and off in runs of ``--run`` steps (on, off, off, on, ...: mirrored), the first step of each
run unmeasured (it allocates what the run then keeps, or lets the kept memory go); the measured
steps' wall time, the training thread's CPU time and the process's (gloo's threads write what
they receive) judged as paired differences (off - on: what reuse saves), rank 0's and the
slowest rank's.

    .venv/bin/python benchmarks/buffer_reuse.py --scenario dlrm --pairs 60
    .venv/bin/python benchmarks/buffer_reuse.py --scenario sparse-heavy --pairs 40 --optimizations latency_hiding:early_start,codegen
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from two_ranks import bench_env, spawn, warmed_up


def _worker(rank: int, scenario: str, pairs: int, run: int, optimizations: list[str]) -> None:
    from lightning_sparselift.bench.systems import SparseLift
    from lightning_sparselift.cost.decision import paired_estimate

    system = SparseLift(bench_env(rank, scenario), {"optimizations": optimizations, "calibrate": False})
    step = warmed_up(system)
    executors = list(system.session.installed.executors.values())
    samples: dict[bool, list[list[float]]] = {True: [], False: []}  # reuse -> per step [wall, thread, process]
    measured = run - 1
    for k in range(2 * -(-pairs // measured)):
        reuse = (k % 4) in (0, 3)  # on off off on ...
        for ex in executors:
            ex.buffers.reuse = reuse
        system.step(step)
        step += 1
        for _ in range(measured):
            dist.barrier()
            wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            system.step(step)
            step += 1
            samples[reuse].append([(time.perf_counter() - wall) * 1e3, (time.thread_time() - thread) * 1e3,
                                   (time.process_time() - process) * 1e3])
    local = torch.tensor([samples[True], samples[False]], dtype=torch.float64)  # [arm, pair, metric]
    gathered = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(gathered, local)
    if rank == 0:
        plan = [d.candidate for d in system.session.plan.decisions if d.accepted]
        print(f"{scenario}: plan {plan}; {len(samples[True])} pairs in runs of {run}; buffers reused on rank 0: "
              f"{sum(ex.buffers.reused for ex in executors)}")
        for who, values in (("rank 0", gathered[0]), ("slowest rank", torch.stack(gathered).amax(dim=0))):
            for m, metric in enumerate(("step wall", "training thread CPU", "process CPU")):
                on, off = values[0, :, m].tolist(), values[1, :, m].tolist()
                e = paired_estimate(on, off, 0.95, 1)
                print(f"  {who:<12s} {metric:<20s} reuse on {sorted(on)[len(on) // 2]:7.2f} ms, off "
                      f"{sorted(off)[len(off) // 2]:7.2f} ms: off - on {e.increment_ms:+.3f} ms "
                      f"[{e.interval_ms[0]:+.3f}, {e.interval_ms[1]:+.3f}] ({e.pairs} pairs, {e.outliers} outliers)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="dlrm")
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--run", type=int, default=4, help="steps per run of one setting (>= 2)")
    parser.add_argument("--optimizations", default="latency_hiding:early_start,codegen")
    args = parser.parse_args()
    if args.run < 2:
        parser.error("--run must be >= 2 (its first step is not measured)")
    spawn(_worker, args.scenario, args.pairs, args.run, args.optimizations.split(","))


if __name__ == "__main__":
    main()
