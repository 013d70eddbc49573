"""Where a short run's time goes beside TorchRec's (issue 41: time to benefit): one fit of a held-out
model (``held_out_models.py``) per executor, alternating, and for each the wall time of every
training step (from one step's end to the next: the session's work between steps included) by the
session's phase, the steps where the phase changes, and, on the ``sparselift`` fits, the session's own
work on rank 0's training thread by method (wall and thread CPU, summed over the fit).

    python benchmarks/session_overhead.py [--model two_tower] [--steps 300] [--fits 2]

The methods are timed by wrapping them for the run (a few microseconds a call).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as L

from held_out_models import fit
from lightning_sparselift.cost import priors
from lightning_sparselift.lightning import report, session_connector
from lightning_sparselift.plan.loop import PlanningLoop
from lightning_sparselift.session.driver import SparseLiftSession

TIMED: dict[str, list[float]] = {}  # method -> [calls, wall ms, thread CPU ms]


def _timed(name: str, f: Callable) -> Callable:
    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            entry = TIMED.setdefault(name, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += (time.perf_counter() - wall) * 1e3
            entry[2] += (time.thread_time() - cpu) * 1e3
    return timed


def _wrap() -> None:
    for name in ("begin_step", "end_step", "_lift", "_plan", "_admit_builds", "_finish"):
        setattr(SparseLiftSession, name, _timed(f"session.{name}", getattr(SparseLiftSession, name)))
    for name in ("feedback", "admit", "propose"):
        setattr(PlanningLoop, name, _timed(f"loop.{name}", getattr(PlanningLoop, name)))
    priors.measure_priors = _timed("measure_priors", priors.measure_priors)
    for name in ("log_metrics", "report_round", "report_metrics", "report_events"):
        setattr(session_connector, name, _timed(f"connector.{name}", getattr(report, name)))


class _Steps(L.Callback):
    """Rank 0's step intervals and phases, and the timed methods, written when training ends."""

    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        session = trainer.strategy.session
        self.phase = "torchrec" if session is None else session.phase

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        self.rows.append((self.phase, (now - self.last) * 1e3))
        self.last = now

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"rows": self.rows, "timed": TIMED}))


def _describe(executor: str, seconds: float, record: dict) -> None:
    rows = record["rows"]
    print(f"{executor}: {seconds:.2f} s over {len(rows)} steps")
    phases: dict[str, list[float]] = {}
    for phase, ms in rows:
        phases.setdefault(phase, []).append(ms)
    for phase, values in phases.items():
        print(f"  {phase:9s} {len(values):4d} steps, {sum(values):7.0f} ms, median {statistics.median(values):6.2f} ms")
    changes = [i for i in range(1, len(rows)) if rows[i][0] != rows[i - 1][0]]
    print("  first steps (ms): " + ", ".join(f"{ms:.0f}" for _, ms in rows[:4])
          + "".join(f"; {rows[i - 1][0]} -> {rows[i][0]}: {rows[i - 1][1]:.0f}, {rows[i][1]:.0f}" for i in changes))
    for name, (calls, wall, cpu) in sorted(record["timed"].items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:22s} {int(calls):4d} calls, wall {wall:7.1f} ms, thread CPU {cpu:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="two_tower")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fits", type=int, default=2, help="fits per executor (S T T S ...)")
    args = parser.parse_args()
    _wrap()
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder)
        for k in range(args.fits):
            for executor in (("sparselift", "torchrec") if k % 2 == 0 else ("torchrec", "sparselift")):
                TIMED.clear()
                summary = fit(args.model, executor, args.steps, cache, cache / "report.json",
                              callbacks=(_Steps(cache / "steps.json"),))
                _describe(executor, summary["seconds"], json.loads((cache / "steps.json").read_text()))


if __name__ == "__main__":
    main()
