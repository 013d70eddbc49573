"""The generated kernels a lifted graph implies, built on a thread of their own: from the lift on
(every group's lookup, every module's layouts), then the lookups in buckets the passes' candidates
would run. A compiler process does not hold the GIL, so training goes on with the reference
kernels meanwhile, and the planner admits the kernel candidates once every rank has their kernels."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_sparselift.cost.step_model import StepModel
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.ir.schedule import Region
from lightning_sparselift.passes import InfeasibleCandidate, OptimizationPass
from lightning_sparselift.plan.types import KernelBuild
from lightning_sparselift.session.ranks import gather

# steps between two checks whether every rank's builds finished (one small all-reduce each)
CHECK_EVERY = 4
# seconds from the lift after which a planning round stops waiting for builds still running and
# calibrates what it has (a cold cache's builds took 10-25 s here; a build that hangs, e.g. on a
# compiler that never returns, would otherwise hold calibration to the end of training)
PATIENCE_S = 120.0


class KernelBuilds:
    """The generated kernels ``build`` builds or loads from the cache (its records, as
    :meth:`~lightning_sparselift.runtime.InstalledExecutor.build_generated`'s), on a background
    thread started here."""

    def __init__(self, build: Callable[[], list[dict[str, Any]]], awaited: bool = True) -> None:
        self.build = build
        # a planning round waits for them before calibrating (the lift's: their candidates are
        # the large ones; a sweep's first rungs: a compile beside a design's steps adds to its
        # noise), or calibrates meanwhile (a sweep's later rungs)
        self.awaited = awaited
        self.started = time.perf_counter()
        self.waited_s = 0.0  # the training thread's time spent waiting for them
        self.seconds: Optional[float] = None  # from start to this rank's last build
        self.overdue = False  # some rank still building after PATIENCE_S, at the last ready()
        self._local: Optional[list[dict[str, Any]]] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._build, name="sparselift-kernel-builds", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            self._local = self.build()
        except BaseException as error:  # (raised on the training thread by collect())
            self._error = error
        self.seconds = time.perf_counter() - self.started

    def ready(self, group: Any, wait_s: Optional[float] = 0.0) -> bool:
        """Whether every rank's builds finished, after waiting up to ``wait_s`` for this rank's
        (None: until they finish); :attr:`overdue` says whether some rank's still run after
        :data:`PATIENCE_S`. A collective over ``group``: every rank calls it at the same step."""
        start = time.perf_counter()
        self._thread.join(timeout=wait_s)
        self.waited_s += time.perf_counter() - start
        running = self._thread.is_alive()
        # (any rank still building, any rank past the patience: one MAX reduction says both)
        state = torch.tensor([int(running), int(running and start - self.started > PATIENCE_S)], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            if dist.get_backend(group) == "nccl":
                state = state.cuda()
            dist.all_reduce(state, op=dist.ReduceOp.MAX, group=group)
        self.overdue = bool(state[1].item())
        return not state[0].item()

    def collect(self, group: Any) -> list[KernelBuild]:
        """Every rank's builds (a collective; after :meth:`ready` said True). A build that raised
        what no kernel's own check catches raises here on every rank, on the training thread."""
        outcomes = gather((self._local, None if self._error is None else f"{type(self._error).__name__}: {self._error}"),
                          group)
        errors = [f"rank {rank}: {error}" for rank, (_, error) in enumerate(outcomes) if error is not None]
        if errors:
            raise RuntimeError(f"building the generated kernels failed: {'; '.join(errors)}") from self._error
        return [KernelBuild(rank=rank, **b) for rank, (local, _) in enumerate(outcomes) for b in local]


def buckets_asked(passes: list[OptimizationPass], graph: SparseGraph) -> dict[str, list[Region]]:
    """The kernels in buckets ``passes`` ask for on ``graph``, by module (the same on every rank:
    the graph is)."""
    wanted: dict[str, list[Region]] = {}
    for optimization in passes:
        for path, regions in optimization.kernels_to_build(graph).items():
            wanted.setdefault(path, []).extend(r for r in regions if r not in wanted.get(path, []))
    return wanted


def buckets_to_build(passes: list[OptimizationPass], graph: SparseGraph, wanted: dict[str, list[Region]],
                     model: Optional[StepModel], accepted: set[str]
                     ) -> tuple[dict[str, list[Region]], list[tuple[str, Region, str]]]:
    """Of ``wanted`` (:func:`buckets_asked`), the kernels a candidate would run next: a sweep's
    first rung, or the rung after an accepted one (``accepted``: candidate ids), predicted a gain
    by ``model`` (without a model, every one: a round without calibration applies them at once).
    And the others predicted no gain: (module, region, why it is not built). A build costs
    seconds of CPU per rank beside training (two ranks on two cores: a two-tower run of 9.7 s took
    14.9 with its four kernels in buckets compiling), so no kernel is built for a rung the model
    expects to lose; the rung is then infeasible with that reason."""
    if model is None:
        return wanted, []
    built = graph.copy()  # (as if every kernel asked for were there: the rungs that run them apply)
    for path, regions in wanted.items():
        for region in regions:
            built.module(path).groups[region.groups[0]].built_buckets.append(region.buckets)
    best: dict[tuple[str, int], tuple[float, str]] = {}  # per asked kernel: the best rung's increment
    for optimization in passes:
        # (predicted on top of what the pass builds on, e.g. the generated kernel in one bucket:
        # the rung's own effect, not that kernel's as well)
        base = built
        for before in passes:
            if before.name in optimization.runs_after:
                for c in before.candidates(base):
                    if c.feasible and c.follows is None:
                        try:
                            base = before.apply(base, c)
                        except InfeasibleCandidate:
                            pass
        candidates = [c for c in optimization.candidates(base)
                      if optimization.only is None or c.role in optimization.only]
        selected = {c.id for c in candidates}  # (a rung selected without the one before it stands alone)
        for c in candidates:
            if not c.feasible or (c.follows in selected and c.follows not in accepted) or c.module not in wanted:
                continue
            after = optimization.apply(base, c)
            runs = [k for k, r in enumerate(wanted[c.module]) if r in after.module(c.module).schedule.regions]
            if runs:
                increment = model.increment_ms(base, after)
                for k in runs:
                    if (c.module, k) not in best or increment < best[(c.module, k)][0]:
                        best[(c.module, k)] = (increment, c.id)
    build: dict[str, list[Region]] = {}
    declined = []
    for (path, k), (increment, candidate) in sorted(best.items()):
        if increment < 0:
            build.setdefault(path, []).append(wanted[path][k])
        else:
            declined.append((path, wanted[path][k], f"not built: the step-time model predicts {increment:+.3f} ms for "
                                                    f"{candidate} (a kernel in buckets is built for a predicted gain)"))
    return build, declined
