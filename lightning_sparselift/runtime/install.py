"""Installing the lifted executor: every lifted module's ``forward`` is replaced (on the instance,
as TorchRec's own train pipelines do) by a :class:`~lightning_sparselift.runtime.executor.ModuleExecutor`,
and a pre-hook on the root module starts the modules whose schedule looks up early. Switching
plans hands each executor its module's new schedule."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_sparselift.kjt import resolve_features
from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.ir import SparseGraph
from lightning_sparselift.ir.schedule import Region
from lightning_sparselift.runtime.executor import ModuleExecutor
from lightning_sparselift.runtime.update_guard import UpdateCheck


def _built(make: Callable[[], Any]) -> dict[str, Any]:
    """``{"note", "seconds", "cached"}`` of the kernel ``make`` builds (a note: why it could not)."""
    from lightning_sparselift.runtime.codegen import Unsupported

    try:
        built = make()
    except (LookupError, Unsupported) as error:
        return {"note": str(error), "seconds": 0.0, "cached": False}
    return {"note": "", "seconds": built.build_s, "cached": built.cached}


@dataclass
class InstalledExecutor:
    """What :func:`install` changed; :meth:`use` switches plans, :meth:`uninstall` restores
    TorchRec's path."""

    graph: SparseGraph
    executors: dict[str, ModuleExecutor]
    clock: RegionClock
    _restore: list[Callable[[], None]]
    # by name, the process groups the executors' schedules may name ("world": the training's)
    process_groups: dict[str, Any]

    def use(self, graph: SparseGraph) -> None:
        """Run ``graph`` (the installed graph after passes: same modules, other schedules). Every
        rank calls it with the same graph at the same step: the process groups its schedules name
        that do not exist yet (pipelined buckets') are created here, over the training's ranks.
        The graph in use again is nothing to switch (a calibration step that runs the incumbent)."""
        if graph is self.graph:
            return
        if sorted(m.path for m in graph.modules) != sorted(self.executors):
            raise ValueError(f"graph modules {[m.path for m in graph.modules]} are not the installed "
                             f"{sorted(self.executors)}")
        named = {n for m in graph.modules for e in m.schedule.outputs for n in e.split}
        for name in sorted(named - set(self.process_groups)):  # (new_group is collective: one order everywhere)
            self.process_groups[name] = dist.new_group(dist.get_process_group_ranks(self.process_groups["world"]))
            self._restore.append(lambda pg=self.process_groups[name]: dist.destroy_process_group(pg))
        for spec in graph.modules:
            self.executors[spec.path].use(spec.schedule)
        self.graph = graph

    def build_generated(self) -> list[dict[str, Any]]:
        """Build (or load from the cache) every group's generated lookup kernel on this rank, the
        consumer layout's kernel of every module whose concatenation capture saw and every
        module's input kernel, before any plan uses one: per kernel, ``{"module", "group",
        "note"}`` ("" when built, else why not; ``group``: the sharding group, or
        ``OUTPUT_KERNEL_GROUP`` / ``INPUT_KERNEL_GROUP``), ``"seconds"`` and ``"cached"``."""
        from lightning_sparselift.ir.schedule import INPUT_KERNEL_GROUP, OUTPUT_KERNEL_GROUP

        out = []
        for path, executor in self.executors.items():
            builds = [(g.index, lambda i=g.index: executor.generated_lookup(i, []))
                      for g in executor.spec.lifted_groups]
            if executor.spec.consumer is not None:
                builds.append((OUTPUT_KERNEL_GROUP, lambda: executor.layout_kernel().built))
            builds.append((INPUT_KERNEL_GROUP, lambda: executor.input_kernel().built))
            out += [dict(module=path, group=group, **_built(make)) for group, make in builds]
        return out

    def build_lookups(self, regions: dict[str, list[Region]]) -> list[dict[str, Any]]:
        """Build (or load from the cache) the generated kernels of ``regions`` (by module: lookup
        regions in buckets) on this rank: per kernel, as :meth:`build_generated`'s, with
        ``"buckets"`` and ``"tables"`` (the region's buckets)."""
        return [dict(module=path, group=r.groups[0], buckets=len(r.buckets), tables=r.buckets,
                     **_built(lambda e=self.executors[path], r=r: e.generated_lookup(r.groups[0], r.buckets)))
                for path, wanted in regions.items() for r in wanted]

    def torchrec_calls(self) -> int:
        """Calls of the lifted modules that ran TorchRec's path (the ranks' batch sizes differed)."""
        return sum(e.torchrec_steps for e in self.executors.values())

    def take_bucket_builds(self) -> list[dict[str, Any]]:
        """The generated kernels in buckets built on this rank since the last call (as
        :meth:`build_generated`'s, with ``"buckets"``)."""
        out = []
        for executor in self.executors.values():
            out += executor.bucket_builds
            executor.bucket_builds = []
        return out

    def announce(self, batch: Any) -> None:
        """The batch the next training step will pass to the model (None: not known). Modules
        whose schedule distributes a step ahead start its input distribution during this step."""
        for executor in self.executors.values():
            path = executor.spec.batch_input
            executor.announce(resolve_features((batch,), {}, path, executor.spec.keys)
                              if batch is not None and path is not None else None)

    def observe(self, observer: Optional[Callable[[str, Any], None]]) -> None:
        """Call ``observer(module path, features)`` on every training call of a lifted module
        (None: stop)."""
        for executor in self.executors.values():
            executor.observer = observer

    def wrap_early_starts(self, region: Optional[Callable[[], AbstractContextManager[Any]]]) -> None:
        """Run every early start (a step's input distribution, lookups and output all-to-all
        issue, begun when the root forward starts) inside ``region()`` (None: stop): the bench
        counts them as sparse forward, though they run before the module's call."""
        for executor in self.executors.values():
            executor.start_region = region or nullcontext

    def guard_updates(self, check: UpdateCheck) -> None:
        """Call ``check`` in every lifted module's backward before its gradients reach an exchange
        or an update (see :mod:`~lightning_sparselift.runtime.update_guard`); it raises to stop the step."""
        for executor in self.executors.values():
            executor.before_update = check

    def discard(self) -> None:
        """Training ended: complete and drop what was started for a step that will not run."""
        for executor in self.executors.values():
            executor.discard()

    def uninstall(self) -> None:
        self.discard()
        for restore in self._restore:
            restore()
        self._restore.clear()


def install(graph: SparseGraph, model: nn.Module, group: Any, device: torch.device,
            reuse_buffers: bool = True, numerics: str = "exact") -> InstalledExecutor:
    """Run every module of ``graph`` through a :class:`ModuleExecutor` from now on. ``model`` is
    the root whose forward the training step calls (where early starts begin); ``reuse_buffers``,
    ``numerics``: as the executors'."""
    world = dist.get_world_size(group) if graph.world_size > 1 else 1
    if world != graph.world_size:
        raise ValueError(f"the graph was lifted for {graph.world_size} rank(s), the process group has {world}")
    rank = dist.get_rank(group) if world > 1 else 0
    clock = RegionClock(device)
    process_groups = {"world": group}
    executors, restore = {}, []
    for spec in graph.modules:
        sharded = model.get_submodule(spec.path)
        executor = ModuleExecutor(spec, sharded, world, rank, process_groups, device, clock, reuse_buffers,
                                  numerics)
        had_own = "forward" in sharded.__dict__
        previous = sharded.__dict__.get("forward")
        sharded.forward = executor

        def undo(sharded: nn.Module = sharded, had_own: bool = had_own, previous: Any = previous) -> None:
            if had_own:
                sharded.forward = previous
            else:
                del sharded.forward

        executors[spec.path] = executor
        restore.append(undo)

    def start_early(_root: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (_root.training and torch.is_grad_enabled()):
            return
        for executor in executors.values():
            if executor.starts_early and executor.spec.root_input is not None:
                features = resolve_features(args, kwargs, executor.spec.root_input, executor.spec.keys)
                if features is not None:  # (None: this call's arguments hold no such KJT there)
                    executor.start(features)

    restore.append(model.register_forward_pre_hook(start_early, with_kwargs=True).remove)
    return InstalledExecutor(graph, executors, clock, restore, process_groups)
