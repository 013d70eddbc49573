"""A session explained: the calibration in progress, or the installed plan, then what happened to it in steady state (its
steady-state checks, rollbacks, workload drift and re-planning), what the compiler cost so far,
and the training steps a lifted module ran on TorchRec's path."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_sparselift.session.driver import SparseLiftSession


def explain(session: SparseLiftSession) -> str:
    s = session
    if s.loop is not None:  # (the plan is the round's once it ends)
        return "\n".join(["SparseLift session calibrating (no plan installed yet)", *s.loop.describe()])
    if s.plan is None:
        return f"SparseLift session in its {s.phase} phase" + (
            f"; TorchRec's path kept: {s.fallback_reason}" if s.fallback_reason else "")
    lines = [s.plan.explain()]
    if s.trigger is not None:
        lines.append(f"planned because of the workload drift at step {s.trigger.step} ({s.trigger.action})"
                     if s.trigger in s.drift_events else f"planned because of {s.trigger.describe()}")
    lines += [f"verification {i + 1}: {v.describe()}" for i, v in enumerate(s.verifications)]
    lines += [f"drift: {e.describe()}" for e in s.drift_events]
    lines.append(f"compiler time so far: {s.time.describe(s.steps)}; {s.rollbacks} rollback(s), {s.replans} "
                 f"re-plan(s) on drift")
    if s.torchrec_path_steps:
        lines.append(f"{s.torchrec_path_steps} training step(s) ran TorchRec's path in a lifted module (the ranks' "
                     f"batch sizes differed)")
    return "\n".join(lines)
