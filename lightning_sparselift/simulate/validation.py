"""The simulator against what ran here: for recorded ``sparselift bench`` runs
(:class:`~lightning_sparselift.bench.model_error.RecordedRun`, ``tests/fixtures/step_model``), the
step the simulator predicts from a profile of this machine and the run's scenario, world size and
batch, beside the step the run measured: the identity plan's (TorchRec's path: the captured
steps) and, where the run checked its plan against the identity plan in steady state, the plan's
(captured step plus that check's change). The simulator chooses its own plan and placement; a row
says whether they are the run's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Optional

from lightning_sparselift.bench.model_error import RecordedRun
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.simulate.profile import HardwareProfile
from lightning_sparselift.simulate.simulator import simulate_world, workload_threads
from lightning_sparselift.simulate.one_rank import OneRankTiming
from lightning_sparselift.simulate.workload import DenseTiming, Workload, workload_from_scenario


@dataclass
class ValidationRow:
    scenario: str
    world: int
    batch_per_rank: int
    measured_identity_ms: float
    predicted_identity_ms: float
    measured_plan_ms: Optional[float]  # None: the run checked no plan
    predicted_plan_ms: float
    run_plan: list[str]
    simulated_plan: list[str]
    fitted_on: bool  # the profile was fitted on this run

    @property
    def identity_error(self) -> float:
        return abs(self.predicted_identity_ms - self.measured_identity_ms) / self.measured_identity_ms

    @property
    def plan_error(self) -> Optional[float]:
        if self.measured_plan_ms is None:
            return None
        return abs(self.predicted_plan_ms - self.measured_plan_ms) / self.measured_plan_ms


@dataclass
class Timed:
    """What a profile of this machine times of a workload: its dense step and TorchRec's step at
    one rank."""

    dense: DenseTiming
    one_rank: OneRankTiming

    @classmethod
    def from_dict(cls, data: dict) -> "Timed":
        return cls(DenseTiming(**data["dense"]), OneRankTiming(**data["one_rank"]))

    def onto(self, workload: Workload) -> Workload:
        """``workload`` with these timings (instead of timing it now)."""
        workload.timed, workload.one_rank = self.dense, self.one_rank
        return workload


Timings = dict[str, Timed]  # by timing_key(scenario, batch)


def read_timings(path: Path) -> Timings:
    """A timings file (``benchmarks/simulate_validation.py --measure | --time``)."""
    return {k: Timed.from_dict(v) for k, v in json.loads(path.read_text()).items()}


def timing_key(scenario: str, batch: int) -> str:
    return f"{scenario}@{batch}"


def workloads(pairs: set[tuple[str, int]], profile: HardwareProfile, timings: Optional[Timings] = None
              ) -> dict[tuple[str, int], Workload]:
    """The workload of each (scenario, batch): timed now, or as ``timings`` recorded (the tables
    kept as tests: a step timed while the suite runs varies by a third)."""
    out = {}
    for scenario, batch in sorted(pairs):
        recorded = (timings or {}).get(timing_key(scenario, batch))
        workload = workload_from_scenario(scenario, batch, None if recorded else workload_threads(profile))
        out[(scenario, batch)] = recorded.onto(workload) if recorded else workload
    return out


def validate(runs: list[tuple[str, RecordedRun]], profile: HardwareProfile, timings: Optional[Timings] = None
             ) -> list[ValidationRow]:
    """One row per run (named by its file), simulated on ``profile``."""
    rows = []
    fitted = (profile.measured or {}).get("run", "")
    graphs = [(name, run, SparseGraph.from_dict(run.identity)) for name, run in runs]
    batches = {name: max(max(m.batch_size_per_rank) for m in g.modules) for name, _, g in graphs}
    probed = workloads({(run.scenario, batches[name]) for name, run, _ in graphs}, profile, timings)
    for name, run, identity in graphs:
        batch = batches[name]
        result = simulate_world(probed[(run.scenario, batch)], identity.world_size, batch, profile)
        measured = max(run.inputs.timings.step_ms)
        rows.append(ValidationRow(run.scenario, identity.world_size, batch, measured, result.identity.step,
                                  measured + run.verified_ms if run.verified_ms is not None else None,
                                  result.plan.step, [_short(c) for c in run.accepted],
                                  [_short(c) for c in result.accepted], fitted.endswith(name)))
    return rows


def _short(candidate: str) -> str:
    return candidate.split("@")[0]


def median_error(rows: list[ValidationRow]) -> float:
    """Over the runs the profile was not fitted on: identity and checked plan steps together."""
    errors = [e for r in rows if not r.fitted_on for e in (r.identity_error, r.plan_error) if e is not None]
    return median(errors) if errors else float("nan")


def markdown(rows: list[ValidationRow], profile: HardwareProfile) -> str:
    lines = [f"simulated on profile {profile.name!r} ({profile.description}) beside what the runs measured",
             "| scenario | ranks | batch/rank | identity measured ms | predicted | error | plan measured ms | "
             "predicted | error | run's plan | simulator's plan |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plan = (f"{r.measured_plan_ms:.2f} | {r.predicted_plan_ms:.2f} | {r.plan_error:.0%}"
                if r.measured_plan_ms is not None else f"- | {r.predicted_plan_ms:.2f} | -")
        name = r.scenario + (" (fitted on)" if r.fitted_on else "")
        lines.append(f"| {name} | {r.world} | {r.batch_per_rank} | {r.measured_identity_ms:.2f} | "
                     f"{r.predicted_identity_ms:.2f} | {r.identity_error:.0%} | {plan} | "
                     f"{', '.join(r.run_plan) or 'identity'} | {', '.join(r.simulated_plan) or 'identity'} |")
    lines.append(f"\nmedian absolute error over the runs the profile was not fitted on: {median_error(rows):.0%}")
    return "\n".join(lines)


@dataclass
class GridPoint:
    """TorchRec's step measured by ``sparselift bench --systems torchrec`` at one world size and
    batch (median; one thread per rank, as the profile's cores per rank), and the simulator's
    identity plan there (TorchRec's schedule)."""

    scenario: str
    world: int
    batch_per_rank: int
    measured_ms: float  # the median over the passes
    predicted_ms: Optional[float] = None
    passes: list[float] = field(default_factory=list)  # each pass's median step

    @property
    def error(self) -> Optional[float]:
        if self.predicted_ms is None:
            return None
        return abs(self.predicted_ms - self.measured_ms) / self.measured_ms


def predict_grid(points: list[GridPoint], profile: HardwareProfile, timings: Optional[Timings] = None
                 ) -> list[GridPoint]:
    probed = workloads({(p.scenario, p.batch_per_rank) for p in points}, profile, timings)
    for p in points:
        p.predicted_ms = simulate_world(probed[(p.scenario, p.batch_per_rank)], p.world, p.batch_per_rank,
                                        profile).identity.step
    return points


def grid_markdown(points: list[GridPoint], profile: HardwareProfile) -> str:
    lines = [f"TorchRec's step measured (`sparselift bench --systems torchrec`, median) beside the simulator's "
             f"identity plan on {profile.name!r}",
             "| scenario | ranks | batch/rank | measured ms | predicted ms | error |", "|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p.scenario} | {p.world} | {p.batch_per_rank} | {p.measured_ms:.2f} | "
                     f"{p.predicted_ms:.2f} | {p.error:.0%} |" if p.predicted_ms is not None else
                     f"| {p.scenario} | {p.world} | {p.batch_per_rank} | {p.measured_ms:.2f} | - | - |")
    errors = sorted((p.error, p) for p in points if p.error is not None)
    if errors:
        worst = errors[-1][1]
        lines.append(f"\nmedian absolute error {median(e for e, _ in errors):.0%}; worst {errors[-1][0]:.0%} "
                     f"({worst.scenario}, {worst.world} ranks, batch {worst.batch_per_rank})")
    return "\n".join(lines)
