"""Latency hiding: overlap the sparse path's output and gradient all-to-alls with dense compute
that does not depend on them.

The dependency comes from capture: when a sparse module's input KJT was already among the root
forward's arguments (the same object, e.g. ``batch.sparse``, in every captured step on every
rank), nothing the model computes before the module's call can change it. The ``early_start``
schedule then runs the module's input distribution and lookups when the root forward begins and
leaves the output all-to-all in flight; the module's own call (later, e.g. after DLRM's bottom
MLP) only waits for it. Autograd replays that order backwards: the gradient all-to-all starts
where the wait was and is waited for just before the fused update, so the bottom MLP's backward
runs while it is in flight::

    before: root -> bottom MLP -> [input dist, lookups, output a2a, wait] -> interaction
    after:  root -> [input dist, lookups, issue output a2a] -> bottom MLP -> [wait] -> interaction

Feasibility: more than one rank; the module's input is a root argument (captured), else the pass
proposes nothing and says why; at least one table/column-wise group (row-wise reduce-scatters and
data-parallel groups stay synchronous). Cost inputs: the output and gradient all-to-all bytes
(their alpha-beta time is the most this can hide). Calibration: one warmup step, then two
complete-step observations per schedule (F = the whole training step). The data moved and the
arithmetic are unchanged: results stay bit-identical.
"""

from __future__ import annotations

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.cost.priors import Priors
from lightning_sparselift.lift import CollectiveNode, SparseGraph, member_bytes
from lightning_sparselift.passes import Candidate, OptimizationPass


def describe_path(path: list[list]) -> str:
    kind, key = path[0]
    text = f"args[{key}]" if kind == "arg" else f"kwargs[{key!r}]"
    for kind, key in path[1:]:
        text += f".{key}" if kind == "attr" else f"[{key!r}]"
    return text


class LatencyHiding(OptimizationPass):
    name = "latency_hiding"
    protocol = CalibrationProtocol(warmup_pairs=1, measured_pairs=2, region="step")

    def candidates(self, graph: SparseGraph) -> list[Candidate]:
        out = []
        for m in graph.modules:
            reasons = []
            if graph.world_size == 1:
                reasons.append("one rank: no all-to-all to hide")
            if m.root_input is None:
                reasons.append("the module's input was not among the root forward's arguments in the captured steps "
                               "(the model computes it), so it cannot start before the model reaches the module")
            if not any(g.sharding_type in ("table_wise", "column_wise") for g in m.groups):
                reasons.append("no table/column-wise group: nothing asynchronous to overlap")
            if "early_start" in m.schedules:
                reasons.append("already scheduled")
            hidden = [n for n in graph.collectives() if n.module == m.path and n.op == "all_to_all_single"
                      and n.role in ("output_pooled", "grad_pooled")]
            out.append(Candidate(self.name, f"early_start@{m.path}", m.path, "early_start", not reasons, reasons,
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
        m.schedules = sorted(set(m.schedules) | {"early_start"})
        for node in out.nodes:
            if isinstance(node, CollectiveNode) and node.module == m.path and node.op == "all_to_all_single":
                if node.role == "output_pooled":
                    node.layout += "; issued when the root forward begins, waited at the module call"
                elif node.role == "grad_pooled":
                    node.layout += "; started at the wait's backward, waited before the fused update"
        out.provenance.append(f"latency_hiding: {m.path} starts at the root forward from "
                              f"{describe_path(m.root_input)}; its output and gradient all-to-alls overlap the "
                              f"dense compute in between")
        return out
