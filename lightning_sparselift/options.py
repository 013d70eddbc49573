"""What a SparseLift session runs with: one frozen, validated value that the strategy builds from
its arguments and the bench from the same arguments, so both build their sessions alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_sparselift.cost.decision import DecisionRule

DRIFT_CHECK_EVERY = 10  # steps between two drift checks (one small all-gather each)


def _all_passes() -> tuple[str, ...]:
    from lightning_sparselift.passes import PASSES

    return tuple(sorted(PASSES))


@dataclass(frozen=True)
class SessionOptions:
    """The compiler's options (``SparseLiftStrategy``'s arguments of the same names say what each
    does). ValueError at construction names the first one out of range."""

    capture_steps: int = 3  # captured steps on TorchRec's path (the session needs >= 1)
    optimizations: tuple[str, ...] = field(default_factory=_all_passes)
    calibrate: bool = True
    plan_path: Optional[str] = None
    decision_rule: DecisionRule = field(default_factory=DecisionRule)
    workspace_budget_bytes: Optional[int] = None
    reuse_buffers: bool = True
    numerics: str = "exact"
    verify_steps: int = 40
    replan_on_drift: bool = True
    drift_ratio: float = 5.0
    min_steps_between_replans: int = 500
    drift_check_every: int = DRIFT_CHECK_EVERY

    def __post_init__(self) -> None:
        from lightning_sparselift.passes import select_passes
        from lightning_sparselift.plan.verification import check_steady_options
        from lightning_sparselift.runtime.codegen.lookup import check_numerics

        select_passes(list(self.optimizations))  # raises on unknown names
        if int(self.capture_steps) < 0:
            raise ValueError(f"capture_steps must be >= 0, got {self.capture_steps}")
        if self.workspace_budget_bytes is not None and not self.workspace_budget_bytes >= 0:
            raise ValueError(f"the workspace budget must be >= 0 bytes per rank or None, got "
                             f"{self.workspace_budget_bytes!r}")
        check_numerics(self.numerics)
        check_steady_options(self.verify_steps, self.drift_ratio, self.min_steps_between_replans,
                             self.drift_check_every)
        object.__setattr__(self, "optimizations", tuple(sorted(self.optimizations)))

    @classmethod
    def from_arguments(cls, optimizations: Optional[list[str]], calibration_confidence: float,
                       calibration_max_pairs: int, calibration_max_steps: Optional[int], calibration_min_gain: float,
                       calibration_min_lookup_gain: float,
                       workspace_budget_mb: Optional[float], plan_path: Optional[str], **options: Any) -> "SessionOptions":
        """From the strategy's arguments of the same names (``options``: the fields named alike)."""
        if workspace_budget_mb is not None and not float(workspace_budget_mb) >= 0:
            raise ValueError(f"workspace_budget_mb must be >= 0 (MiB per rank) or None, got {workspace_budget_mb!r}")
        return cls(**({} if optimizations is None else {"optimizations": tuple(optimizations)}),
                   decision_rule=DecisionRule(float(calibration_confidence), int(calibration_max_pairs),
                                              float(calibration_min_gain), float(calibration_min_lookup_gain),
                                              # (a budget the user set holds whatever the run's length)
                                              **({} if calibration_max_steps is None else
                                                 {"max_steps": int(calibration_max_steps), "run_share": None})),
                   workspace_budget_bytes=None if workspace_budget_mb is None else int(float(workspace_budget_mb) * 2**20),
                   plan_path=str(plan_path) if plan_path is not None else None, **options)
