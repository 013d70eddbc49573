"""Communication aggregation: merge collectives with matching semantic roles into fewer, larger
ones.

Per sharded module, two candidates; each merges the module's exchange buckets into one:

``input``: the input distribution's splits exchanges of every all-to-all group become one
all-to-all, and their lengths / values / weights payloads one byte-packed all-to-all (per
destination: the groups' values, then weights, then lengths, largest elements first so every
section stays aligned, the chunk padded to 8 bytes; the receiver knows every section's size from
the splits, so unpacking is exact and nothing is padded beyond the alignment)::

    before: splits(g0) splits(g1) | lengths(g0) values(g0) | lengths(g1) values(g1) weights(g1)
    after:  splits(g0+g1)         | payload(values g0,g1 | weights g1 | lengths g0,g1)

``output``: the pooled-embedding all-to-alls of the table-wise and column-wise groups become one
(per destination: its rows of every group in turn), and so do their backward gradient
all-to-alls; an EmbeddingCollection's row all-to-alls (every exchanged group, row-wise included)
merge the same way::

    before: pooled(g0) pooled(g1)  ...  grad(g1) grad(g0)
    after:  pooled(g0+g1)          ...  grad(g0+g1)

Feasibility (the design table): every merged collective runs on the same process group; their
dtypes differ at most by element type (every dtype a graph names has a size in the vocabulary, and
the packing is a lossless byte-level reinterpretation);
the layout mapping unpacks exactly (sizes per destination are known from the splits); the
collective order is fixed by the graph and identical on every rank (the fingerprint check).
Row-wise reduce-scatters are not all-to-alls and stay as they are. Cost inputs: the collectives
removed (alpha each) against the bytes packed and unpacked (two copies). Calibration: one
warmup pair, then two measured pairs per candidate, F = the executor's sparse regions.
Aggregation only moves bytes: results stay bit-identical.
"""

from __future__ import annotations

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.ir import InputExchange, LiftedModule, OutputExchange, SparseGraph, member_bytes
from lightning_sparselift.passes.base import Candidate, OptimizationPass

_ROLES = {"input": ("input_splits", "input_lengths", "input_values", "input_weights", "input_payload"),
          "output": ("output_pooled", "grad_pooled", "output_sequence", "grad_sequence")}


class CommunicationAggregation(OptimizationPass):
    name = "aggregation"
    roles = ("input", "output")
    protocol = CalibrationProtocol(warmup_pairs=1, region="sparse")

    def check(self, graph: SparseGraph, module: LiftedModule, role: str) -> tuple[list[str], dict[str, float]]:
        s = module.schedule
        buckets = s.inputs if role == "input" else [e for e in s.outputs if e.op == "all_to_all_single"]
        nodes = [n for n in graph.collectives() if n.module == module.path and n.role in _ROLES[role]]
        reasons = []
        if graph.world_size == 1:
            reasons.append("one rank: nothing is exchanged")
        elif role == "input" and not buckets:
            reasons.append("no input all-to-all to merge")
        elif role == "input" and len(buckets) == 1 and buckets[0].packing == "bytes":
            reasons.append("already aggregated")
        elif role == "input" and len(nodes) <= 2:
            reasons.append("already two collectives")
        elif role == "output" and len(buckets) < 2:
            reasons.append("already aggregated" if buckets and len(buckets[0].groups) > 1 else
                           f"{len(buckets)} output all-to-all bucket(s): nothing to merge (row-wise reduce-scatters "
                           f"and data-parallel groups have no all-to-all)")
        int8 = sorted(r for r, f in module.wire.items() if f == "int8") if role == "output" else []
        if int8:
            reasons.append(f"TorchRec's INT8 codec quantizes rows of 32 values of each exchange's own send buffer "
                           f"({', '.join(int8)}): a merged buffer would group other values")
        split = [e.label for e in s.outputs if e.split] if role == "output" else []
        if split:
            reasons.append(f"output {', '.join(split)} runs one all-to-all per bucket of its lookups, pipelined "
                           f"(subgraph parallelism): merging would undo it")
        if len({(e.process_group, e.stream) for e in buckets}) > 1:
            reasons.append(f"different process groups/streams {sorted({(e.process_group, e.stream or '') for e in buckets})}")
        points = {e.issue for e in buckets} if role == "input" else {e.wait for e in buckets}
        if len(points) > 1:
            reasons.append(f"buckets {'issued' if role == 'input' else 'waited'} at different points {sorted(points)}")
        copied = [n for n in nodes if n.role != "input_splits"]
        return reasons, {"collectives_removed": max(len(nodes) - 2, 0),
                         "packed_bytes": max(member_bytes(copied, graph.world_size), default=0)}

    def rewrite(self, graph: SparseGraph, module: LiftedModule, candidate: Candidate) -> str:
        s = module.schedule
        before = len([n for n in graph.collectives() if n.module == module.path and n.role in _ROLES[candidate.role]])
        if candidate.role == "input":
            first = s.inputs[0]
            s.inputs = [InputExchange(sorted(g for e in s.inputs for g in e.groups), "bytes", first.issue,
                                      process_group=first.process_group, stream=first.stream)]
        else:
            pooled = [e for e in s.outputs if e.op == "all_to_all_single"]
            merged = OutputExchange(sorted(g for e in pooled for g in e.groups), "all_to_all_single", pooled[0].wait,
                                    process_group=pooled[0].process_group, stream=pooled[0].stream)
            s.outputs = [merged] + [e for e in s.outputs if e.op != "all_to_all_single"]
        after = len([n for n in graph.collectives() if n.module == module.path and n.role in _ROLES[candidate.role]])
        return f"{candidate.role} collectives of {module.path} merged ({before} -> {after})"
