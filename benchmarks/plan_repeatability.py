"""Which plan each SparseLift system chose in repeated `sparselift bench` runs: per run and system,
the accepted candidates, every calibrated decision (estimate, pairs, verdict), the steady-state
check and the ratio over torchrec; then, per scenario, how many runs chose each plan.

    python benchmarks/plan_repeatability.py outputs/bench/*.json
"""

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

SYSTEMS = ("sparselift", "sparselift-lightning")


def short(candidate: str) -> str:
    return candidate.split("@")[0]


def main(paths: list[str]) -> None:
    chosen = defaultdict(Counter)
    print("| run | system | x torchrec (median [p25, p75]) | calibration steps | plan | decisions (estimate ms, pairs, verdict) "
          "| steady state vs identity (ms) |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        summary = json.loads(Path(path).read_text())
        scenario = summary["scenario"]["name"]
        for name in SYSTEMS:
            result = summary["systems"].get(name)
            if result is None:
                continue
            if result.get("status") != "ok":
                print(f"| {Path(path).stem} | {name} | failed | | | | |")
                continue
            plan = " + ".join(short(d["candidate"]) for d in result["plan_decisions"] if d["accepted"]) or "identity"
            chosen[scenario][plan] += 1
            decisions = "; ".join(
                f"{short(d['candidate']).split(':')[1]} {d['measured_ms']:+.2f} / {d['pairs']} / "
                f"{d['reason'].split(':')[0]}"
                for d in result["plan_decisions"] if d["feasible"] and d["measured_ms"] is not None)
            ratio = summary["ratios"].get(f"{name} / torchrec")
            ratio = f"{ratio['median']:.3f} [{ratio['p25']:.3f}, {ratio['p75']:.3f}]" if ratio else "-"
            check = result.get("verification") or {}
            measured = check.get("measured_ms")
            steady = f"{measured:+.2f} ({check.get('verdict')})" if measured is not None else "-"
            print(f"| {Path(path).stem} | {name} | {ratio} | {result['calibration_steps']} | {plan} | {decisions} "
                  f"| {steady} |")
    print()
    for scenario, plans in sorted(chosen.items()):
        print(f"{scenario}: " + ", ".join(f"{plan} in {n} of {sum(plans.values())}" for plan, n in plans.most_common()))


if __name__ == "__main__":
    main(sys.argv[1:])
