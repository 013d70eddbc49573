#!/usr/bin/env bash
# The four benchmark scenarios on 2 CPU processes, each run RUNS times (default 3), into
# outputs/bench/: <scenario>_run<N>.{json,md,log} and plots_run<N>/.
# Usage: benchmarks/run_all.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
mkdir -p outputs/bench
for run in $(seq 1 "$runs"); do
  for scenario in dlrm dlrm-multihot sparse-heavy sequence; do
    .venv/bin/sparselift bench --scenario "$scenario" --world-size 2 \
      --json "outputs/bench/${scenario}_run${run}.json" --markdown "outputs/bench/${scenario}_run${run}.md" \
      --plots "outputs/bench/plots_run${run}" > "outputs/bench/${scenario}_run${run}.log" 2>&1
    echo "${scenario} run ${run}: done"
  done
done
.venv/bin/python benchmarks/spread.py outputs/bench
