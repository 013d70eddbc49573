"""What the strategy tells the user about its SparseLift session: events as they happen, and each
planning round's result (the plan explained, its decisions as metrics, the plan file next to the
logs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_sparselift.plan import ExecutionPlan
    from lightning_sparselift.session import SparseLiftSession


def report_events(session: "SparseLiftSession") -> None:
    for event in session.events:
        rank_zero_info(f"SparseLift: {event}")
    session.events.clear()
    for warning in session.warnings:
        rank_zero_warn(warning, category=RuntimeWarning)
    session.warnings.clear()


def log_metrics(module: "pl.LightningModule", metrics: dict[str, float], prog_bar: bool = False) -> None:
    """To the Lightning logger from rank zero; nothing under ``Trainer(barebones=True)``, which
    turns logging off (and warns at every ``self.log``, which the user's model never called)."""
    if not module.trainer.barebones:
        module.log_dict(metrics, prog_bar=prog_bar, rank_zero_only=True)


def report_metrics(session: "SparseLiftSession", module: "pl.LightningModule") -> None:
    """The session's metrics not logged yet (steady-state checks, drift, the compiler's share of
    the run: ``sparselift/verify/...``, ``sparselift/drift/...``, ``sparselift/calibration_fraction``,
    ``sparselift/cost_fraction``) to the Lightning logger; after a steady-state check, the plan file
    next to the logs again."""
    if not session.metrics:
        return
    metrics, session.metrics = session.metrics, {}
    if metrics.get("sparselift/verify/rolled_back") and session.plan is not None:
        metrics.update(decision_metrics(session.plan))  # the candidates rolled back: no longer accepted
    log_metrics(module, metrics)
    if "sparselift/verify/verdict" in metrics and session.plan is not None:
        _save_next_to_logs(session, module)


def _save_next_to_logs(session: "SparseLiftSession", module: "pl.LightningModule") -> None:
    trainer = module.trainer
    log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
    if log_dir and trainer.is_global_zero:
        session.plan.save_as_cache(f"{log_dir}/sparselift_plan.json")


def report_round(session: "SparseLiftSession", module: "pl.LightningModule") -> None:
    """A round's result: the plan explained (rank zero), its decisions as ``sparselift/...``
    metrics to the Lightning logger and, with a logger that has a ``log_dir``, the plan to
    ``<log_dir>/sparselift_plan.json``. Called from a hook where Lightning allows logging."""
    if session.installed is None:
        rank_zero_warn(f"SparseLift could not lift the sparse path, continuing on TorchRec's "
                       f"(executor='torchrec'): {session.fallback_reason}")
        return
    plan = session.plan
    rank_zero_info("SparseLift " + session.explain())
    metrics = {"sparselift/lift_s": session.lift_seconds,
               "sparselift/collectives_per_step": float(len(plan.graph.collectives())),
               "sparselift/calibration_steps": float(plan.calibration_steps),
               "sparselift/calibration_s": plan.calibration_s,
               "sparselift/planning_s": plan.planning_s,
               "sparselift/plan_reused": float(session.plan_reused)}
    metrics.update(decision_metrics(plan))
    log_metrics(module, metrics)
    _save_next_to_logs(session, module)


def decision_metrics(plan: "ExecutionPlan") -> dict[str, float]:
    """Per decision ``sparselift/<pass>/<role>/<module>/...``: accepted, the measured increment,
    its interval and the pairs used."""
    metrics = {}
    for decision in plan.decisions:
        key = f"sparselift/{decision.candidate.replace(':', '/').replace('@', '/')}"
        metrics[f"{key}/accepted"] = float(decision.accepted)
        if decision.measured_ms is not None:
            metrics[f"{key}/measured_ms"] = decision.measured_ms
        interval = getattr(decision, "interval_ms", None)
        if interval and all(abs(x) != float("inf") for x in interval):
            metrics[f"{key}/low_ms"], metrics[f"{key}/high_ms"] = float(interval[0]), float(interval[1])
        if getattr(decision, "pairs", 0):
            metrics[f"{key}/pairs"] = float(decision.pairs)
    return metrics
