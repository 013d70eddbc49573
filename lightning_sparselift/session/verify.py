"""The verify phase: a calibrated plan that differs from the identity plan is measured against it on
a window of interleaved real training steps (:class:`~lightning_sparselift.plan.verification.SteadyStateCheck`);
slower beyond noise, the identity plan is installed instead (rolled back, with the numbers)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from statistics import median
from typing import TYPE_CHECKING, Any, Optional

from lightning_sparselift.cost.calibration import judge_pairs
from lightning_sparselift.cost.decision import DecisionRule
from lightning_sparselift.plan.types import ExecutionPlan
from lightning_sparselift.plan.verification import PlanVerification, SteadyStateCheck, settle_steps_for

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph


@dataclass
class VerificationResult:
    """What the window concluded: the check, the plan to keep installed (the identity plan's when
    rolled back), the phase's time and what it cost the run, and what to report."""

    verification: PlanVerification
    judged: bool  # False: stopped before the window ended
    plan: ExecutionPlan
    seconds: float
    cost_s: float
    event: str
    warning: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)


def _accepted_sum(plan: ExecutionPlan, field: str) -> Optional[float]:
    """The accepted decisions' ``field`` added up (None: any lacks it)."""
    values = [getattr(d, field) for d in plan.accepted]
    return sum(values) if values and None not in values else None


class PlanCheck:
    """The window in progress: which plan each step runs, the step times, and the verdict."""

    def __init__(self, plan: ExecutionPlan, identity: SparseGraph, steps: int, rule: DecisionRule,
                 check_group: Any) -> None:
        self.plan, self.identity, self.rule, self.check_group = plan, identity, rule, check_group
        self.check = SteadyStateCheck(steps, settle_steps_for(plan.graph))
        # what was expected of the plan: the step-time model's change, and its accepted candidates' measurements
        self.predicted_ms = plan.predicted_change_ms
        self.calibrated_ms = _accepted_sum(plan, "measured_ms")
        self.started = time.perf_counter()

    def announcement(self) -> str:
        return (f"verifying the plan against the identity plan on {self.check.planned} interleaved training steps "
                f"({self.check.measured_pairs} measured pairs, settle {self.check.settle_steps})")

    def next_graph(self) -> SparseGraph:
        return self.plan.graph if self.check.next_uses_candidate() else self.identity

    def record(self, step_ms: float) -> bool:
        """A step of the window ended; True when the window is complete."""
        self.check.record(step_ms)
        return self.check.done

    def stop(self, why: str) -> VerificationResult:
        """Stopped before the window ended: not judged, the plan stays."""
        check = self.check
        verification = PlanVerification(check.recorded, check.settle_steps, 0, 0, self.rule.confidence,
                                        self.predicted_ms, self.calibrated_ms, None, None, None, None, "incomplete",
                                        False, note=f"stopped: {why}")
        self.plan.verification = verification
        return VerificationResult(verification, False, self.plan, time.perf_counter() - self.started, 0.0,
                                  f"steady-state check stopped after {check.recorded} of {check.planned} steps ({why}); "
                                  f"the plan stays installed")

    def conclude(self) -> VerificationResult:
        """Judge the pairs (the same on every rank: the slowest rank's times), keep or roll back."""
        check, plan = self.check, self.plan
        measurement = judge_pairs(check.pairs(), self.check_group, self.rule, 1)
        e = measurement.estimate
        slowest = [[max(rank[i][0] for rank in measurement.observations_ms),
                    max(rank[i][1] for rank in measurement.observations_ms)]
                   for i in range(len(measurement.observations_ms[0]))]
        finite = e.increment_ms == e.increment_ms  # not NaN
        verification = PlanVerification(
            check.planned, check.settle_steps, e.pairs, e.outliers, self.rule.confidence, self.predicted_ms,
            self.calibrated_ms, e.increment_ms if finite else None, list(e.interval_ms), e.noise_ms,
            median(t0 for t0, _ in slowest) if slowest else None, e.verdict, e.verdict == "slower", slowest)
        plan.verification = verification
        summary = verification.describe()
        kept, warning = plan, None
        if verification.rolled_back:
            why = (f"rolled back by the steady-state check: the plan's step was {e.increment_ms:+.3f} ms "
                   f"[{e.interval_ms[0]:+.3f}, {e.interval_ms[1]:+.3f}] vs the identity plan")
            kept = dataclasses.replace(plan, graph=self.identity, decisions=[
                dataclasses.replace(d, accepted=False, reason=f"{why} (calibration: {d.reason})") if d.accepted else d
                for d in plan.decisions])
            warning = (f"SparseLift rolled back to the identity plan: the installed plan "
                       f"({', '.join(d.candidate for d in plan.accepted)}) was slower than the identity plan in steady "
                       f"state: {summary}")
        # half the window ran the plan not kept, each step off by the measured change
        cost_s = (check.planned / 2 * (e.increment_ms if verification.rolled_back else -e.increment_ms) / 1e3
                  if finite else 0.0)
        return VerificationResult(verification, True, kept, time.perf_counter() - self.started, cost_s, summary, warning,
                                  _metrics(verification))


def _metrics(verification: PlanVerification) -> dict[str, float]:
    m: dict[str, float] = {}
    for key, value in (("predicted_ms", verification.predicted_ms), ("calibrated_ms", verification.calibrated_ms),
                       ("measured_ms", verification.measured_ms), ("noise_ms", verification.noise_ms),
                       ("identity_step_ms", verification.identity_step_ms)):
        if value is not None:
            m[f"sparselift/verify/{key}"] = float(value)
    low, high = verification.interval_ms or [None, None]
    if low is not None and abs(low) != float("inf"):
        m["sparselift/verify/low_ms"], m["sparselift/verify/high_ms"] = float(low), float(high)
    m["sparselift/verify/pairs"] = float(verification.pairs)
    m["sparselift/verify/verdict"] = {"faster": -1.0, "undecided": 0.0, "slower": 1.0}[verification.verdict]
    m["sparselift/verify/rolled_back"] = float(verification.rolled_back)
    return m
