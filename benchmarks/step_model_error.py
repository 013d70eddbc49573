"""The step-time model's predicted step change of the chosen plan against the measured one: runs
``sparselift bench --systems sparselift-identity,sparselift`` per scenario and run, records each as
a fixture of the error table's test (the model's inputs, the identity and plan graphs, the
steady-state check's and the bench's measurements) and prints the table.

    python benchmarks/step_model_error.py --runs 2 --out tests/fixtures/step_model
    python benchmarks/step_model_error.py --table tests/fixtures/step_model   # the table of recorded runs

Never run it beside anything else on this machine: the measured side is timed.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from lightning_sparselift.bench.model_error import RecordedRun, error_rows, markdown

SCENARIOS = ("dlrm", "sparse-heavy", "dlrm-multihot", "sequence")


def record(scenario: str, rounds: int, keep: Optional[Path]) -> RecordedRun:
    """One bench run of ``scenario``; its summary JSON kept at ``keep`` (the decisions, the checks)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = keep if keep is not None else Path(tmp) / "bench.json"
        subprocess.run([sys.executable, "-m", "lightning_sparselift.cli", "bench", "--scenario", scenario,
                        "--systems", "sparselift-identity,sparselift", "--rounds", str(rounds), "--json", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
        return RecordedRun.from_bench(json.loads(out.read_text()))


def recorded(folder: Path) -> list[RecordedRun]:
    return [RecordedRun.from_dict(json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12, help="the bench's rounds per run")
    parser.add_argument("--out", type=Path, help="folder for the recorded runs")
    parser.add_argument("--bench-json", type=Path, help="folder for each run's bench summary")
    parser.add_argument("--table", type=Path, help="print the table of the runs recorded in this folder")
    args = parser.parse_args()
    if args.table is not None:
        print(markdown(error_rows(recorded(args.table))))
        return
    runs = []
    for n in range(1, args.runs + 1):
        for scenario in args.scenarios.split(","):
            keep = None
            if args.bench_json is not None:
                args.bench_json.mkdir(parents=True, exist_ok=True)
                keep = args.bench_json / f"{scenario}_run{n}.json"
            run = record(scenario, args.rounds, keep)
            runs.append(run)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{scenario}_run{n}.json").write_text(json.dumps(run.to_dict(), indent=1) + "\n")
            print(markdown(error_rows([run])).splitlines()[-3], flush=True)
    print(markdown(error_rows(runs)))


if __name__ == "__main__":
    main()
