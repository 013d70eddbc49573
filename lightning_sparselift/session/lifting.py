"""The lift phase: every rank lifts the captured sparse path and checks it against TorchRec's
modules; the ranks then agree on one graph, or on keeping TorchRec's path (a module any rank
cannot lift stays on TorchRec's path on every rank). Once the generated kernels are built
(:mod:`.kernel_builds`), the graph records which groups and modules have one on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from lightning_sparselift.cost.step_record import StepTimings
from lightning_sparselift.frontend.capture import SparseCapture, gather_captures
from lightning_sparselift.frontend.check import check_against_runtime
from lightning_sparselift.frontend.lift import LiftError, dense_parameter_bytes, lift
from lightning_sparselift.plan.types import KernelBuild
from lightning_sparselift.session.ranks import gather

if TYPE_CHECKING:
    from lightning_sparselift.ir import SparseGraph
    from lightning_sparselift.runtime import InstalledExecutor


@dataclass(frozen=True)
class LiftOutcome:
    """One rank's lift: its graph's fingerprint, or why it could not lift (neither: nothing was
    left to lift)."""

    fingerprint: Optional[str] = None
    error: Optional[str] = None


@dataclass
class Lifted:
    """What the ranks agreed on: the lifted graph, or why TorchRec's path is kept; and what the
    capture steps measured (the step-time model's timings)."""

    graph: Optional[SparseGraph]
    fallback_reason: Optional[str] = None
    timings: Optional[StepTimings] = None


def lift_on_every_rank(capture: SparseCapture, model: nn.Module, sharding_plan: Any, paths: list[str], group: Any,
                       device: torch.device, workspace_budget_bytes: Optional[int]) -> Lifted:
    """Lift what ``capture`` saw (every rank calls it at the same step: it exchanges the captures
    and each rank's outcome). Raises when the ranks lifted different graphs: they would issue
    different collectives."""
    capture.remove()
    captures = gather_captures(capture.result(), group)
    failed: dict[str, str] = {}  # a module whose captured input cannot be lifted (on any rank)
    for rank_errors in gather(capture.errors(), group):
        for path, error in rank_errors.items():
            failed.setdefault(path, error)
    remaining = [p for p in paths if p not in failed]  # (the same on every rank: gathered)
    graph, outcome = None, LiftOutcome()
    if remaining:
        try:
            graph = lift(model, sharding_plan, remaining, captures, group, device, dense_parameter_bytes(model, paths))
            graph.not_lifted.update(failed)
            graph.workspace_budget_bytes = workspace_budget_bytes
            check_against_runtime(graph, model)
            outcome = LiftOutcome(fingerprint=graph.fingerprint())
        except LiftError as error:
            outcome = LiftOutcome(error=str(error))
    outcomes: list[LiftOutcome] = gather(outcome, group)
    errors = sorted({o.error for o in outcomes if o.error is not None})
    if errors or not remaining:
        return Lifted(None, "; ".join(sorted(set(failed.values())) + errors), StepTimings.from_captures(captures))
    fingerprints = [o.fingerprint for o in outcomes]
    if len(set(fingerprints)) > 1:
        raise RuntimeError(f"ranks lifted different sparse graphs (fingerprints by rank: {fingerprints}); they would "
                           f"issue different collectives. Check that every rank runs the same model and sharding "
                           f"plan with the same input features.")
    return Lifted(graph, timings=StepTimings.from_captures(captures))


def bucket_builds(installed: InstalledExecutor, group: Any) -> list[KernelBuild]:
    """The kernels in buckets every rank built since the last call (for a plan or its trials: every
    rank installs a plan at the same step)."""
    return [KernelBuild(rank=rank, **b) for rank, ranks in enumerate(gather(installed.take_bucket_builds(), group))
            for b in ranks]


def describe_builds(builds: list[KernelBuild], world: int, waited_s: float) -> list[str]:
    built = [b for b in builds if not b.note]
    what = ("lookups in buckets" if all(b.tables for b in builds)
            else "lookups, output layouts, input sides")
    return [f"generated kernels ({what}): {len(built)} built on {world} rank(s), "
            f"{sum(b.cached for b in built)} from the cache, {max(b.seconds for b in built):.2f} s at most per "
            f"kernel, on a thread of their own; training waited {waited_s:.2f} s for them"] if built else []


def mark_generated(graph: SparseGraph, builds: list[KernelBuild]) -> None:
    """Record in ``graph`` which groups have a generated lookup kernel (and in which buckets), and
    which modules a consumer layout kernel and an input kernel, on every rank (``builds``: all
    ranks'), and why the others have none."""
    from lightning_sparselift.ir.schedule import CONSUMER_KERNEL, GENERATED_KERNEL, INPUT_KERNEL_GROUP, \
        OUTPUT_KERNEL_GROUP
    from lightning_sparselift.passes.subgraph_parallelism import bucket_kernel

    def record(module_path: str, group: int, tables: list[list[str]], name: str, kernels: list[Any],
               notes: dict[str, str], kernel: Any) -> None:
        ranks = [b for b in builds if b.module == module_path and b.group == group and b.tables == tables]
        failed = [f"rank {b.rank}: {b.note}" for b in ranks if b.note]
        if failed:
            notes[name] = "; ".join(failed)
        elif ranks and kernel not in kernels:
            kernels.append(kernel)

    for module in graph.modules:
        record(module.path, OUTPUT_KERNEL_GROUP, [], CONSUMER_KERNEL, module.output_kernels, module.output_notes,
               CONSUMER_KERNEL)
        record(module.path, INPUT_KERNEL_GROUP, [], GENERATED_KERNEL, module.input_kernels, module.input_notes,
               GENERATED_KERNEL)
        for group in module.lifted_groups:
            record(module.path, group.index, [], GENERATED_KERNEL, group.lookup_kernels, group.lookup_notes,
                   GENERATED_KERNEL)
            for tables in {tuple(map(tuple, b.tables)): b.tables for b in builds
                           if b.module == module.path and b.group == group.index and b.tables}.values():
                record(module.path, group.index, tables, bucket_kernel(tables), group.built_buckets,
                       group.lookup_notes, tables)


def describe(graph: SparseGraph, capture_steps: int) -> list[str]:
    """The lift's events: what was lifted and installed, what stayed on TorchRec's path."""
    return ([f"lifted {len(graph.modules)} sparse module(s) after {capture_steps} captured step(s); lifted executor "
             f"installed ({len(graph.collectives())} collectives per step)"]
            + [f"kept on TorchRec's path: module {path}: {why}" for path, why in graph.not_lifted.items()]
            + [f"kept on TorchRec's path: {m.path} group {g.index}: {g.not_lifted}"
               for m in graph.modules for g in m.groups if g.not_lifted])
