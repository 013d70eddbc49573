"""The simulator's error table on this machine (issue 44, item 5): the recorded ``sparselift bench``
runs (``tests/fixtures/step_model``, or ``--runs DIR``) simulated on a profile of this machine
(default: the shipped ``cpu-2core-measured``, fitted on one of them), beside what they measured.

    .venv/bin/python benchmarks/simulate_validation.py [--runs DIR] [--profile P] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning_sparselift.bench.model_error import RecordedRun
from lightning_sparselift.simulate.profile import HardwareProfile
from lightning_sparselift.simulate.validation import markdown, validate

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=ROOT / "tests" / "fixtures" / "step_model")
    p.add_argument("--profile", default="cpu-2core-measured")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    runs = [(f.name, RecordedRun.from_dict(json.loads(f.read_text()))) for f in sorted(args.runs.glob("*.json"))]
    profile = HardwareProfile.load(args.profile)
    text = markdown(validate(runs, profile), profile)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
