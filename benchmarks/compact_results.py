"""Rewrite `sparselift bench` JSON results in the compact form the bench writes by default
(`lightning_sparselift.bench.report.compact`): for files written with `--raw` or before the bench
compacted its output. Other JSON files (parity results) are left as they are.

    python benchmarks/compact_results.py                      # every result under benchmarks/results
    python benchmarks/compact_results.py outputs/bench/*.json
"""

import json
import sys
from pathlib import Path

from lightning_sparselift.bench.report import write_json

RESULTS = Path(__file__).resolve().parent / "results"


def main(paths: list[str]) -> None:
    for path in [Path(p) for p in paths] or sorted(RESULTS.rglob("*.json")):
        summary = json.loads(path.read_text())
        if summary.get("schema") != "sparselift-bench/1":
            continue
        before = path.stat().st_size
        write_json(summary, path)
        print(f"{path}: {before:,} -> {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
