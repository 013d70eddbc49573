"""The execution plan: what runs (the lifted graph after the accepted passes), why (every
candidate with its feasibility, prediction, measurements and decision), and for what (a
fingerprint of the model structure, sharding plan, world size, backend and library versions).
Plans are JSON: loading one never unpickles anything, and every field is checked against its type."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from lightning_sparselift.cost.step_record import StepModelRecord
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.plan.verification import DriftEvent, PlanVerification
from lightning_sparselift.typed_json import decode, json_type

# 2: module schedules replace pass flags and layout notes; 3: the step-time model replaces the priors
PLAN_SCHEMA = "sparselift-plan/3"


class PlanFileError(ValueError):
    """A plan file that cannot be used (unreadable, other schema, or made for another setup)."""


@dataclass
class PlanFingerprint:
    graph: str  # the lifted graph before any pass: model structure, layouts, collectives
    sharding_plan: str  # hash of TorchRec's ShardingPlan (tables, types, shards, ranks)
    world_size: int
    backend: str
    versions: dict[str, str]
    optimizations: list[str]

    @staticmethod
    def hash(data: Any) -> str:
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def differences(self, other: "PlanFingerprint") -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [f"{key}: plan has {mine[key]!r}, this run has {theirs[key]!r}" for key in mine if mine[key] != theirs[key]]


# how a candidate's reason begins when the loop rejected it without measuring (plan/loop.py)
FUTILE_BEFORE_MEASURING = "futile before measuring"


@dataclass
class Decision:
    candidate: str  # "<pass>:<name>"
    pass_name: str
    module: str
    role: str
    feasible: bool
    reasons: list[str]
    predicted_ms: Optional[float]
    observations_ms: Optional[list[list[list[float]]]]  # per rank, per measured pair: [F(T0), F(T1)]
    measured_ms: Optional[float]  # the estimated increment (Hodges-Lehmann, of the slowest rank's pairs)
    accepted: bool
    reason: str
    interval_ms: Optional[list[float]] = None  # the estimate's confidence interval
    confidence: Optional[float] = None
    noise_ms: Optional[float] = None  # the robust standard deviation of the incumbent's steps
    pairs: int = 0  # measured pairs used
    outliers: int = 0  # pairs left out as outliers

    @property
    def decided(self) -> bool:
        """Whether calibration reached a verdict on it: measured, or futile before measuring (not
        infeasible, accepted without calibration, nor left undecided by the budget or the run's end)."""
        return self.measured_ms is not None or self.reason.startswith(FUTILE_BEFORE_MEASURING)


@dataclass
class KernelBuild:
    """One rank's generated lookup kernel for one sharding group (or a module's consumer layout
    or input kernel), built on a thread of its own: from the lift on, or (its tables in buckets)
    once the group's one-bucket kernel was there; a saved plan's kernels in buckets, when it is
    installed."""

    module: str
    group: int  # or a module-wide kernel's: ir.schedule.OUTPUT_KERNEL_GROUP, INPUT_KERNEL_GROUP
    rank: int
    note: str  # "" when built, else why there is none
    seconds: float  # compile time (a cache hit: the load)
    cached: bool  # found in the kernel cache: nothing compiled
    buckets: int = 1  # its tables' concurrent buckets (subgraph parallelism)
    tables: list[list[str]] = field(default_factory=list)  # those buckets' tables (buckets > 1)


@dataclass
class ExecutionPlan:
    fingerprint: PlanFingerprint
    graph: SparseGraph
    decisions: list[Decision] = field(default_factory=list)
    step_model: Optional[StepModelRecord] = None  # the model's inputs and predictions (None: not calibrated)
    calibration_steps: int = 0
    calibration_s: float = 0.0
    # what trying the candidates cost: the calibration steps' time beyond as many steps of the
    # installed plan (its median step among them); those steps trained, so only this is lost
    calibration_excess_s: Optional[float] = None
    planning_s: float = 0.0
    verification: Optional[PlanVerification] = None  # the steady-state check against the identity plan
    trigger: Optional[DriftEvent] = None  # why this plan's round ran (None: the run's first round)
    kernel_builds: list[KernelBuild] = field(default_factory=list)  # generated kernels this run built or loaded
    schema: str = PLAN_SCHEMA

    @property
    def accepted(self) -> list[Decision]:
        return [d for d in self.decisions if d.accepted]

    @property
    def predicted_change_ms(self) -> Optional[float]:
        """The step-time model's step change from the identity plan to this one (its accepted
        candidates together); None without a model."""
        return self.step_model.change_ms if self.step_model is not None else None

    @property
    def measured_change_ms(self) -> float:
        return sum(d.measured_ms or 0.0 for d in self.accepted)

    # ---------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "ExecutionPlan":
        """The plan ``data`` (parsed JSON) describes; :class:`PlanFileError` naming the first field of the
        wrong type (or a missing or unknown key)."""
        if not isinstance(data, dict) or data.get("schema") != PLAN_SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else None
            if isinstance(found, str) and found.startswith("sparselift-plan/"):
                raise PlanFileError(f"the plan has schema {found}, written by another version of lightning_sparselift; "
                                    f"this version reads {PLAN_SCHEMA}")
            found = f"schema {found!r}" if isinstance(data, dict) else f"a JSON {json_type(data)}"
            raise PlanFileError(f"not a {PLAN_SCHEMA} plan ({found})")
        try:
            plan = decode(cls, data)
        except ValueError as error:
            raise PlanFileError(f"malformed plan: {error}") from error
        return plan

    def save(self, path: Union[str, Path]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True))
            tmp.replace(path)
        finally:  # gone after the replace; after a failed one, no half-written file stays behind
            tmp.unlink(missing_ok=True)

    def save_as_cache(self, path: Union[str, Path]) -> Optional[OSError]:
        """:meth:`save`, for a file that is only a cache: a failed write warns (naming the path
        and the error) and is returned instead of stopping training."""
        try:
            self.save(path)
        except OSError as error:
            warnings.warn(f"SparseLift could not save the execution plan to {path} ({error}); training continues "
                          f"with the plan installed", RuntimeWarning)
            return error
        return None

    @classmethod
    def load(cls, path: Union[str, Path]) -> "ExecutionPlan":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        # RecursionError: JSON nested deeper than the parser goes
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise PlanFileError(f"cannot read plan {path} as UTF-8 JSON: {error}") from error
        return cls.from_dict(data)

    def check(self, fingerprint: PlanFingerprint) -> None:
        """Raise :class:`PlanFileError` listing what differs when this plan was made for another setup."""
        differences = self.fingerprint.differences(fingerprint)
        if differences:
            raise PlanFileError("the plan was made for a different setup: " + "; ".join(differences))

    # ---------------------------------------------------------------- for humans
    def explain(self) -> str:
        lines = [f"ExecutionPlan ({self.schema}) for graph {self.fingerprint.graph}, sharding plan "
                 f"{self.fingerprint.sharding_plan}, {self.fingerprint.world_size} rank(s) over "
                 f"{self.fingerprint.backend}; optimizations {self.fingerprint.optimizations or 'none (identity plan)'}"]
        if self.step_model is not None:
            lines += self.step_model.explain()
        for when, built in (("from the lift on", [b for b in self.kernel_builds if not b.note and b.buckets == 1]),
                            ("in buckets",
                             [b for b in self.kernel_builds if not b.note and b.buckets > 1])):
            if not built:
                continue
            compiled = [b for b in built if not b.cached]
            lines.append(f"generated kernels: {len(built)} built {when}, {len(built) - len(compiled)} of them "
                         f"from the cache (nothing compiled)" + (f", {len(compiled)} compiled in "
                                                                 f"{max(b.seconds for b in compiled):.2f} s at most"
                                                                 if compiled else ""))
        for d in self.decisions:
            verdict = "ACCEPT" if d.accepted else ("reject" if d.feasible else "infeasible")
            predicted = f"predicted {d.predicted_ms:+.3f} ms" if d.predicted_ms is not None else "no prediction"
            measured = f", measured {d.measured_ms:+.3f} ms" if d.measured_ms is not None else ""
            lines.append(f"  {verdict:<10s} {d.candidate}: {predicted}{measured}; {d.reason}")
            if d.observations_ms:
                per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{t1 - t0:+.2f}" for t0, t1 in obs)
                                     for r, obs in enumerate(d.observations_ms))
                lines.append(f"             increments T1-T0 (ms) {per_rank}")
        excess = (f" ({self.calibration_excess_s:+.2f} s beyond as many steps of this plan)"
                  if self.calibration_excess_s is not None else "")
        lines.append(f"calibration: {self.calibration_steps} training steps, {self.calibration_s:.2f} s{excess}; "
                     f"planning {self.planning_s:.3f} s; accepted change "
                     + (f"predicted {self.predicted_change_ms:+.3f} ms (the model, all together), "
                        if self.predicted_change_ms is not None else "")
                     + f"calibrated {self.measured_change_ms:+.3f} ms per step (their increments added up)")
        if self.trigger is not None:
            lines.append(f"planned because of {self.trigger.describe()}")
        if self.verification is not None:
            lines.append(f"steady state: {self.verification.describe()}")
        lines.append(f"collectives per step: {len(self.graph.collectives())}")
        lines += [f"  {p}" for p in self.graph.provenance]
        return "\n".join(lines)
