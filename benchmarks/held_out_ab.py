"""Two checkouts of the project against each other on the held-out models (``held_out_models.py``):
per round one fit each of TorchRec's path, the other checkout's ``sparselift`` and this one's, in a
rotating order, each in a process of its own (a fit's wall time varies ~10% here, so the arms
alternate and the medians are compared, with TorchRec's fits as the drift's witness).

    python benchmarks/held_out_ab.py OTHER_CHECKOUT [--models two_tower,deepfm] [--rounds 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
FIT = ("import sys, json, tempfile; from pathlib import Path; from held_out_models import fit; "
       "d = tempfile.mkdtemp(); print('RESULT', json.dumps(fit(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(d), "
       "Path(d) / 'report.json')))")


def fit(tree: Path, model: str, executor: str, steps: int) -> dict:
    done = subprocess.run([sys.executable, "-c", FIT, model, executor, str(steps)], cwd=tree, capture_output=True,
                          text=True, env={"PYTHONPATH": f"{tree}:{tree}/benchmarks", "PATH": "/usr/bin:/bin"})
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not results:
        raise RuntimeError(f"a {executor} fit of {model} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(results[0][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the other checkout (e.g. a `git worktree` of the commit before)")
    parser.add_argument("--models", default="two_tower,deepfm")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="write every fit's report here")
    args = parser.parse_args()
    arms = [("torchrec", HERE, "torchrec"), ("other", args.other.resolve(), "sparselift"), ("this", HERE, "sparselift")]
    results = {}
    for model in args.models.split(","):
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
        for k in range(args.rounds):
            for name, tree, executor in arms[k % 3:] + arms[:k % 3]:
                runs[name].append(fit(tree, model, executor, args.steps))
        results[model] = runs
        median = {name: statistics.median(r["seconds"] for r in fits) for name, fits in runs.items()}
        print(f"{model}: torchrec / sparselift over {args.steps} steps: other {median['torchrec'] / median['other']:.3f}, "
              f"this {median['torchrec'] / median['this']:.3f} (median s: {', '.join(f'{n} {s:.2f}' for n, s in median.items())}); "
              f"calibration steps other {[r.get('calibration_steps') for r in runs['other']]}, "
              f"this {[r.get('calibration_steps') for r in runs['this']]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
