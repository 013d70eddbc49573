"""Run-to-run spread of `sparselift bench` results: per scenario and system, the median
samples/s of each run and the speedups over torchrec, with their min-max spread.

    python benchmarks/spread.py outputs/bench
"""

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(folder: str) -> None:
    runs = defaultdict(list)
    for path in sorted(Path(folder).glob("*_run*.json")):
        summary = json.loads(path.read_text())
        if summary.get("schema") == "sparselift-bench/1":
            runs[summary["scenario"]["name"]].append(summary)
    for scenario, summaries in sorted(runs.items()):
        print(f"### {scenario}: {len(summaries)} runs\n")
        print("| system | samples/s per run | speedup over torchrec per run | spread of speedup |")
        print("|---|---|---|---|")
        for name in summaries[0]["systems"]:
            rates, ratios = [], []
            for s in summaries:
                r = s["systems"].get(name, {})
                if r.get("status") == "ok":
                    rates.append(f"{r['samples_per_s']['median']:,.0f}")
                    q = s["ratios"].get(f"{name} / torchrec")
                    ratios.append(1.0 if name == "torchrec" else (q["median"] if q else float("nan")))
                else:
                    rates.append("failed")
            spread = f"{max(ratios) - min(ratios):.3f}" if ratios else "-"
            print(f"| {name} | {', '.join(rates)} | {', '.join(f'{x:.3f}' for x in ratios)} | {spread} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "outputs/bench")
