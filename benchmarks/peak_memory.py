"""Peak memory per rank: TorchRec's pipeline, SparseLift with the reference kernels (the identity
plan on the lifted executor) and SparseLift with generated kernels (code generation's lookups and
output layout, applied without calibration; kept buffers on, and off), each in fresh processes on 2 ranks
so each peak is its own. Per rank: the resident set after the bench data is loaded, the peak
resident set (``ru_maxrss``) after the system's warmup and ``--steps`` steps, and the bytes of
the sharded tables and their optimizer state (the storage every system updates in place).

    .venv/bin/python benchmarks/peak_memory.py --scenario dlrm --steps 40
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.distributed as dist

from two_ranks import bench_env, spawn, warmed_up

SYSTEMS = {
    "torchrec": None,
    "sparselift-reference-kernels": {"optimizations": [], "calibrate": False},
    "sparselift-generated-kernels": {"optimizations": ["codegen"], "calibrate": False},
    "sparselift-generated-fresh-buffers": {"optimizations": ["codegen"], "calibrate": False, "reuse_buffers": False},
}


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _state_mb(module: torch.nn.Module) -> float:
    """The fused tables and optimizer state the rank's table-batched modules hold."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    seen, total = set(), 0
    # (TorchRec's sharded modules keep their lookups in a plain list, which modules() does not walk)
    for lookup in (lk for m in module.modules() for lk in getattr(m, "_lookups", [])):
        for m in lookup.modules():
            if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen) and id(m) not in seen:
                seen.add(id(m))
                total += sum(t.numel() * t.element_size() for t in (m.weights_host, m.momentum1_host,
                                                                     m.momentum2_host))
    return total / 2**20


def _worker(rank: int, scenario: str, name: str, steps: int) -> None:
    from lightning_sparselift.bench.systems import SYSTEMS as BENCH_SYSTEMS
    from lightning_sparselift.bench.systems.sparselift import SparseLift

    env = bench_env(rank, scenario)
    loaded = _resident_mb()
    options = SYSTEMS[name]
    system = BENCH_SYSTEMS["torchrec"](env) if options is None else SparseLift(env, options)
    step = warmed_up(system)
    for s in range(step, step + steps):
        system.step(s)
    model = system.dmp if options is None else system.model
    plan = [d.candidate for d in system.session.plan.accepted] if options is not None else []
    local = torch.tensor([loaded, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, _state_mb(model)],
                         dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(gathered, local)
    if rank == 0:
        for r, (base, peak, state) in enumerate(g.tolist() for g in gathered):
            print(f"{name:30s} rank {r}: data loaded {base:8.1f} MB, peak {peak:8.1f} MB (+{peak - base:7.1f}), "
                  f"tables + optimizer state {state:7.1f} MB" + (f"; plan {plan}" if r == 0 and plan else ""),
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="dlrm")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    for name in args.systems.split(","):
        spawn(_worker, args.scenario, name, args.steps)


if __name__ == "__main__":
    main()
