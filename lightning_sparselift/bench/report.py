"""The benchmark's outputs: JSON (schema ``sparselift-bench/1``), a Markdown table, PNG plots."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any, Optional

from lightning_sparselift.bench.measure import STAGES

REFERENCES = ("torchrec", "dlrm-baseline", "torchrec-base", "dense-only")

# the lines of ExecutionPlan.explain() that list a decision's calibration pairs, one number per pair
_PAIR_LINE = re.compile(r"^\s+increments T1-T0 \(ms\) ")


def compact(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` without its raw observations, which grow with the run's length: every timed step
    (``step_ms``, ``samples_per_s`` and ``round_median_ms`` condense them), every warmup step (kept as
    ``warmup: {steps, total_s}``) and every calibration pair of a decision and of the steady-state
    check (their estimate, bounds and pair counts stay), also where ``plan_explain`` lists them.
    The Markdown table and the plots are drawn from the whole summary. Idempotent."""
    out = copy.deepcopy(summary)
    for result in out.get("systems", {}).values():
        result.pop("step_times_ms", None)
        warmup = result.pop("warmup_ms", None)
        if warmup is not None:
            result["warmup"] = {"steps": len(warmup), "total_s": sum(warmup) / 1e3}
        for decision in result.get("plan_decisions") or []:
            decision.pop("observations_ms", None)
        if result.get("verification"):
            result["verification"].pop("observations_ms", None)
        if result.get("plan_explain"):
            result["plan_explain"] = "\n".join(line for line in result["plan_explain"].splitlines()
                                               if not _PAIR_LINE.match(line))
    return out


def write_json(summary: dict[str, Any], path: Path, raw: bool = False) -> None:
    """Write ``summary`` to ``path``: :func:`compact` unless ``raw``."""
    path.write_text(json.dumps(summary if raw else compact(summary), indent=1))


def source_commit() -> Optional[str]:
    """The commit of the git checkout this package runs from (``-dirty`` when it has uncommitted
    changes), or None for an installed package: a result names the code it measured."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():  # (a directory, or a file in a worktree)
        return None
    try:
        # (--exclude=*: the commit itself, never a tag's name)
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"], cwd=root,
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _fmt(q: dict[str, float], digits: int = 1) -> str:
    if not q or math.isnan(q.get("median", float("nan"))):
        return "-"
    return f"{q['median']:,.{digits}f} [{q['p25']:,.{digits}f}, {q['p75']:,.{digits}f}]"


def markdown(summary: dict[str, Any]) -> str:
    s = summary["scenario"]
    lines = [f"### {s['name']}: {s['description']}",
             f"world size {summary['world_size']}, global batch {summary['global_batch']}, "
             f"{summary['config']['rounds']} rounds x {summary['config']['steps_per_round']} steps, "
             f"{summary['config']['warmup_steps']} warmup steps per system (excluded), precision "
             f"{summary['config'].get('precision', '32-true')}"
             + (", freed memory retained (--retain-freed-memory)" if summary["config"].get("retain_freed_memory") else ""),
             "",
             "| system | step ms, median [p25, p75] | samples/s, median [p25, p75] | CPU ms/step | sparse-path CPU "
             "ms/step beyond dense-only (training thread) | page faults/step, mean (training thread) | collectives/step (MB) | "
             + " | ".join(x.replace("_", " ") for x in STAGES) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(STAGES)]
    for name, r in summary["systems"].items():
        if r["status"] != "ok":
            error = (r.get("error") or "").strip().splitlines()
            lines.append(f"| {name} | failed: {error[-1] if error else '?'} |")
            continue
        c = r.get("collectives_per_step") or {}
        coll = f"{c['count']} ({c['bytes'] / 1e6:.2f})" if c else "-"
        stages = r.get("stages_ms") or {}
        faults = f"{r['page_faults_mean']:.0f}" if "page_faults_mean" in r else "-"  # (summaries written before the column)
        lines.append(f"| {name} | {_fmt(r['step_ms'])} | {_fmt(r['samples_per_s'], 0)} | "
                     f"{r['cpu_ms']['median']:.1f} | "
                     + (f"{r['sparse_cpu_ms']:.1f} ({r['sparse_thread_cpu_ms']:.1f})" if "sparse_cpu_ms" in r else "-")
                     + f" | {faults} | {coll} | " + " | ".join(
                         f"{stages[k]:.1f}" if k in stages else "-" for k in STAGES) + " |")
    refs = [x for x in REFERENCES if summary["systems"].get(x, {}).get("status") == "ok"]
    if refs:
        lines += ["", "Speedup (median of per-round ratios, [p25, p75]) of each system over:", "",
                  "| system | " + " | ".join(refs) + " |", "|---|" + "---|" * len(refs)]
        for name, r in summary["systems"].items():
            if r["status"] == "ok":
                cells = ["1.00" if name == ref else _fmt(summary["ratios"].get(f"{name} / {ref}", {}), 3) for ref in refs]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    profiled = {name: r["top_ops"] for name, r in summary["systems"].items() if r.get("top_ops")}
    if profiled:
        lines += ["", "<details><summary>ops with the most CPU time in one profiled step (self time, all threads, "
                      "rank 0; the profiler inflates short ops)</summary>", ""]
        lines += [f"- {name}: " + ", ".join(f"{o['op']} {o['self_cpu_ms']:.1f} ms ({o['calls']}x)" for o in ops)
                  for name, ops in profiled.items()]
        lines += ["", "</details>"]
    for name, r in summary["systems"].items():
        if r.get("graph_explain"):
            lines += ["", f"{name}: sparse path lifted in {r['lift_s']:.3f} s after its capture steps; calibration "
                          f"{r['calibration_steps']} steps / {r['calibration_s']:.2f} s, planning {r['planning_s']:.3f} s; "
                          f"the plan's graph predicts {r['graph_collectives_per_step']} collectives per step; step "
                          f"change predicted {_signed(r['predicted_change_ms'])} (the step-time model), calibrated "
                          f"{r['measured_change_ms']:+.3f} ms (the accepted increments added up).", "",
                      "<details><summary>plan and graph: explain()</summary>", "", "```", r["plan_explain"], "",
                      r["graph_explain"], "```", "", "</details>"]
    return "\n".join(lines) + "\n"


def plots(summary: dict[str, Any], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: r for n, r in summary["systems"].items() if r["status"] == "ok"}
    if not ok:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    name = summary["scenario"]["name"]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    med = [r["samples_per_s"]["median"] for r in ok.values()]
    err = [[m - r["samples_per_s"]["p25"] for m, r in zip(med, ok.values())],
           [r["samples_per_s"]["p75"] - m for m, r in zip(med, ok.values())]]
    ax.bar(list(ok), med, yerr=err, capsize=4, color="tab:blue")
    ax.set_ylabel("samples/s (median, IQR)")
    ax.set_title(f"{name}: throughput, world size {summary['world_size']}")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    paths.append(folder / f"{name}_throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    staged = {n: r["stages_ms"] for n, r in ok.items() if r.get("stages_ms")}
    if staged:
        fig, ax = plt.subplots(figsize=(8.5, 3.5))
        bottom = [0.0] * len(staged)
        for stage in STAGES:
            values = [s[stage] for s in staged.values()]
            ax.bar(list(staged), values, bottom=bottom, label=stage.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"{name}: stage breakdown")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.tick_params(axis="x", rotation=20)
        fig.tight_layout()
        paths.append(folder / f"{name}_stages.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    timed = {n: r["step_times_ms"] for n, r in ok.items() if r.get("step_times_ms")}  # (not in a compact file)
    if timed:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for n, times in timed.items():
            ax.plot([summary["global_batch"] / (t / 1e3) for t in times], label=n, lw=1)
        ax.set_xlabel("measured step (interleaved rounds, warmup excluded)")
        ax.set_ylabel("samples/s")
        ax.set_title(f"{name}: throughput over steps")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(folder / f"{name}_over_steps.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def _signed(ms: Optional[float]) -> str:
    return "none" if ms is None else f"{ms:+.3f} ms"
