"""Which plan each SparseLift system chose in repeated `sparselift bench` runs: per run and system,
the accepted candidates, every calibrated decision (estimate, pairs, verdict), the step change the
plan predicted, the calibration measured and the steady-state check measured, and the ratios over
torchrec and dlrm-baseline (where the run has it); then, per scenario, how many runs chose each plan.

    python benchmarks/plan_repeatability.py outputs/bench/*.json
"""

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

SYSTEMS = ("sparselift", "sparselift-lightning")


def short(candidate: str) -> str:
    return candidate.split("@")[0]


def ratio_text(summary: dict, key: str) -> str:
    ratio = summary["ratios"].get(key)
    return f"{ratio['median']:.3f} [{ratio['p25']:.3f}, {ratio['p75']:.3f}]" if ratio else "-"


def main(paths: list[str]) -> None:
    chosen = defaultdict(Counter)
    print("| run | system | x torchrec (median [p25, p75]) | x dlrm-baseline | calibration steps | plan "
          "| decisions (estimate ms, pairs, verdict) | step change predicted / calibrated (ms) "
          "| steady state vs identity (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        summary = json.loads(Path(path).read_text())
        scenario = summary["scenario"]["name"]
        for name in SYSTEMS:
            result = summary["systems"].get(name)
            if result is None:
                continue
            if result.get("status") != "ok":
                print(f"| {Path(path).stem} | {name} | failed | | | | | | |")
                continue
            plan = " + ".join(short(d["candidate"]) for d in result["plan_decisions"] if d["accepted"]) or "identity"
            chosen[scenario][plan] += 1
            decisions = "; ".join(
                f"{short(d['candidate']).split(':')[1]} {d['measured_ms']:+.2f} / {d['pairs']} / "
                f"{d['reason'].split(':')[0]}"
                for d in result["plan_decisions"] if d["feasible"] and d["measured_ms"] is not None)
            ratio, baseline = (ratio_text(summary, f"{name} / {other}") for other in ("torchrec", "dlrm-baseline"))
            change = " / ".join(f"{result[k]:+.2f}" if result.get(k) is not None else "-"
                                for k in ("predicted_change_ms", "measured_change_ms"))
            check = result.get("verification") or {}
            measured = check.get("measured_ms")
            steady = f"{measured:+.2f} ({check.get('verdict')})" if measured is not None else "-"
            print(f"| {Path(path).stem} | {name} | {ratio} | {baseline} | {result['calibration_steps']} | {plan} "
                  f"| {decisions} | {change} | {steady} |")
    print()
    for scenario, plans in sorted(chosen.items()):
        print(f"{scenario}: " + ", ".join(f"{plan} in {n} of {sum(plans.values())}" for plan, n in plans.most_common()))


if __name__ == "__main__":
    main(sys.argv[1:])
