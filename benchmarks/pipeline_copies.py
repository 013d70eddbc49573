"""What pipelined buckets cost and save with one core per rank: one SparseLift run on 2 ranks, the
plan of ``--optimizations`` (applied without calibration) against the same plan with the output
all-to-all pipelined in ``--buckets`` buckets, switched in runs of ``--run`` steps (mirrored: A B
B A ...), the first step of each run unmeasured. Per step: wall time, the training thread's CPU
time and the process's, judged as paired differences (pipelined - not), and the training thread's
CPU time inside the pipeline's column copies (``runtime/pipeline.py``'s ``gather`` / ``scatter``).

    .venv/bin/python benchmarks/pipeline_copies.py --scenario sparse-heavy --pairs 40
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from two_ranks import bench_env, mirrored_steps, print_pairs, spawn, warmed_up


class _CopyClock:
    """The training thread's CPU time inside the pipeline's copy functions (wrapped in place)."""

    def __init__(self) -> None:
        from lightning_sparselift.runtime import pipeline

        self.seconds = 0.0
        for name in ("gather", "scatter"):
            setattr(pipeline, name, self._timed(getattr(pipeline, name)))

    def _timed(self, copy: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.thread_time()
            try:
                return copy(*args)
            finally:
                self.seconds += time.thread_time() - start
        return timed


def _without(session: Any, role: str) -> Any:
    """The graph of ``session``'s plan without its accepted ``role`` candidate: the others applied to
    the identity graph in their order by the planner (as a saved plan is rebuilt)."""
    from lightning_sparselift.plan.planner import Planner

    planner = Planner(session.passes, None, calibrate=False)
    feasible = {c.id: c for c in planner.propose(session.identity)[0]}
    graph = session.identity
    for decision in session.plan.accepted:
        if decision.role != role:
            graph = planner.apply(graph, feasible[decision.candidate])
    return graph


def _worker(rank: int, scenario: str, pairs: int, run: int, optimizations: list[str], buckets: int) -> None:
    from lightning_sparselift.bench.systems.sparselift import SparseLift

    pipelined = f"subgraph_parallelism:pipelined{buckets}"
    system = SparseLift(bench_env(rank, scenario), {"optimizations": [*optimizations, pipelined], "calibrate": False})
    step = warmed_up(system)
    session = system.session
    role = f"pipelined{buckets}"
    if not any(d.role == role for d in session.plan.accepted):
        raise SystemExit(f"{pipelined} is not feasible here: {[d.reason for d in session.plan.decisions]}")
    graphs = {True: session.plan.graph, False: _without(session, role)}
    clock = _CopyClock()
    local = mirrored_steps(system, step, pairs, run, lambda on: session.installed.use(graphs[on]),
                           lambda: clock.seconds)
    if rank == 0:
        print(f"{scenario}: {optimizations} against the same with {pipelined}; {local.shape[1]} pairs in runs "
              f"of {run}")
    for who, values in print_pairs(local, "one all-to-all", "pipelined"):
        copies = sorted(values[1, :, 3].tolist())
        if rank == 0:
            print(f"  {who:<12s} of which the pipeline's copies (training thread CPU): median "
                  f"{copies[len(copies) // 2]:.2f} ms [p25 {copies[len(copies) // 4]:.2f}, "
                  f"p75 {copies[3 * len(copies) // 4]:.2f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="sparse-heavy")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--run", type=int, default=4, help="steps per run of one plan (>= 2)")
    parser.add_argument("--optimizations", default="codegen")
    parser.add_argument("--buckets", type=int, choices=(2, 4, 8), default=2)
    args = parser.parse_args()
    if args.run < 2:
        parser.error("--run must be >= 2 (its first step is not measured)")
    spawn(_worker, args.scenario, args.pairs, args.run, args.optimizations.split(","), args.buckets)


if __name__ == "__main__":
    main()
