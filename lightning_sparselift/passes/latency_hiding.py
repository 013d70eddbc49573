"""Latency hiding: overlap the sparse path's communication with compute that does not depend on it.
Two schedules per sparse module, each a candidate of its own.

``early_start`` (output and gradient all-to-alls). The dependency comes from capture: when a
sparse module's input KJT was already among the root forward's arguments (the same object, e.g.
``batch.sparse``, in every captured step on every rank), nothing the model computes before the
module's call can change it. The root pre-hook then runs the module's input distribution and
lookups and leaves the output all-to-all in flight; the module's own call (later, e.g. after
DLRM's bottom MLP) only waits for it. Autograd replays that order backwards: the gradient
all-to-all starts where the wait was and is waited for just before the fused update, so the
bottom MLP's backward runs while it is in flight::

    before: root -> bottom MLP -> [input dist, lookups, output a2a, wait] -> interaction
    after:  root -> [input dist, lookups, issue output a2a] -> bottom MLP -> [wait] -> interaction

``next_batch`` (input distribution one step ahead, TorchRec's sparse-dist pipelining on our
collectives). The training loop announces the batch it will train on next; capture checked that
this announced batch held exactly the features the module received. Right after the module's
step-i call (where the ranks have just met in its output all-to-all) the executor runs batch
i+1's permute/bucketize and splits exchange and leaves its lengths/values/weights all-to-alls in
flight through the rest of step i (interaction, top MLP, backward, optimizer); step i+1 only
waits for them. Input distribution reads no parameter, so nothing is stale: the lookups still
run in step i+1, after step i's update. A training step whose features differ from the
prefetched ones is an error (ranks would disagree on the collectives that follow)::

    before: step i: [input dist i, lookups i, output a2a i] ... backward i
    after:  step i: [lookups i, output a2a i, input dist i+1 issued] ... backward i | step i+1: [wait, lookups i+1 ...]

Feasibility: more than one rank and, per schedule, what capture showed (the input among the
root's arguments / in the announced next batch), else the pass proposes nothing and says why;
``early_start`` needs an output all-to-all (a table/column-wise group, or any exchanged group of
an EmbeddingCollection; row-wise reduce-scatters and data-parallel groups stay synchronous), ``next_batch`` an exchanged (non data-parallel) group. Cost inputs: the
bytes of the collectives each schedule takes off the critical path (their alpha-beta time is the
most it can hide). Calibration: one warmup pair, then complete-step observations per plan (the
decision rule says how many); ``next_batch`` acts across two steps, so each of its observed steps
follows one settle step on the same plan. The data moved and the arithmetic are unchanged:
results stay bit-identical.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_sparselift.kjt import describe_path
from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.ir import LiftedModule, SparseGraph, member_bytes
from lightning_sparselift.ir.vocab import INPUT_ALL_TO_ALL, output_collective
from lightning_sparselift.passes.base import Candidate, OptimizationPass

# the collectives each schedule takes off the critical path (the splits exchange stays
# synchronous: the payload's sizes depend on it)
_HIDDEN_ROLES = {"early_start": ("output_pooled", "grad_pooled", "output_sequence", "grad_sequence"),
                 "next_batch": ("input_lengths", "input_values", "input_weights", "input_payload")}


class LatencyHiding(OptimizationPass):
    name = "latency_hiding"
    roles = ("early_start", "next_batch")
    protocol = CalibrationProtocol(warmup_pairs=1, region="step", settle_steps=1)

    def protocol_for(self, role: str) -> CalibrationProtocol:
        # an early start acts within its step: every step can be observed, no settle step needed
        return replace(self.protocol, settle_steps=0) if role == "early_start" else self.protocol

    def check(self, graph: SparseGraph, module: LiftedModule, role: str) -> tuple[list[str], dict[str, float]]:
        s = module.schedule
        reasons = ["one rank: no all-to-all to hide"] if graph.world_size == 1 else []
        if role == "early_start":
            if module.root_input is None:
                reasons.append("the module's input was not among the root forward's arguments in the captured steps "
                               "(the model computes it), so it cannot start before the model reaches the module")
            if not any(output_collective(k, module.pooled) == "all_to_all_single" for k in module.kinds):
                reasons.append("no output all-to-all (only row-wise reduce-scatters or data-parallel groups): "
                               "nothing asynchronous to overlap")
            if s.lookup_at == "root_forward":
                reasons.append("already scheduled")
        else:
            if module.batch_input is None:
                reasons.append(module.next_batch_note or "the module's input was not found in the announced next batch")
            if not any(k in INPUT_ALL_TO_ALL for k in module.kinds):
                reasons.append("only data-parallel groups: no input distribution")
            if s.input_issue == "previous_step":
                reasons.append("already scheduled")
        hidden = [n for n in graph.collectives() if n.module == module.path and n.op == "all_to_all_single"
                  and n.role in _HIDDEN_ROLES[role]]
        return reasons, {"hidden_bytes": max(member_bytes(hidden, graph.world_size), default=0),
                         "hidden_collectives": len(hidden)}

    def rewrite(self, graph: SparseGraph, module: LiftedModule, candidate: Candidate) -> str:
        s = module.schedule
        if candidate.role == "early_start":
            for e in s.inputs:
                if e.issue == s.lookup_at:
                    e.issue = "root_forward"
            for e in s.outputs:  # all-to-alls stay in flight until the module's call; reduce-scatters do not
                e.wait = "module_call" if e.op == "all_to_all_single" else "root_forward"
            s.lookup_at = "root_forward"
            return (f"{module.path} starts at the root forward from {describe_path(module.root_input)}; its output "
                    f"and gradient all-to-alls overlap the dense compute in between")
        for e in s.inputs:
            e.issue = "previous_step"
        return (f"{module.path} distributes the next batch's input ({describe_path(module.batch_input, 'batch')} of "
                f"the announced batch) during this step")
