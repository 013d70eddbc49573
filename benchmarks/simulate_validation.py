"""The simulator's error tables on this machine (issue 44, item 5), on a profile of this machine
(default: the shipped ``cpu-2core-measured``, fitted on one recorded run):

- the recorded ``sparselift bench`` runs of ``tests/fixtures/simulate/runs`` (2 ranks; identity and
  the checked plan; recorded by ``benchmarks/step_model_error.py --runs 1 --out ...``), beside what
  they measured;
- with ``--measure``: TorchRec's step measured now by ``sparselift bench --systems torchrec`` per
  scenario, world size and batch (written to ``--grid``, default
  ``tests/fixtures/simulate/grid.json``), beside the simulator's identity plan; without it, the
  grid recorded there.

What the profile times here (the dense step and TorchRec's step at one rank) is recorded too, in
``--timings`` (default ``tests/fixtures/simulate/timings.json``): with ``--measure`` each workload
right before its grid points are measured, with ``--time`` the recorded runs' workloads; without
either, the recorded ones. So the tables, kept as tests, do not move with the machine's load while
the suite runs. With ``--measure``, a collective's latency in a step
(:func:`~lightning_sparselift.simulate.fit.measure_step_latency_here`, what ``fit-profile``
prices the links' alpha with) is measured beside each workload's timing on the grid's most ranks
and recorded in ``--latency`` (default ``tests/fixtures/simulate/step_latency.json``): the profile
fitted with the median (``fit-profile --step-latency-us``) sees the machine the grid saw. Nothing
else may run while measuring or timing.

    .venv/bin/python benchmarks/simulate_validation.py [--measure] [--time] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import asdict
from statistics import median
from pathlib import Path

import yaml

from lightning_sparselift.bench.model_error import RecordedRun
from lightning_sparselift.bench.scenarios import SCENARIO_DIR
from lightning_sparselift.simulate.fit import measure_step_latency_here
from lightning_sparselift.simulate.profile import HardwareProfile
from lightning_sparselift.simulate.validation import (
    GridPoint, Timed, grid_markdown, markdown, predict_grid, timing_key, validate, workloads,
)

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("tiny", "dlrm", "dlrm-multihot", "sparse-heavy", "sequence")


def measure(scenario: str, world: int, batch: int, rounds: int) -> float:
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
    return step


def timed_now(scenario: str, batch: int, profile: HardwareProfile) -> dict:
    """What ``profile`` times of the workload, timed now (as the timings fixture records it)."""
    (workload,) = workloads({(scenario, batch)}, profile).values()
    return asdict(Timed(workload.timed, workload.one_rank))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=ROOT / "tests" / "fixtures" / "simulate" / "runs")
    p.add_argument("--grid", type=Path, default=ROOT / "tests" / "fixtures" / "simulate" / "grid.json")
    p.add_argument("--measure", action="store_true")
    p.add_argument("--timings", type=Path, default=ROOT / "tests" / "fixtures" / "simulate" / "timings.json")
    p.add_argument("--time", action="store_true")
    p.add_argument("--latency", type=Path, default=ROOT / "tests" / "fixtures" / "simulate" / "step_latency.json")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--worlds", default="1,2")  # (bench refuses 3 ranks on 2 cores: oversubscribed)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--passes", type=int, default=3, help="measured passes over the grid (medians kept)")
    p.add_argument("--profile", default="cpu-2core-measured")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    profile = HardwareProfile.load(args.profile)
    recorded = json.loads(args.timings.read_text()) if args.timings.exists() else {}
    worlds = list(map(int, args.worlds.split(",")))
    timed: set[str] = set()  # the keys timed by this invocation
    if args.measure:
        from lightning_sparselift.bench.scenarios import load

        steps: dict[tuple[str, int, int], list[float]] = defaultdict(list)
        timings: dict[str, list[dict]] = defaultdict(list)
        latencies: list[float] = []
        for _ in range(args.passes):
            for s in args.scenarios.split(","):
                for b in (load(s).batch_size, load(s).batch_size // 2):
                    # timed right before its steps are measured: this machine's speed drifts by a
                    # fifth within minutes (other tenants), and the two sides must see the same machine
                    timings[timing_key(s, b)].append(timed_now(s, b, profile))
                    latencies.append(measure_step_latency_here(max(worlds)) * 1e3)
                    for w in worlds:
                        steps[(s, w, b)].append(measure(s, w, b, args.rounds))
        for key, values in timings.items():  # the median pass's, by TorchRec's step at one rank
            recorded[key] = sorted(values, key=lambda t: t["one_rank"]["step_ms"])[len(values) // 2]
            timed.add(key)
        args.latency.write_text(json.dumps({"step_latency_us": median(latencies), "measured_us": latencies},
                                           indent=1) + "\n")
        print(f"a collective's latency in a step: median {median(latencies):.0f} us of {len(latencies)} "
              f"({min(latencies):.0f}-{max(latencies):.0f})", flush=True)
        points = [GridPoint(s, w, b, median(v), passes=v) for (s, w, b), v in steps.items()]
        args.grid.parent.mkdir(parents=True, exist_ok=True)
        args.grid.write_text(json.dumps([asdict(x) for x in points], indent=1) + "\n")
    points = [GridPoint(**{**x, "predicted_ms": None}) for x in json.loads(args.grid.read_text())]
    runs = [(f.name, RecordedRun.from_dict(json.loads(f.read_text()))) for f in sorted(args.runs.glob("*.json"))]
    if args.time:  # the recorded runs' workloads the grid did not time just now
        pairs = {(r.scenario, max(max(m["batch_size_per_rank"]) for m in r.identity["modules"])) for _, r in runs}
        for pair in sorted(pairs):
            if timing_key(*pair) not in timed:
                recorded[timing_key(*pair)] = timed_now(*pair, profile)
    if args.measure or args.time:
        args.timings.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")
    timings = {k: Timed.from_dict(v) for k, v in recorded.items()}
    text = (grid_markdown(predict_grid(points, profile, timings), profile) + "\n\n"
            + markdown(validate(runs, profile, timings), profile))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
