"""What the session does when the drift watch finds the workload moved from what the installed plan
was decided on: plan again on the live statistics, or say why not (once per planning round)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from lightning_sparselift.options import SessionOptions
from lightning_sparselift.plan.verification import DriftEvent, Finding, finding_statistics


@dataclass(frozen=True)
class DriftResponse:
    """``replan``: a planning round starts on the live statistics; ``warn``: the user turned
    re-planning off; ``defer``: too soon after the last round (``min_steps_between_replans``)."""

    action: Literal["replan", "warn", "defer"]
    event: DriftEvent

    def metrics(self, replans: int) -> dict[str, float]:
        """For the logger when re-planning (``replans``: the rounds drift started, this one included)."""
        return {"sparselift/drift/replans": float(replans), "sparselift/drift/step": float(self.event.step),
                **{f"sparselift/drift/{k}": v for k, v in self.event.statistics.items()}}


def respond(findings: list[Finding], step: int, round_started: int, options: SessionOptions,
            noted: bool) -> Optional[DriftResponse]:
    """The response to ``findings`` at training step ``step`` (the planning round in force began at
    ``round_started``); None when only a drift already ``noted`` this round would be reported again."""
    texts, statistics = [f.text for f in findings], finding_statistics(findings)
    if not options.replan_on_drift:
        return None if noted else DriftResponse("warn", DriftEvent(step, texts, statistics,
                                                                   "not re-planned (replan_on_drift=False)"))
    allowed_at = round_started + options.min_steps_between_replans
    if step < allowed_at:
        return None if noted else DriftResponse("defer", DriftEvent(
            step, texts, statistics, f"re-planning deferred to step {allowed_at} (min_steps_between_replans)"))
    return DriftResponse("replan", DriftEvent(step, texts, statistics, "re-planned on the live statistics"))
