"""What a SparseLift session runs with: one frozen, validated value that the strategy builds from
its arguments and the bench from the same arguments, so both build their sessions alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_sparselift.cost.decision import DecisionRule

DRIFT_CHECK_EVERY = 10  # steps between two drift checks (one small all-gather each)


def _all_passes() -> tuple[str, ...]:
    from lightning_sparselift.passes import PASSES

    return tuple(sorted(PASSES))


@dataclass(frozen=True)
class SessionOptions:
    """The compiler's options (``SparseLiftStrategy``'s arguments of the same names say what each
    does). ValueError at construction names the first one out of range."""

    warmup_batches: int = 3  # captured steps on TorchRec's path (the session needs >= 1)
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
        if int(self.warmup_batches) < 0:
            raise ValueError(f"warmup_batches must be >= 0, got {self.warmup_batches}")
        if self.workspace_budget_bytes is not None and not self.workspace_budget_bytes >= 0:
            raise ValueError(f"the workspace budget must be >= 0 bytes per rank or None, got "
                             f"{self.workspace_budget_bytes!r}")
        check_numerics(self.numerics)
        check_steady_options(self.verify_steps, self.drift_ratio, self.min_steps_between_replans,
                             self.drift_check_every)
        object.__setattr__(self, "optimizations", tuple(sorted(self.optimizations)))
