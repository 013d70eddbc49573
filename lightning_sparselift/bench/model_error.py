"""The step-time model's error table: for recorded runs (the model's inputs, the identity and plan
graphs, and what the run measured), the step change the model predicts from those inputs next to
the measured ones. ``benchmarks/step_model_error.py`` records runs from ``sparselift bench``;
``tests/unit/test_step_model_error.py`` keeps the table as a test on the recorded inputs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import median
from typing import Any, Optional

from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.cost.step_record import StepModelInputs
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.typed_json import decode


@dataclass
class RecordedRun:
    """One ``sparselift bench`` run of ``sparselift-identity`` beside ``sparselift``."""

    scenario: str
    commit: str
    inputs: StepModelInputs
    identity: dict[str, Any]  # the identity graph (SparseGraph.to_dict)
    plan: dict[str, Any]  # the chosen plan's graph
    accepted: list[str]
    # the steady-state check: the plan against the identity plan on interleaved steps (None: the
    # identity plan was chosen, nothing to check)
    verified_ms: Optional[float]
    verified_interval_ms: Optional[list[float]]
    # the bench's side by side: the median step of sparselift minus sparselift-identity's
    bench_ms: float

    @classmethod
    def from_bench(cls, summary: dict[str, Any]) -> "RecordedRun":
        """From a ``sparselift bench --systems sparselift-identity,sparselift --json`` summary."""
        plan, identity = summary["systems"]["sparselift"], summary["systems"]["sparselift-identity"]
        if plan.get("step_model") is None:
            raise ValueError("the sparselift system recorded no step-time model (not calibrated?)")
        check = plan.get("verification") or {}
        return cls(summary["scenario"]["name"], summary.get("commit", ""),
                   decode(StepModelInputs, plan["step_model"]["inputs"], "inputs"), plan["identity_graph"],
                   plan["plan_graph"], [d["candidate"] for d in plan["plan_decisions"] if d["accepted"]],
                   check.get("measured_ms"), check.get("interval_ms"),
                   plan["step_ms"]["median"] - identity["step_ms"]["median"])

    @classmethod
    def from_dict(cls, data: Any) -> "RecordedRun":
        return decode(cls, data, "run")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def predicted_ms(self) -> float:
        """The model's step change from the identity plan to the plan, from the recorded inputs."""
        identity = SparseGraph.from_dict(self.identity)
        return StepModel(self.inputs, identity).increment_ms(identity, SparseGraph.from_dict(self.plan))


@dataclass
class ErrorRow:
    scenario: str
    accepted: list[str]
    predicted_ms: float
    verified_ms: Optional[float]
    verified_interval_ms: Optional[list[float]]
    bench_ms: float

    @property
    def error(self) -> Optional[float]:
        """|predicted - verified| / |verified| (None: nothing was verified)."""
        if self.verified_ms is None or self.verified_ms == 0:
            return None
        return abs(self.predicted_ms - self.verified_ms) / abs(self.verified_ms)

    @property
    def inside(self) -> Optional[bool]:
        """Whether the prediction lies inside the check's confidence interval (None: no interval).
        The recorded checks' intervals are +-25% to +-170% of their estimates, so a relative error says
        as much about the check as about the model."""
        if self.verified_interval_ms is None:
            return None
        return self.verified_interval_ms[0] <= self.predicted_ms <= self.verified_interval_ms[1]


def error_rows(runs: list[RecordedRun]) -> list[ErrorRow]:
    return [ErrorRow(r.scenario, r.accepted, r.predicted_ms(), r.verified_ms, r.verified_interval_ms, r.bench_ms)
            for r in runs]


def median_error(rows: list[ErrorRow]) -> float:
    errors = [row.error for row in rows if row.error is not None]
    return median(errors) if errors else float("nan")


def markdown(rows: list[ErrorRow]) -> str:
    lines = ["| scenario | plan | predicted ms | steady-state check ms | its interval ms | error "
             "| bench side by side ms |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        plan = ", ".join(c.split("@")[0] for c in row.accepted) or "identity"
        verified = f"{row.verified_ms:+.2f}" if row.verified_ms is not None else "-"
        interval = ("-" if row.verified_interval_ms is None else
                    f"[{row.verified_interval_ms[0]:+.2f}, {row.verified_interval_ms[1]:+.2f}]")
        error = f"{row.error:.0%}" if row.error is not None else "-"
        lines.append(f"| {row.scenario} | {plan} | {row.predicted_ms:+.2f} | {verified} | {interval} | {error} "
                     f"| {row.bench_ms:+.2f} |")
    checked = [row.inside for row in rows if row.inside is not None]
    lines.append(f"\nmedian absolute error against the steady-state check: {median_error(rows):.0%}; "
                 f"predictions inside the check's interval: {sum(checked)} of {len(checked)}")
    return "\n".join(lines)
