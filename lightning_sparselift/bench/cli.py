"""``sparselift bench``: systems side by side in one run (see ``runner``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from lightning_sparselift.bench import scenarios
from lightning_sparselift.bench.systems import ALL_SYSTEMS


def _writable(path: Optional[str]) -> Optional[Path]:
    if path is None:
        return None
    p = Path(path)
    if not p.parent.is_dir():
        raise SystemExit(f"error: cannot write {p}: folder {p.parent} does not exist")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise SystemExit(f"error: cannot write {p}: {e.strerror}")
    if not existed:
        p.unlink()
    return p


def main(argv: Optional[list[str]] = None) -> None:
    from lightning_sparselift.bench.parity import DEFAULT_SYSTEMS as PARITY_DEFAULT
    from lightning_sparselift.bench.parity import check_systems as check_parity_systems
    from lightning_sparselift.bench.runner import ABLATION_SYSTEMS, DEFAULT_SYSTEMS, BenchConfig, default_systems

    parser = argparse.ArgumentParser(prog="sparselift bench", description=__doc__)
    parser.add_argument("--scenario", default="dlrm", help=f"one of {scenarios.available()} or a YAML path")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--systems", default=None, help=f"comma-separated, from {ALL_SYSTEMS}; default "
                                                         f"{','.join(DEFAULT_SYSTEMS)} (those that run the scenario)")
    parser.add_argument("--ablations", action="store_true",
                        help=f"also run SparseLift with each pass left out ({', '.join(ABLATION_SYSTEMS)})")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--breakdown-steps", type=int, default=4)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--pin-cores", action="store_true", help="pin rank r to CPU core r")
    parser.add_argument("--retain-freed-memory", action="store_true",
                        help="glibc keeps what a step frees for the next (no system pays page faults for memory "
                             "it freed; by default TorchRec's sparse-heavy step pays 2,000-3,600 in some runs)")
    parser.add_argument("--num-samples", type=int, default=None, help="training samples generated (default 64 batches per rank)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", default="", help="overrides of the scenario's optimizers, e.g. "
                                                          "dense=adagrad,dense_lr=0.02,embedding=rowwise_adagrad,"
                                                          "embedding_lr=0.05 (keys: dense, dense_lr, embedding, "
                                                          "embedding_lr)")
    parser.add_argument("--precision", default="32-true", help="the Trainer precision every system runs under: "
                                                                "32-true or bf16-mixed (the dense part autocast)")
    parser.add_argument("--parity", action="store_true", help="quality-parity mode: train torchrec and (--systems "
                                                              "after it) sparselift for one epoch from the same "
                                                              "weights and compare")
    parser.add_argument("--json", default=None, help="write the summary JSON here")
    parser.add_argument("--raw", action="store_true", help="keep the raw observations in the JSON: every timed and "
                                                           "warmup step, every calibration pair (by default it keeps "
                                                           "their medians, bounds and counts)")
    parser.add_argument("--markdown", default=None, help="write the Markdown table here")
    parser.add_argument("--plots", default=None, help="folder for the PNG plots")
    args = parser.parse_args(argv)
    if args.plots is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # (checked before the run, not after it)
            parser.error("--plots draws with matplotlib, which is not installed: "
                         "pip install 'lightning-sparselift[bench]'")
    json_path, md_path = _writable(args.json), _writable(args.markdown)
    try:
        chosen = ([s.strip() for s in args.systems.split(",") if s.strip()] if args.systems is not None
                  else list(PARITY_DEFAULT) if args.parity else default_systems(scenarios.load(args.scenario)))
        if args.parity:
            check_parity_systems(chosen)
        optimizer = scenarios.parse_optimizer(args.optimizer)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    config = BenchConfig(scenario=args.scenario, world_size=args.world_size,
                         systems=chosen + (ABLATION_SYSTEMS if args.ablations else []), rounds=args.rounds,
                         steps_per_round=args.steps_per_round, warmup_steps=args.warmup_steps,
                         breakdown_steps=args.breakdown_steps, threads_per_rank=args.threads_per_rank,
                         pin_cores=args.pin_cores, retain_freed_memory=args.retain_freed_memory,
                         num_samples=args.num_samples, seed=args.seed, precision=args.precision, optimizer=optimizer,
                         cache_dir=os.environ.get("SPARSELIFT_CACHE"))
    try:
        config.validate()
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    from lightning_sparselift.bench import report

    commit = report.source_commit()  # (the code as it starts, before anything can edit the checkout)
    if args.parity:
        from lightning_sparselift.bench import parity

        summary = parity.run(config)
        text = parity.markdown(summary)
    else:
        from lightning_sparselift.bench import runner

        summary = runner.run(config)
        text = report.markdown(summary)
        if args.plots:
            for path in report.plots(summary, Path(args.plots)):
                print(f"plot: {path}", file=sys.stderr)
    summary["commit"] = commit
    print(text)
    if json_path:
        report.write_json(summary, json_path, raw=args.raw)
    if md_path:
        md_path.write_text(text)


if __name__ == "__main__":
    main()
