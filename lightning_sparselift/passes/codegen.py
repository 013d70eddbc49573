"""Code generation: a module's lookup regions run by kernels generated for the rank's tables
instead of TorchRec's / fbgemm's reference kernels (role ``lookup``), its output region by the
layout the model's concatenation reads (role ``output``), and its input side's permute, bucketize
and recat regions by a kernel generated for its keys (role ``input``).

The runtime (:mod:`lightning_sparselift.runtime.codegen`) emits C++ with each table's rows, dim,
offsets, pooling, id check and optimizer baked in, builds it from the lift on, on a thread of its
own (cached by the hash of its source) and records in the graph which groups have a kernel on every rank
(``ShardingGroup.lookup_kernels``, with the reason in ``lookup_notes`` where not). The generated
kernel pools in forward and applies the fused optimizer update in backward on the storage
TorchRec's lookup modules own, with fbgemm's arithmetic operation for operation: results stay
bit-identical, checkpoints and a switch back to the reference kernel are unaffected.

Feasibility: at least one group of the module whose lookup is not generated yet has a generated
kernel on every rank (data-parallel groups, other optimizers or table types have none: the
reason comes from the runtime). Cost inputs: the ids the slowest rank looks up per step in
those groups and the bytes of the rows they touch (fbgemm's CPU backward is a serial sort and
per-row loop; the generated one groups ids by hashing and updates with the dim unrolled).
Calibration (the paper's: one warmup per implementation, then complete-region observations
ref -> gen -> gen -> ref) of the lookup regions: each lookup call and its backward node (the
fused update), as the training thread's CPU time on CPU (the kernels change only that compute;
a whole step's wall or CPU time adds the dense compute's and the collectives' noise, larger than
the effect); compile time is spent on that thread, and a kernel candidate is calibrated only once
every rank has its kernel: never in a timed step.

``output`` (:mod:`lightning_sparselift.runtime.consumer_layout`): the received pooled blocks are
written once, straight into the tensor the model concatenates the module's values into, and the
model's ``torch.cat`` (and, in backward, its split of the gradient and the output distribution's
packing) copy nothing more. Feasibility: capture saw one concatenation of every key's values
along the key dim and no other use (``LiftedModule.consumer``, else ``consumer_note`` says what
the model did); a pooled module whose groups all run on the lifted executor, without the mean
after a row-wise reduce-scatter (it rescales the whole output afterwards). Cost inputs: the bytes
of the pooled output per step (per rank), copied twice fewer (forward and backward). Calibration:
one warmup pair, then both arms' copies on the training thread's CPU clock (``layout_cpu``: the
output distribution's unpacking and packing, the model's concatenation and its backward, or the
layout's kernel; on CUDA the step's wall time), ref -> gen -> gen -> ref. Some of those copies are
the model's, outside the executor's regions, so the reference's concatenation is timed where the
model makes it; on whole steps (training-thread CPU, ~12% noise of the host's own on CPU) dlrm's
-1 to -3 ms was left undecided after 80 pairs in 6 of 8 calibrations.

``input`` (:mod:`lightning_sparselift.runtime.input_layout`): the permute of the features into
group order, a row-wise group's bucketize and each group's recat of what arrived, each C++ that
also sums every key's lengths (and, in the recat, writes the offsets) as it moves the ids (TorchRec
derives those in passes and Python of their own; the splits, the send counts and the lookups read
them). Feasibility: the module has one of those regions and the runtime built the input kernel on
every rank (C++ over host memory: not on CUDA). Cost inputs: the ids per step on the busiest rank
and their bytes (id and per-sample weight). Calibration: one warmup pair, then the input
distribution's work (permute, splits, payload issue, recat) on the training thread's CPU clock,
ref -> gen -> gen -> ref.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.ir import LiftedModule, SparseGraph
from lightning_sparselift.ir.schedule import CONSUMER_KERNEL, GENERATED_KERNEL, INPUT_REGIONS, Region
from lightning_sparselift.ir.vocab import DTYPE_BYTES
from lightning_sparselift.passes.base import Candidate, OptimizationPass


class CodeGeneration(OptimizationPass):
    name = "codegen"
    roles = ("lookup", "output", "input")
    protocol = CalibrationProtocol(warmup_pairs=1, region="lookup", settle_steps=0)
    uses_generated_kernels = True

    def protocol_for(self, role: str) -> CalibrationProtocol:
        return replace(self.protocol, region={"lookup": "lookup", "output": "layout_cpu", "input": "input"}[role])

    @staticmethod
    def _groups(module: LiftedModule) -> list[int]:
        """The groups whose lookup can switch to a generated kernel."""
        return [g.index for g in module.lifted_groups if GENERATED_KERNEL in g.lookup_kernels
                and module.schedule.region("lookup", g.index).kernel != GENERATED_KERNEL]

    def check(self, graph: SparseGraph, module: LiftedModule, role: str) -> tuple[list[str], dict[str, float]]:
        if role == "output":
            return self._check_output(module)
        if role == "input":
            return self._check_input(module)
        groups = self._groups(module)
        reasons = []
        if not groups:
            done = [g.index for g in module.lifted_groups
                    if module.schedule.region("lookup", g.index).kernel == GENERATED_KERNEL]
            reasons = ["already scheduled"] if done else [
                f"g{g.index} ({g.sharding_type}): "
                + g.lookup_notes.get(GENERATED_KERNEL, "no generated kernel was built (the session builds them "
                                                      "from the lift on)") for g in module.lifted_groups]
        per_group = [module.ids_per_member(module.groups[i]) for i in groups]
        ids = max((sum(g[m] for g in per_group) for m in range(len(module.ids_per_step))), default=0.0)
        return reasons, {"groups": float(len(groups)), "ids": ids, "touched_bytes": module.touched_bytes(groups)}

    @staticmethod
    def _check_output(module: LiftedModule) -> tuple[list[str], dict[str, float]]:
        reasons = []
        if module.schedule.region("output").kernel == CONSUMER_KERNEL:
            reasons.append("already scheduled")
        elif module.consumer is None:
            reasons.append(f"no concatenation to write into: {module.consumer_note or 'capture recorded none'}")
        elif CONSUMER_KERNEL not in module.output_kernels:
            reasons.append(module.output_notes.get(CONSUMER_KERNEL, "no layout kernel was built (the session builds "
                                                                    "them from the lift on)"))
        else:
            kept = [f"g{g.index}" for g in module.groups if g.not_lifted]
            if kept:
                reasons.append(f"group(s) {', '.join(kept)} keep TorchRec's path, whose output is TorchRec's")
            if module.mean_after_reduce:
                reasons.append("the mean after the row-wise reduce-scatter rescales the whole output afterwards")
        batch = max(module.batch_size_per_rank, default=0)
        return reasons, {"pooled_bytes": float(batch * sum(module.embedding_dims) * 4)}

    @staticmethod
    def _input_regions(module: LiftedModule) -> list[Region]:
        """The module's input regions that do not run the generated input kernel yet."""
        return [r for r in module.schedule.regions if r.name in INPUT_REGIONS and r.kernel != GENERATED_KERNEL]

    def _check_input(self, module: LiftedModule) -> tuple[list[str], dict[str, float]]:
        reasons = []
        if not any(r.name in INPUT_REGIONS for r in module.schedule.regions):
            reasons.append("no permute, bucketize or recat region: the features are neither reordered nor exchanged")
        elif not self._input_regions(module):
            reasons.append("already scheduled")
        elif GENERATED_KERNEL not in module.input_kernels:
            reasons.append(module.input_notes.get(GENERATED_KERNEL, "no input kernel was built (the session builds "
                                                                    "them from the lift on)"))
        ids = max((sum(stats.values()) for stats in module.ids_per_step), default=0.0)
        id_bytes = DTYPE_BYTES[module.values_dtype] + (4 if module.weighted else 0)
        return reasons, {"ids": ids, "id_bytes": float(id_bytes)}

    def rewrite(self, graph: SparseGraph, module: LiftedModule, candidate: Candidate) -> str:
        if candidate.role == "input":
            regions = self._input_regions(module)
            for region in regions:
                region.kernel = GENERATED_KERNEL
            names = ", ".join(sorted({r.name for r in regions}))
            return f"{module.path}: the input side runs its generated kernel ({names}: ids moved, per-key sums and " \
                   f"offsets in one pass)"
        if candidate.role == "output":
            module.schedule.region("output").kernel = CONSUMER_KERNEL
            consumer = module.consumer
            return (f"{module.path}: the pooled output is written straight into the model's concatenation "
                    f"({len(consumer.keys)} keys after {consumer.before} and before {consumer.after} other columns)")
        groups = self._groups(module)
        for region in module.schedule.regions:
            if region.name == "lookup" and set(region.groups) & set(groups):
                region.kernel = GENERATED_KERNEL
        left = [f"g{g.index}: {g.lookup_notes[GENERATED_KERNEL]}" for g in module.lifted_groups
                if g.index not in groups and GENERATED_KERNEL in g.lookup_notes]
        return (f"{module.path}: lookups of {', '.join(f'g{g}' for g in groups)} run generated kernels"
                + (f" (reference kernel kept for {'; '.join(left)})" if left else ""))
