"""What ``sparselift simulate`` prints and writes: a table per world size, the JSON of every
prediction, a plot of the stages (as the bench's), and ``explain``-style text for one world size.
Everything in them is model output, labelled as such."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_sparselift.simulate.profile import HardwareProfile
from lightning_sparselift.simulate.simulator import WorldPrediction

SCHEMA = "sparselift-simulate/1"
_STAGES = ("sparse_forward", "other_forward", "sparse_backward", "other_backward", "host")


def table(rows: list[WorldPrediction], profile: HardwareProfile) -> str:
    lines = [f"predicted by the step-time model on profile {profile.name!r} (model output: nothing here ran)",
             "| ranks | batch/rank | placement | TorchRec / identity ms | plan ms | speedup | sparse fwd+bwd ms "
             "(identity -> plan) | plan |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        placement = ", ".join(f"{k} {v}" for k, v in sorted(r.placement.items()))
        plan = ", ".join(c.split("@")[0] for c in r.accepted) or "identity"
        lines.append(f"| {r.world} | {r.batch_per_rank} | {placement} | {r.identity.step:.3f} | {r.plan.step:.3f} | "
                     f"{r.speedup:.3f}x | {r.identity.sparse_forward + r.identity.sparse_backward:.3f} -> "
                     f"{r.plan.sparse_forward + r.plan.sparse_backward:.3f} | {plan} |")
    return "\n".join(lines)


def changes(rows: list[WorldPrediction]) -> list[str]:
    """How the chosen plan changes from one world size to the next."""
    out = []
    for a, b in zip(rows, rows[1:]):
        gained = sorted(set(b.accepted) - set(a.accepted))
        lost = sorted(set(a.accepted) - set(b.accepted))
        if gained or lost:
            out.append(f"{a.world} -> {b.world} ranks: " + "; ".join(
                [f"+ {c}" for c in gained] + [f"- {c}" for c in lost]))
    return out or ["the same plan at every world size"]


def explain(r: WorldPrediction) -> str:
    lines = [f"{r.world} ranks, {r.batch_per_rank} samples per rank (model output)",
             f"  identity plan (TorchRec's step): {r.identity_model.describe() if r.identity_model else '-'}",
             f"  chosen plan:                     {r.plan_model.describe() if r.plan_model else '-'}",
             "  stages ms (identity -> plan): " + ", ".join(
                 f"{s.replace('_', ' ')} {getattr(r.identity, s):.3f} -> {getattr(r.plan, s):.3f}" for s in _STAGES),
             "  decisions:"]
    lines += [f"    {d.candidate}: {d.reason}" for d in r.decisions]
    lines.append("  the identity plan's collectives (bytes per member, predicted ms):")
    lines += [f"    {c['id']} {c['op']}: {c['bytes_per_member']} B, {c['predicted_ms']:.3f} ms" for c in r.collectives]
    return "\n".join(lines)


def summary(rows: list[WorldPrediction], profile: HardwareProfile, source: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "note": "model output: predicted by the step-time model, nothing here ran",
            "profile": asdict(profile), "workload": source,
            "worlds": [{**asdict(r), "speedup": r.speedup, "identity_step_ms": r.identity.step,
                        "plan_step_ms": r.plan.step} for r in rows],
            "plan_changes": changes(rows)}


def plot(rows: list[WorldPrediction], profile: HardwareProfile, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, stacks = [], []
    for r in rows:
        for name, stages in (("TorchRec", r.identity), ("plan", r.plan)):
            labels.append(f"{r.world}\n{name}")
            stacks.append(stages)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(labels)), 3.8))
    bottom = [0.0] * len(stacks)
    for stage in _STAGES:
        values = [getattr(s, stage) for s in stacks]
        ax.bar(labels, values, bottom=bottom, label=stage.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(rows):
        ax.annotate(f"{r.speedup:.2f}x", (2 * i + 1, bottom[2 * i + 1]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("predicted ms per step")
    ax.set_xlabel("ranks")
    ax.set_title(f"predicted stages on {profile.name} (model output)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
