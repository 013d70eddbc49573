"""The plan file (``plan_path``) as a cache: a plan saved for the same setup (model, sharding plan,
world size, backend, versions, passes) is reused when every rank can use it, i.e. its graph is what
its accepted candidates give on this run's lift, and the workload it was decided on has not
drifted from this run's captured one. Each rank reads the file into a typed outcome; the ranks
agree from all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

from lightning_sparselift._version import __version__
from lightning_sparselift.plan.planner import Planner
from lightning_sparselift.plan.types import ExecutionPlan, PlanFileError, PlanFingerprint
from lightning_sparselift.plan.verification import DriftEvent, Finding, drift_findings, finding_statistics, workload_of
from lightning_sparselift.session.ranks import gather
from lightning_sparselift.sharding import plan_summary

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph
    from lightning_sparselift.passes.base import OptimizationPass


def fingerprint(graph: SparseGraph, sharding_plan: Any, world: int, optimizations: tuple[str, ...]) -> PlanFingerprint:
    """What a saved plan must have been made for to be reused on ``graph``."""
    return PlanFingerprint(graph=graph.fingerprint(), sharding_plan=PlanFingerprint.hash(plan_summary(sharding_plan)),
                           world_size=world, backend=graph.backend,
                           versions={**graph.versions, "lightning_sparselift": __version__},
                           optimizations=list(optimizations))


@dataclass(frozen=True)
class PlanFileOutcome:
    """One rank's reading of the plan file (all-gathered): ``usable`` (``detail``: the rebuilt
    graph's fingerprint), ``missing``, ``unusable`` (``detail``: why) or ``drifted`` (``detail``:
    the drift findings)."""

    kind: Literal["usable", "missing", "unusable", "drifted"]
    detail: str = ""

    def text(self) -> str:
        return {"usable": self.detail, "missing": "missing", "unusable": f"error: {self.detail}",
                "drifted": f"drift: {self.detail}"}[self.kind]


@dataclass
class PlanFileReading:
    """One rank's reading and what it found: the plan rebuilt on this run's graph, the file's own
    graph (the statistics the plan was decided on) and the drift findings against this run's."""

    outcome: PlanFileOutcome
    plan: Optional[ExecutionPlan] = None
    decided_on: Optional[SparseGraph] = None
    findings: list[Finding] = field(default_factory=list)


def read(path: Optional[str], expected: PlanFingerprint, identity: SparseGraph, passes: list[OptimizationPass],
         drift_ratio: float) -> PlanFileReading:
    """The plan at ``path`` checked against ``expected`` and rebuilt from ``identity`` (this run's
    lift): the file's own graph is only compared, never run. Any failure is an outcome, not an
    error: the file is a cache, and every rank must reach the agreement."""
    if not path or not Path(path).exists():
        return PlanFileReading(PlanFileOutcome("missing"))
    try:
        plan = ExecutionPlan.load(path)
        plan.check(expected)
        decided_on = plan.graph
        plan.graph = Planner(passes, None, calibrate=False).rebuild(plan, identity)
        findings = drift_findings(workload_of(decided_on), workload_of(identity), drift_ratio)
    except PlanFileError as error:
        return PlanFileReading(PlanFileOutcome("unusable", str(error)))
    except Exception as error:  # still only a cache miss
        return PlanFileReading(PlanFileOutcome("unusable", f"{type(error).__name__}: {error}"))
    if findings:
        return PlanFileReading(PlanFileOutcome("drifted", "; ".join(f.text for f in findings)), findings=findings)
    return PlanFileReading(PlanFileOutcome("usable", plan.graph.fingerprint()), plan, decided_on)


@dataclass(frozen=True)
class PlanFileAgreement:
    """What every rank does with the plan file: reuse it, plan because every rank found the same
    drift (``drift``: its findings), or plan for ``reason`` (None: there was no file anywhere)."""

    reuse: bool
    drift: Optional[list[str]] = None
    reason: Optional[str] = None


def agree(outcomes: list[PlanFileOutcome]) -> PlanFileAgreement:
    if all(o.kind == "missing" for o in outcomes):
        return PlanFileAgreement(False)
    if len(set(outcomes)) == 1 and outcomes[0].kind == "drifted":
        return PlanFileAgreement(False, drift=outcomes[0].detail.split("; "))
    if len(set(outcomes)) == 1 and outcomes[0].kind == "usable":
        return PlanFileAgreement(True)
    reasons = sorted({o.text() for o in outcomes if o.kind in ("unusable", "missing")})
    drifted = sorted({o.detail for o in outcomes if o.kind == "drifted"})
    if drifted:
        reasons.append("workload drift on some ranks: " + "; ".join(drifted))
    return PlanFileAgreement(False, reason="; ".join(reasons) or "ranks read different plans")


@dataclass
class Reuse:
    """The plan file's fate on every rank: ``plan`` (rebuilt on this run's graph) and the graph it
    was decided on when reused; else the drift that stopped it (``drift``) and what to report."""

    plan: Optional[ExecutionPlan] = None
    decided_on: Optional[SparseGraph] = None
    drift: Optional[DriftEvent] = None
    event: Optional[str] = None


def reuse(path: Optional[str], expected: PlanFingerprint, identity: SparseGraph, passes: list[OptimizationPass],
          drift_ratio: float, group: Any, step: int) -> Reuse:
    """Read the plan file on every rank (call it on every rank at the same step) and agree."""
    reading = read(path, expected, identity, passes, drift_ratio)
    agreement = agree(gather(reading.outcome, group))
    if agreement.reuse:
        return Reuse(reading.plan, reading.decided_on)
    if agreement.drift is not None:
        return Reuse(drift=DriftEvent(step, agreement.drift, finding_statistics(reading.findings),
                                      f"the plan at {path} is not reused"),
                     event=f"not reusing the plan at {path}: it was decided on other workload statistics than this "
                           f"run's captured ones ({'; '.join(agreement.drift)}); planning again")
    if agreement.reason is not None:
        return Reuse(event=f"not reusing the plan at {path} ({agreement.reason}); planning again")
    return Reuse()
