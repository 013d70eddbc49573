"""The simulator's error tables on this machine (issue 44, item 5), on a profile of this machine
(default: the shipped ``cpu-2core-measured``, fitted on one recorded run):

- the recorded ``sparselift bench`` runs of ``tests/fixtures/step_model`` (2 ranks; identity and the
  checked plan), beside what they measured;
- with ``--measure``: TorchRec's step measured now by ``sparselift bench --systems torchrec`` per
  scenario, world size and batch (written to ``--grid``, default
  ``tests/fixtures/simulate/grid.json``), beside the simulator's identity plan; without it, the
  grid recorded there.

The dense steps the profile times here are recorded too (``--time``: timed now, written to
``--timings``, default ``tests/fixtures/simulate/dense_timings.json``; without it, the recorded ones),
so that the tables, kept as tests, do not move with the machine's load while the suite runs.
Nothing else may run while measuring or timing.

    .venv/bin/python benchmarks/simulate_validation.py [--measure] [--time] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import yaml

from lightning_sparselift.bench.model_error import RecordedRun
from lightning_sparselift.bench.scenarios import SCENARIO_DIR
from lightning_sparselift.simulate.profile import HardwareProfile
from lightning_sparselift.simulate.validation import (
    GridPoint, grid_markdown, markdown, predict_grid, timing_key, validate, workloads,
)
from lightning_sparselift.simulate.workload import DenseTiming

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("tiny", "dlrm", "dlrm-multihot", "sparse-heavy", "sequence")


def measure(scenario: str, world: int, batch: int, rounds: int) -> GridPoint:
    spec = yaml.safe_load((SCENARIO_DIR / f"{scenario}.yaml").read_text())
    spec["batch_size"] = batch
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{scenario}.yaml"
        path.write_text(yaml.safe_dump(spec))
        out = Path(folder) / "bench.json"
        subprocess.run([sys.executable, "-m", "lightning_sparselift.cli", "bench", "--scenario", str(path),
                        "--world-size", str(world), "--systems", "torchrec", "--rounds", str(rounds),
                        "--threads-per-rank", "1", "--json", str(out)], check=True, capture_output=True)
        step = json.loads(out.read_text())["systems"]["torchrec"]["step_ms"]["median"]
    print(f"{scenario} {world} ranks batch {batch}: {step:.2f} ms", flush=True)
    return GridPoint(scenario, world, batch, step)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=ROOT / "tests" / "fixtures" / "step_model")
    p.add_argument("--grid", type=Path, default=ROOT / "tests" / "fixtures" / "simulate" / "grid.json")
    p.add_argument("--measure", action="store_true")
    p.add_argument("--timings", type=Path, default=ROOT / "tests" / "fixtures" / "simulate" / "dense_timings.json")
    p.add_argument("--time", action="store_true")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--worlds", default="1,2")  # (bench refuses 3 ranks on 2 cores: oversubscribed)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", default="cpu-2core-measured")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    profile = HardwareProfile.load(args.profile)
    if args.measure:
        from lightning_sparselift.bench.scenarios import load

        points = [measure(s, w, b, args.rounds) for s in args.scenarios.split(",")
                  for b in (load(s).batch_size, load(s).batch_size // 2) for w in map(int, args.worlds.split(","))]
        args.grid.parent.mkdir(parents=True, exist_ok=True)
        args.grid.write_text(json.dumps([asdict(x) for x in points], indent=1) + "\n")
    points = [GridPoint(**{**x, "predicted_ms": None}) for x in json.loads(args.grid.read_text())]
    runs = [(f.name, RecordedRun.from_dict(json.loads(f.read_text()))) for f in sorted(args.runs.glob("*.json"))]
    if args.time:
        pairs = {(x.scenario, x.batch_per_rank) for x in points} | {
            (r.scenario, max(max(m["batch_size_per_rank"]) for m in r.identity["modules"])) for _, r in runs}
        timed = workloads(pairs, profile)
        args.timings.write_text(json.dumps({timing_key(*k): asdict(w.timed) for k, w in sorted(timed.items())},
                                           indent=1) + "\n")
    timings = {k: DenseTiming(**v) for k, v in json.loads(args.timings.read_text()).items()}
    text = (grid_markdown(predict_grid(points, profile, timings), profile) + "\n\n"
            + markdown(validate(runs, profile, timings), profile))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
