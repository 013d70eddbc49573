"""The per-step state of one lifted module: the ``forward`` installed on its sharded module.

It runs the module's schedule: the input distribution (at the lookups, or started during the
previous step for the batch the loop announced), TorchRec's lookup modules (so parameters, fused
optimizer state, ``state_dict`` and checkpoints stay TorchRec's), and the output distribution
(issued at the module's call, or when the root forward began; waited for when the model first
reads the module's output, as TorchRec's lazy outputs are). Every step
moves the same bytes in the same layouts as TorchRec and does the same arithmetic, so results
are bit-identical. Which exchanges and kernels run is decided once, in :meth:`use`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_sparselift.kjt import copy_features, same_features
from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.ir import LiftedModule, ModuleSchedule, ScheduleError, check_schedule
from lightning_sparselift.ir.schedule import CONSUMER_KERNEL, GENERATED_KERNEL, Region
from lightning_sparselift.ir.vocab import ROW_SHARDED
from lightning_sparselift.runtime.buffers import Buffers
from lightning_sparselift.runtime.codegen import GeneratedLookup, Unsupported
from lightning_sparselift.runtime.codegen.layout_kernel import LayoutKernel
from lightning_sparselift.runtime.consumer_layout import ConsumerOutput, timed_reference
from lightning_sparselift.runtime.input_dist import Distributed, GroupRuntime, InputDistribution
from lightning_sparselift.runtime.input_layout import InputKernel
from lightning_sparselift.runtime.kernels import kernel
from lightning_sparselift.ir.vocab import CAST_FORMATS, WIRE_ROLES
from lightning_sparselift.runtime.layout import Wire
from lightning_sparselift.runtime.mean_pooling import MeanAfterReduce
from lightning_sparselift.runtime.output_dist import KeptPending, OutputDistribution, Pending
from lightning_sparselift.runtime.pipeline import Pipeline
from lightning_sparselift.runtime.torchrec_group import TorchRecGroup
from lightning_sparselift.runtime.update_guard import UpdateCheck, guarded, no_check
from lightning_sparselift.validation import InputCheck

if TYPE_CHECKING:
    from lightning_sparselift.runtime.lazy_output import LazyOutput  # (imports torchrec)


@dataclass
class _Started:
    """Lookups run from an early start, their output all-to-alls in flight."""

    features: Any
    out: list[Tensor]
    pending: list[Pending | KeptPending]
    inputs: list[Distributed]


@dataclass
class _Prefetch:
    """The next batch's input distribution, started during the step before."""

    features: Any  # a copy of what was distributed (the batch may be changed in place before its step)
    complete: Optional[Callable[[], list[Any]]]  # waits and returns each group's KJT; None: uneven batch sizes

    def drain(self) -> None:
        """Finish this rank's side of the exchange without using it."""
        if self.complete is not None:
            self.complete()


class ModuleExecutor:
    def __init__(self, spec: LiftedModule, sharded: nn.Module, world_size: int, rank: int,
                 process_groups: dict[str, Any], device: torch.device, clock: RegionClock,
                 reuse_buffers: bool = True, numerics: str = "exact") -> None:
        """``reuse_buffers``: the buffers the runtime fills every step keep their memory from step
        to step (see :mod:`~lightning_sparselift.runtime.buffers`); ``numerics``: which generated
        kernels may run (see :func:`~lightning_sparselift.runtime.codegen.lookup.build_kernel`)."""
        self.spec = spec
        self.module = sharded
        self.world, self.rank, self.device, self.clock = world_size, rank, device, clock
        self.process_groups = process_groups
        self.buffers = Buffers(reuse_buffers)
        self.numerics = numerics
        self.groups = [GroupRuntime.build(g, lookup, world_size, rank, device, spec.pooled)
                       for g, lookup in zip(spec.groups, sharded._lookups)]
        self.kept = {g.index: TorchRecGroup(sharded, g.index) for g in spec.groups if g.not_lifted}
        self.mean = MeanAfterReduce(spec, device) if spec.mean_after_reduce else None
        # TorchRec's quantized communication: its codecs, per output exchange (the lift admitted them)
        self.codecs = getattr(sharded, "qcomm_codecs_registry", None) or {}
        # TorchRec's own forward, for the steps where ranks pass different batch sizes
        self.torchrec_forward = type(sharded).forward.__get__(sharded)
        self._started: Optional[_Started] = None
        self._announced: Any = None  # the features of the next training step, as the loop announced them
        self._prefetch: Optional[_Prefetch] = None
        self._output: Optional[LazyOutput] = None  # the last output handed to the model, until its wait ran
        self.torchrec_steps = 0
        self.early_steps = 0  # calls finished from an early start
        self.early_starts = 0  # early starts that ran (one per step unless a start is discarded)
        self.prefetches = 0  # next-batch input distributions started
        self.prefetched_steps = 0  # training calls whose input distribution the step before started
        self.concatenated_steps = 0  # calls whose output the model concatenated for free (the consumer layout)
        # called with (module path, features) on every training call of the module (the session's drift watch)
        self.observer: Optional[Callable[[str, Any], None]] = None
        # entered around every early start (the bench times them: they run before the module's call)
        self.start_region: Callable[[], AbstractContextManager[Any]] = nullcontext
        # called in backward before the module's gradients go on to any exchange or update, whatever the schedule
        self.before_update: UpdateCheck = no_check
        # by group and buckets: built once, kept across plan switches
        self.generated: dict[tuple[int, tuple[tuple[str, ...], ...]], GeneratedLookup] = {}
        self.bucket_builds: list[dict[str, Any]] = []  # the kernels in buckets built since the last take
        self.layout: Optional[LayoutKernel] = None  # the consumer layout's kernel, once built
        self._input_kernel: Optional[InputKernel] = None  # the input side's kernel, once built
        self.use(spec.schedule)

    def use(self, schedule: ModuleSchedule) -> None:
        """Run ``schedule`` from the next step on: its exchanges and kernels are built here."""
        problems = check_schedule(schedule, self.spec.kinds, self.world, self.spec.pooled)
        named = {e.process_group for e in [*schedule.inputs, *schedule.outputs]} | {n for e in schedule.outputs
                                                                                   for n in e.split}
        unknown = sorted(named - set(self.process_groups))
        if unknown:
            problems.append(f"process group(s) {unknown} not created by the runtime (it has {sorted(self.process_groups)})")
        streams = sorted({e.stream for e in [*schedule.inputs, *schedule.outputs] if e.stream is not None})
        if streams:
            problems.append(f"streams {streams}: the runtime issues every exchange on the current stream")
        try:
            lookups = [self.lookup_kernel(i, schedule.region("lookup", i)) for i in range(len(self.groups))]
            pipelines = {e.groups[0]: self.pipeline(e.groups[0], schedule.region("lookup", e.groups[0]), e.split)
                         for e in schedule.outputs if e.split and not unknown}
            output = self.output_kernel(schedule)
            inputs = InputDistribution(self.spec, schedule, self.groups, self.kept, self.process_groups, self.world,
                                       self.device, self.buffers, self.clock, self.input_kernel)
        except (KeyError, LookupError, Unsupported) as error:
            problems.append(str(error))
        if problems:
            raise ScheduleError(f"{self.spec.path}: cannot run the schedule: {'; '.join(problems)}")
        # (work started under the previous schedule completes with its own exchanges: a next-batch
        # distribution started during a calibration step is used by the step after it, on every rank)
        self.schedule = schedule
        self.inputs, self.lookups, self.output = inputs, lookups, output
        self.outputs = OutputDistribution(schedule, self.groups, self.kept, self.process_groups, self.rank, self.clock,
                                          self.buffers, pipelines, self.wires(schedule))
        self.starts_early = schedule.lookup_at == "root_forward"
        self.distributes_ahead = schedule.input_issue == "previous_step"

    def wires(self, schedule: ModuleSchedule) -> dict[str, Wire]:
        """By TorchRec's comm op: how the output exchanges' values travel (TorchRec's codecs, or the
        schedule's cast of each direction)."""
        return {op: Wire(self.codecs.get(op), {forward: CAST_FORMATS[f] for forward, role in zip((True, False), roles)
                                               if (f := schedule.wire.get(role))})
                for op, roles in WIRE_ROLES.items()}

    def output_kernel(self, schedule: ModuleSchedule) -> Callable[[LiftedModule, list, list], Any]:
        """The kernel of the output region: the consumer layout is built for the schedule's buckets."""
        name = schedule.region("output").kernel
        if name != CONSUMER_KERNEL:
            return kernel("output", name)
        return ConsumerOutput(self.spec, schedule, self.layout_kernel(), self.buffers, self.clock,
                              lambda: setattr(self, "concatenated_steps", self.concatenated_steps + 1))

    def layout_kernel(self) -> LayoutKernel:
        """The module's generated consumer layout kernel, built (or loaded from the cache) on first
        use; LookupError without a captured concatenation, :class:`Unsupported` when it cannot be built."""
        if self.layout is None:
            self.layout = LayoutKernel(self.spec, self.world, self.device)
        return self.layout

    def input_kernel(self) -> InputKernel:
        """The module's generated input kernel (permute, bucketize and recat), built (or loaded
        from the cache) on first use; :class:`Unsupported` when it cannot be built."""
        if self._input_kernel is None:
            blocks = [g.block_sizes if g.kind in ROW_SHARDED else None for g in self.spec.groups]
            self._input_kernel = InputKernel(self.spec.feature_order, len(self.spec.keys),
                                             [len(g.local_keys) for g in self.groups], self.world, self.device,
                                             blocks, (self.spec.lengths_dtype, self.spec.values_dtype))
        return self._input_kernel

    def lookup_kernel(self, group: int, region: Region) -> Callable[[nn.Module, Any], Tensor]:
        """The kernel of group ``group``'s lookup ``region``; a generated one (for the region's
        buckets) is built (or loaded from the cache) on first use. :class:`Unsupported` when it
        cannot be."""
        if region.kernel != GENERATED_KERNEL:
            return kernel("lookup", region.kernel)
        if not region.buckets or self._key(group, region.buckets) in self.generated:
            return self.generated_lookup(group, region.buckets)
        # (kernels in buckets not built off the training thread: e.g. a saved plan's, installed at once)
        built = self.generated_lookup(group, region.buckets)
        self.bucket_builds.append({"module": self.spec.path, "group": group, "buckets": len(region.buckets),
                                   "tables": region.buckets, "note": "", "seconds": built.build_s,
                                   "cached": built.cached})
        return built

    def generated_lookup(self, group: int, buckets: list[list[str]]) -> GeneratedLookup:
        """Group ``group``'s generated lookup kernel for its tables in ``buckets`` ([]: one bucket),
        built (or loaded from the cache) on first use and kept; :class:`Unsupported` when it
        cannot be built. A thread of the session's may build it while training runs."""
        key = self._key(group, buckets)
        if key not in self.generated:
            # ids are checked in the kernel only when no input check runs before it (never twice)
            checked = any(isinstance(h, InputCheck) for h in self.module._forward_pre_hooks.values())
            self.generated[key] = GeneratedLookup(self.groups[group].lookup, self.spec.weighted, check_ids=not checked,
                                                  numerics=self.numerics, buckets=buckets, buffers=self.buffers)
        return self.generated[key]

    @staticmethod
    def _key(group: int, buckets: list[list[str]]) -> tuple[int, tuple[tuple[str, ...], ...]]:
        return group, tuple(tuple(b) for b in buckets)

    def pipeline(self, group: int, region: Region, process_groups: list[str]) -> Pipeline:
        """Group ``group``'s lookup (its generated kernel for ``region``'s buckets) and output
        all-to-all pipelined bucket by bucket on ``process_groups``; :class:`Unsupported` when not."""
        lookup = self.lookup_kernel(group, region)
        if not isinstance(lookup, GeneratedLookup):
            raise Unsupported(f"g{group}: pipelined buckets run a generated lookup, not {region.kernel}")
        return Pipeline(lookup, self.spec.groups[group], region.buckets, [self.process_groups[n] for n in process_groups],
                        self.rank, self.buffers)

    def _check(self, features: Any) -> None:
        if features.variable_stride_per_key():
            raise ValueError(f"{self.spec.path}: inputs with a variable batch size per feature (VBE) are not "
                             f"supported by the lifted executor (use executor='torchrec')")
        if list(features.keys()) != self.spec.keys:
            raise ValueError(f"{self.spec.path}: the KJT keys {features.keys()} are not in the order of the captured "
                             f"batches {self.spec.keys}; keep one key order for the whole run")

    # ------------------------------------------------------------------ the module's call
    def __call__(self, features: Any) -> Any:
        self._settle()
        self._check(features)
        if self.observer is not None and self._training():
            self.observer(self.spec.path, features)
        if self._started is not None and same_features(self._started.features, features):
            started, self._started = self._started, None
            self.early_steps += 1
            result = self._hand_off(started.out, started.pending, started.inputs, features)
        else:
            self._discard_started()
            ran = self._run(features, early=False)
            if ran is None:
                # every rank saw the same batch sizes in the splits exchange, so every rank takes this
                # branch together: TorchRec's path handles per-rank batch sizes (e.g. a short last batch)
                # and empty batches on every rank (not counted: such a training step is skipped)
                self.torchrec_steps += features.stride() > 0
                result = self.torchrec_forward(features)
            else:
                result = self._hand_off(*ran, features)
        if self.distributes_ahead and self._announced is not None and self._training():
            self._start_next()
        return result

    def start(self, features: Any) -> None:
        """The root forward began: run this step's input distribution and lookups now and leave
        the output all-to-alls in flight; the module's call with the same ``features`` finishes it."""
        with self.start_region():
            self._settle()
            if self._started is not None and same_features(self._started.features, features):
                # the root forward ran again on the same input: Lightning calls the LightningModule for
                # its forward redirection and again in training_step (with DDP's copy of the batch)
                return
            self._discard_started()
            self._run_pre_hooks(features)
            self._check(features)
            ran = self._run(features, early=True)
            self.early_starts += 1
            if ran is not None:  # (None: uneven batch sizes; the call hands the step to TorchRec)
                self._started = _Started(features, *ran)

    def announce(self, features: Any) -> None:
        """The features the next training step will pass (None: unknown). When the schedule
        distributes a step ahead, their input distribution starts after this step's call, and
        their input check now (its ranks' all-gather runs during this step's work until then)."""
        self._announced = features
        if self.distributes_ahead and features is not None:
            for hook in self.module._forward_pre_hooks.values():
                if isinstance(hook, InputCheck):
                    hook.start(features, backward=True)

    def _start_next(self) -> None:
        features, self._announced = self._announced, None
        if features.device() != self.device:
            features = features.to(self.device, non_blocking=True)
        self._run_pre_hooks(features)  # e.g. input validation, before its ids go to other ranks
        self._check(features)
        self._discard_prefetch()
        with self.clock.region():
            self._prefetch = _Prefetch(copy_features(features), self.inputs.start(features))
        self.prefetches += 1

    def _take_prefetch(self, features: Any) -> Optional[_Prefetch]:
        """The input distribution the previous step started for this training step's ``features``."""
        if self._prefetch is None or not self._training():
            return None  # (an evaluation call in between leaves it for the next training step)
        prefetch, self._prefetch = self._prefetch, None
        if not same_features(prefetch.features, features):
            prefetch.drain()
            raise RuntimeError(
                f"{self.spec.path}: this training step's features are not the ones the training loop announced as "
                f"next (their input distribution started during the previous step): a hook, callback or the model "
                f"changed the batch after it was announced. Plan without the next-batch schedule "
                f"(optimizations=['aggregation', 'latency_hiding:early_start']) or stop changing the sparse "
                f"features after loading.")
        self.prefetched_steps += 1
        return prefetch

    def _training(self) -> bool:
        return self.module.training and torch.is_grad_enabled()

    def _run_pre_hooks(self, features: Any) -> None:
        """The module's forward pre-hooks (e.g. input validation), for work started outside its call."""
        for hook_id, hook in self.module._forward_pre_hooks.items():
            if hook_id in self.module._forward_pre_hooks_with_kwargs:
                hook(self.module, (features,), {})
            else:
                hook(self.module, (features,))

    def _run(self, features: Any, early: bool
             ) -> Optional[tuple[list[Tensor], list[Pending | KeptPending], list[Distributed]]]:
        with self.clock.region():
            prefetch = self._take_prefetch(features)
            complete = prefetch.complete if prefetch is not None else self.inputs.start(features)
            if complete is None:
                return None
            inputs = complete()
            # (a pipelined group's lookups run with its exchanges)
            locals_ = [None if i in self.outputs.pipelined else self._look_up(lookup, g, d.kjt)
                       for i, (lookup, g, d) in enumerate(zip(self.lookups, self.groups, inputs))]
            return (*self.outputs.issue(locals_, inputs, features.stride(), early), inputs)

    def _look_up(self, lookup: Callable[[nn.Module, Any], Tensor], group: GroupRuntime, kjt: Any) -> Tensor:
        with self.clock.lookup():
            out = lookup(group.lookup, kjt)
            if group.row_width is not None:  # an EmbeddingCollection's rows, as TorchRec views them
                out = out.view(-1, group.row_width)
        if self._training():
            self.clock.lookup_backward(out)
        return out

    def _hand_off(self, out: list[Tensor], pending: list[Pending | KeptPending], inputs: list[Distributed],
                  features: Any) -> LazyOutput:
        """The module's output as TorchRec hands its own: waited for when the model first reads it
        (see :mod:`~lightning_sparselift.runtime.lazy_output`)."""
        from lightning_sparselift.runtime.lazy_output import LazyOutput

        def finish() -> Any:
            self._output = None
            return self._finish(out, pending, inputs, features)

        self._output = LazyOutput(finish)
        return self._output

    def _settle(self) -> None:
        """Wait for the last output if the model has not read it, before this module exchanges again
        (its exchanges and the buffers they fill go in order)."""
        if self._output is not None:
            from lightning_sparselift.runtime.lazy_output import settle

            settle(self._output)

    def _finish(self, out: list[Tensor], pending: list[Pending | KeptPending], inputs: list[Distributed],
                features: Any) -> Any:
        received = guarded(self.before_update, self.outputs.wait(out, pending))
        # the reference's copies that the consumer layout replaces, timed for its calibration
        timed = (self.clock.times_concatenations and self.spec.consumer is not None and self.mean is None
                 and not isinstance(self.output, ConsumerOutput) and self._training())
        with self.clock.concatenation() if timed else nullcontext():
            result = self.output(self.spec, received, [d.features for d in inputs])
        if timed:
            return timed_reference(result, self.clock)
        return result if self.mean is None else self.mean.apply(result, features)

    # ------------------------------------------------------------------ started work not used
    def _discard_started(self) -> None:
        if self._started is not None:  # started but never consumed: complete the exchange, drop it
            OutputDistribution.drain(self._started.pending)
            self._started = None

    def _discard_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.drain()
            self._prefetch = None

    def discard(self) -> None:
        """Complete and drop work started for a step that will not run (training ended)."""
        self._settle()
        self._discard_started()
        self._discard_prefetch()
        self._announced = None
