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

from two_ranks import bench_env, mirrored_steps, print_pairs, spawn, warmed_up


def _worker(rank: int, scenario: str, pairs: int, run: int, optimizations: list[str]) -> None:
    from lightning_sparselift.bench.systems.sparselift import SparseLift

    system = SparseLift(bench_env(rank, scenario), {"optimizations": optimizations, "calibrate": False})
    step = warmed_up(system)
    executors = list(system.session.installed.executors.values())

    def use(off: bool) -> None:
        for ex in executors:
            ex.buffers.reuse = not off

    local = mirrored_steps(system, step, pairs, run, use)
    if rank == 0:
        plan = [d.candidate for d in system.session.plan.decisions if d.accepted]
        print(f"{scenario}: plan {plan}; {local.shape[1]} pairs in runs of {run}; buffers reused on rank 0: "
              f"{sum(ex.buffers.reused for ex in executors)}")
    print_pairs(local, "reuse on", "off")


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
