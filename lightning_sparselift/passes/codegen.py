"""Code generation: a module's lookup regions run by kernels generated for the rank's tables
instead of TorchRec's / fbgemm's reference kernels.

The runtime (:mod:`lightning_sparselift.runtime.codegen`) emits C++ with each table's rows, dim,
offsets, pooling, id check and optimizer baked in, builds it before planning (cached by the hash
of its source) and records in the graph which groups have a kernel on every rank
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
the effect); compile time is spent before planning, never in a timed step.
"""

from __future__ import annotations

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.cost.priors import Priors
from lightning_sparselift.ir import LiftedModule, SparseGraph
from lightning_sparselift.ir.schedule import GENERATED_KERNEL
from lightning_sparselift.passes.base import Candidate, OptimizationPass


class CodeGeneration(OptimizationPass):
    name = "codegen"
    roles = ("lookup",)
    protocol = CalibrationProtocol(warmup_pairs=1, measured_pairs=2, region="lookup", settle_steps=0, mirrored=True)
    uses_generated_kernels = True

    @staticmethod
    def _groups(module: LiftedModule) -> list[int]:
        """The groups whose lookup can switch to a generated kernel."""
        return [g.index for g in module.lifted_groups if GENERATED_KERNEL in g.lookup_kernels
                and module.schedule.region("lookup", g.index).kernel != GENERATED_KERNEL]

    def check(self, graph: SparseGraph, module: LiftedModule, role: str) -> tuple[list[str], dict[str, float]]:
        groups = self._groups(module)
        reasons = []
        if not groups:
            done = [g.index for g in module.lifted_groups
                    if module.schedule.region("lookup", g.index).kernel == GENERATED_KERNEL]
            reasons = ["already scheduled"] if done else [
                f"g{g.index} ({g.sharding_type}): "
                + g.lookup_notes.get(GENERATED_KERNEL, "no generated kernel was built (the session builds them "
                                                      "before planning)") for g in module.lifted_groups]
        ids = max((sum(module.group_ids(m, module.groups[i]) for i in groups)
                   for m in range(len(module.ids_per_step))), default=0.0)
        return reasons, {"groups": float(len(groups)), "ids": ids, "touched_bytes": module.touched_bytes(groups)}

    def predict_ms(self, candidate: Candidate, priors: Priors) -> float:
        # fbgemm's serial CPU backward reads each touched row's gradient and weights about twice
        # over (sort, then accumulate and update); the generated one about once
        return -priors.lookup.copy_ms(candidate.cost_inputs["touched_bytes"])

    def rewrite(self, graph: SparseGraph, module: LiftedModule, candidate: Candidate) -> str:
        groups = self._groups(module)
        for region in module.schedule.regions:
            if region.name == "lookup" and set(region.groups) & set(groups):
                region.kernel = GENERATED_KERNEL
        left = [f"g{g.index}: {g.lookup_notes[GENERATED_KERNEL]}" for g in module.lifted_groups
                if g.index not in groups and GENERATED_KERNEL in g.lookup_notes]
        return (f"{module.path}: lookups of {', '.join(f'g{g}' for g in groups)} run generated kernels"
                + (f" (reference kernel kept for {'; '.join(left)})" if left else ""))
