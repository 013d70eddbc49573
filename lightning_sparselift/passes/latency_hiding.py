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
``early_start`` needs a table/column-wise group (row-wise reduce-scatters and data-parallel
groups stay synchronous), ``next_batch`` an exchanged (non data-parallel) group. Cost inputs: the
bytes of the collectives each schedule takes off the critical path (their alpha-beta time is the
most it can hide). Calibration: one warmup pair, then two complete-step observations per plan,
each after one settle step on the same plan (``next_batch`` acts across two steps). The data
moved and the arithmetic are unchanged: results stay bit-identical.
"""

from __future__ import annotations

from lightning_sparselift.capture import describe_path
from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.cost.priors import Priors
from lightning_sparselift.lift import CollectiveNode, SparseGraph, member_bytes
from lightning_sparselift.passes import Candidate, OptimizationPass

# the input distribution's payload all-to-alls (the splits exchange stays synchronous: their sizes depend on it)
_PREFETCHED_ROLES = ("input_lengths", "input_values", "input_weights", "input_payload")


class LatencyHiding(OptimizationPass):
    name = "latency_hiding"
    roles = ("early_start", "next_batch")
    protocol = CalibrationProtocol(warmup_pairs=1, measured_pairs=2, region="step", settle_steps=1)

    def candidates(self, graph: SparseGraph) -> list[Candidate]:
        out = []
        for m in graph.modules:
            for schedule in self.roles:
                reasons = ["one rank: no all-to-all to hide"] if graph.world_size == 1 else []
                if schedule == "early_start":
                    if m.root_input is None:
                        reasons.append("the module's input was not among the root forward's arguments in the captured "
                                       "steps (the model computes it), so it cannot start before the model reaches "
                                       "the module")
                    if not any(g.sharding_type in ("table_wise", "column_wise") for g in m.groups):
                        reasons.append("no table/column-wise group: nothing asynchronous to overlap")
                    hidden_roles = ("output_pooled", "grad_pooled")
                else:
                    if m.batch_input is None:
                        reasons.append(m.next_batch_note)
                    if all(g.sharding_type == "data_parallel" for g in m.groups):
                        reasons.append("only data-parallel groups: no input distribution")
                    hidden_roles = _PREFETCHED_ROLES
                if schedule in m.schedules:
                    reasons.append("already scheduled")
                hidden = [n for n in graph.collectives() if n.module == m.path and n.op == "all_to_all_single"
                          and n.role in hidden_roles]
                out.append(Candidate(self.name, f"{schedule}@{m.path}", m.path, schedule, not reasons, reasons,
                                     {"hidden_bytes": max(member_bytes(hidden, graph.world_size), default=0),
                                      "hidden_collectives": len(hidden)}))
        return out

    def predict_ms(self, candidate: Candidate, priors: Priors) -> float:
        a2a = priors.all_to_all
        return -(candidate.cost_inputs["hidden_collectives"] * a2a.alpha_ms
                 + candidate.cost_inputs["hidden_bytes"] * a2a.beta_ms_per_byte)

    def apply(self, graph: SparseGraph, candidate: Candidate) -> SparseGraph:
        if not candidate.feasible:
            raise ValueError(f"{candidate.id} is not feasible: {candidate.reasons}")
        out = graph.copy()
        m = out.module(candidate.module)
        m.schedules = sorted(set(m.schedules) | {candidate.role})
        notes = {"output_pooled": "; issued when the root forward begins, waited at the module call",
                 "grad_pooled": "; started at the wait's backward, waited before the fused update"} \
            if candidate.role == "early_start" else \
            {role: "; for the next batch, issued after this step's module call, waited when the next step starts"
             for role in _PREFETCHED_ROLES}
        for node in out.nodes:
            if isinstance(node, CollectiveNode) and node.module == m.path and node.role in notes:
                node.layout += notes[node.role]
        if candidate.role == "early_start":
            out.provenance.append(f"latency_hiding: {m.path} starts at the root forward from "
                                  f"{describe_path(m.root_input)}; its output and gradient all-to-alls overlap the "
                                  f"dense compute in between")
        else:
            out.provenance.append(f"latency_hiding: {m.path} distributes the next batch's input "
                                  f"({describe_path(m.batch_input, 'batch')} of the announced batch) during this step")
        return out
