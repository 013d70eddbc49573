"""``sparselift simulate``: the sparse path and the plan at world sizes that never ran here.

    sparselift simulate --config configs/dlrm_synthetic.yaml --ranks 8,64,512
    sparselift simulate --scenario sparse-heavy --profile my-cluster.yaml --ranks 16,128 --global-batch 262144
    sparselift simulate --config configs/dlrm_synthetic.yaml --ranks 64 --explain 64
    sparselift simulate fit-profile --run outputs/dlrm/plan.json --config configs/dlrm_synthetic.yaml --out cpu.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, TextIO

from lightning_sparselift.simulate.profile import DEFAULT_PROFILE, HardwareProfile, shipped_profiles

if TYPE_CHECKING:
    from lightning_sparselift.simulate.validation import Timed


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks takes world sizes separated by commas, e.g. 8,64,512; got {text!r}")
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"--ranks: world sizes must be positive, got {text!r}")
    return sorted(set(ranks))


def _source(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", help="a `sparselift fit` config (its model and data)")
    which.add_argument("--scenario", help="a `sparselift bench` scenario (configs/bench/<name>.yaml)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparselift simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _source(p)
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"a hardware profile: a YAML file or one of {shipped_profiles()} (default {DEFAULT_PROFILE})")
    p.add_argument("--ranks", type=_ranks, required=True, help="world sizes, e.g. 8,64,512")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--batch-per-rank", type=int, help="samples per rank (weak scaling; default: the config's)")
    batch.add_argument("--global-batch", type=int, help="samples per step over all ranks (strong scaling)")
    p.add_argument("--optimizations", default=None,
                   help="passes (or pass:role) the planner may use, separated by commas (default: all)")
    p.add_argument("--numerics", choices=("exact", "fast"), default="exact",
                   help="the strategy's numerics: 'fast' lets the planner cast the exchanges to BF16")
    p.add_argument("--json", type=Path, help="write every prediction here")
    p.add_argument("--plot", type=Path, help="write the stage plot here (PNG)")
    p.add_argument("--explain", type=int, metavar="N", help="print what the model and planner did at N ranks")
    return p


def _fit_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparselift simulate fit-profile",
                                description="a hardware profile of this machine, fitted from a run's plan file or "
                                            "recorded bench run")
    p.add_argument("--run", type=Path, required=True, help="a plan file (plan_path) or a recorded bench run")
    _source(p)
    p.add_argument("--timings", type=Path, help="the workload's timings as recorded (a timings file of "
                   "benchmarks/simulate_validation.py, keyed scenario@batch) instead of timing it now: this machine's "
                   "speed drifts within minutes, and a fit should see it as the run did")
    p.add_argument("--step-latency-us", type=float, help="a collective's latency inside a step on this machine as "
                   "measured before (the fitted profile records it) instead of measuring it now: an all-to-all "
                   "after compute on as many processes as the run's ranks")
    p.add_argument("--name", default="cpu-measured", help="the profile's name")
    p.add_argument("--out", type=Path, required=True, help="the profile YAML to write")
    return p


def _workload(args: argparse.Namespace, batch: int, threads: Optional[int]):
    from lightning_sparselift.simulate.workload import workload_from_config, workload_from_scenario

    return (workload_from_config(args.config, batch, threads) if args.config else
            workload_from_scenario(args.scenario, batch, threads))


def _default_batch(args: argparse.Namespace) -> int:
    if args.scenario:
        from lightning_sparselift.bench.scenarios import load

        return load(args.scenario).batch_size
    import yaml

    data = (yaml.safe_load(Path(args.config).read_text()) or {}).get("data") or {}
    batch = data.get("batch_size", (data.get("init_args") or {}).get("batch_size"))
    if not isinstance(batch, int):
        raise ValueError(f"{args.config} sets no data.batch_size: pass --batch-per-rank")
    return batch


def _recorded_timing(args: argparse.Namespace, batch: int) -> Timed:
    from lightning_sparselift.simulate.validation import read_timings, timing_key

    if not args.scenario:
        raise ValueError("--timings holds bench scenarios' timings: use it with --scenario")
    recorded = read_timings(args.timings)
    key = timing_key(args.scenario, batch)
    if key not in recorded:
        raise ValueError(f"{args.timings} has no timing of {key} (it has {sorted(recorded)})")
    return recorded[key]


def fit_main(argv: list[str], out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    from lightning_sparselift.simulate.fit import fit_profile, measure_step_latency_here, read_run

    parser = _fit_parser()
    args = parser.parse_args(argv)
    if args.step_latency_us is not None and args.step_latency_us < 0:
        parser.error(f"--step-latency-us must be >= 0, got {args.step_latency_us}")
    inputs, graph, _ = read_run(args.run)
    batch = max(max(m.batch_size_per_rank) for m in graph.modules)
    if args.timings:
        workload = _recorded_timing(args, batch).onto(_workload(args, batch, None))
    else:
        workload = _workload(args, batch, max(1, round(inputs.cores_per_rank)))
    latency_ms = (args.step_latency_us / 1e3 if args.step_latency_us is not None
                  else measure_step_latency_here(graph.world_size))
    profile = fit_profile(args.run, workload, args.name, latency_ms)
    if args.timings:
        profile.sources.append(f"the workload timed as recorded in {args.timings}")
    profile.sources.append(f"a collective's latency in a step: {latency_ms * 1e3:.0f} us, "
                           + ("as given (--step-latency-us)" if args.step_latency_us is not None else
                              f"measured by fit-profile on {graph.world_size} processes"))
    profile.save(args.out)
    print(f"wrote {args.out}: dense timed here ({profile.device.dense_tflops * 1e3:.1f} GFLOP/s), copy "
          f"{profile.device.memory_gb_per_s:.2f} GB/s, all-to-all alpha {profile.intra_node.alpha_us:.0f} us + "
          f"{profile.intra_node.gb_per_s:.2f} GB/s (alpha: a collective in a step; after a barrier "
          f"{profile.measured['probed_alpha_us']:.0f} us), backend CPU {profile.backend_cpu_ms_per_mb:.3f} ms/MB",
          file=out)
    return 0


def main(argv: Optional[list[str]] = None, out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fit-profile"]:
        return fit_main(argv[1:], out)
    from lightning_sparselift.simulate import report
    from lightning_sparselift.simulate.simulator import simulate_world, workload_threads

    parser = _parser()
    args = parser.parse_args(argv)
    try:
        profile = HardwareProfile.load(args.profile)
    except ValueError as error:
        parser.error(str(error))
    if args.explain is not None and args.explain not in args.ranks:
        parser.error(f"--explain {args.explain}: not one of --ranks {args.ranks}")
    if args.global_batch is not None:
        uneven = [n for n in args.ranks if args.global_batch % n]
        if uneven:
            parser.error(f"--global-batch {args.global_batch} does not split evenly over {uneven} ranks")
    batches = {n: args.global_batch // n if args.global_batch is not None else args.batch_per_rank or
               _default_batch(args) for n in args.ranks}
    # (counted once at the first batch; FLOPs and ids scale with the batch)
    workload = _workload(args, next(iter(batches.values())), workload_threads(profile))
    names = args.optimizations.split(",") if args.optimizations else None
    rows = [simulate_world(workload, n, batches[n], profile, names, args.numerics) for n in args.ranks]
    print(report.table(rows, profile), file=out)
    print("\nhow the plan changes with the world size:", file=out)
    for line in report.changes(rows):
        print(f"  {line}", file=out)
    if args.explain is not None:
        print("\n" + report.explain(next(r for r in rows if r.world == args.explain)), file=out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.summary(rows, profile, {"source": workload.source}), indent=1) + "\n")
        print(f"\nwrote {args.json}", file=out)
    if args.plot:
        print(f"wrote {report.plot(rows, profile, args.plot)}", file=out)
    return 0
