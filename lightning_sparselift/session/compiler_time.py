"""What the compiler's phases took, and what they cost the run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class CompilerTime:
    """``overhead_s``: lift, planning, calibration and verification time of the phases finished;
    ``cost_s``: what they cost the run: the compiler's own work (lift with its kernel builds,
    planning) and the calibration and verification steps' excess over the installed plan (those
    steps trained; only their excess is lost)."""

    started: float = field(default_factory=time.perf_counter)
    overhead_s: float = 0.0
    cost_s: float = 0.0

    def add(self, overhead_s: float, cost_s: float) -> None:
        self.overhead_s += overhead_s
        self.cost_s += cost_s

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def share(self, seconds: float) -> float:
        """``seconds`` as a fraction of the time since the session began."""
        elapsed = self.elapsed_s()
        return seconds / elapsed if elapsed > 0 else 0.0

    @property
    def calibration_fraction(self) -> float:
        """Lift, planning, calibration and steady-state verification time as a fraction of the time
        since the session began (the phases finished so far)."""
        return self.share(self.overhead_s)

    @property
    def cost_fraction(self) -> float:
        """What the compiler cost the run as a fraction of the time since the session began."""
        return self.share(self.cost_s)

    def metrics(self) -> dict[str, float]:
        return {"sparselift/calibration_fraction": self.calibration_fraction,
                "sparselift/cost_fraction": self.cost_fraction}

    def describe(self, steps: int) -> str:
        return (f"{self.overhead_s:.2f} s ({self.calibration_fraction:.2%} of {self.elapsed_s():.1f} s, {steps} training "
                f"steps; the calibration steps trained), costing the run {self.cost_s:.2f} s ({self.cost_fraction:.2%}: "
                f"lift, planning and the trial steps' excess over the installed plan)")
