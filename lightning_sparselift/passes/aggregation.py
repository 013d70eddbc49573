"""Communication aggregation: merge collectives with matching semantic roles into fewer, larger
ones.

Per sharded module, two candidates:

``input``: the input distribution's splits exchanges of every all-to-all group become one
all-to-all, and their lengths / values / weights payloads one byte-packed all-to-all (per
destination: the groups' values, then weights, then lengths, largest elements first so every
section stays aligned, the chunk padded to 8 bytes; the receiver knows every section's size from
the splits, so unpacking is exact and nothing is padded beyond the 7 alignment bytes)::

    before: splits(g0) splits(g1) | lengths(g0) values(g0) | lengths(g1) values(g1) weights(g1)
    after:  splits(g0+g1)         | payload(values g0,g1 | weights g1 | lengths g0,g1)

``output``: the pooled-embedding all-to-alls of the table-wise and column-wise groups become one
(per destination: its rows of every group in turn), and so do their backward gradient
all-to-alls::

    before: pooled(g0) pooled(g1)  ...  grad(g1) grad(g0)
    after:  pooled(g0+g1)          ...  grad(g0+g1)

Feasibility (the design table): every merged collective runs on the same process group; their
dtypes differ at most by element type (the packing is a lossless byte-level reinterpretation);
the layout mapping unpacks exactly (sizes per destination are known from the splits); the
collective order is fixed by the graph and identical on every rank (the fingerprint check).
Row-wise reduce-scatters are not all-to-alls and stay as they are. Cost inputs: the collectives
removed (alpha each) against the bytes packed and unpacked (two copies). Calibration: one
warmup pair, then two measured pairs per candidate, F = the executor's sparse regions.
Aggregation only moves bytes: results stay bit-identical.
"""

from __future__ import annotations

from lightning_sparselift.cost.calibration import CalibrationProtocol
from lightning_sparselift.cost.priors import Priors
from lightning_sparselift.lift import DTYPE_BYTES, CollectiveNode, LiftedModule, SparseGraph, member_bytes
from lightning_sparselift.passes import Candidate, OptimizationPass

_INPUT_ROLES = ("input_splits", "input_lengths", "input_values", "input_weights")
_POOLED = ("table_wise", "column_wise")


class CommunicationAggregation(OptimizationPass):
    name = "aggregation"
    roles = ("input", "output")
    protocol = CalibrationProtocol(warmup_pairs=1, measured_pairs=2, region="sparse")

    def candidates(self, graph: SparseGraph) -> list[Candidate]:
        out = []
        for m in graph.modules:
            out.append(self._input_candidate(graph, m))
            out.append(self._output_candidate(graph, m))
        return out

    def _nodes(self, graph: SparseGraph, module: str, roles: tuple[str, ...]) -> list[CollectiveNode]:
        return [n for n in graph.collectives() if n.module == module and n.role in roles]

    def _checks(self, nodes: list[CollectiveNode]) -> list[str]:
        reasons = []
        if len({n.process_group for n in nodes}) > 1:
            reasons.append(f"different process groups {sorted({n.process_group for n in nodes})}")
        unknown = sorted({n.dtype for n in nodes} - set(DTYPE_BYTES))
        if unknown:
            reasons.append(f"no lossless byte packing for dtype(s) {unknown}")
        return reasons

    def _input_candidate(self, graph: SparseGraph, m: LiftedModule) -> Candidate:
        nodes = self._nodes(graph, m.path, _INPUT_ROLES)
        reasons = self._checks(nodes)
        if "input" in m.aggregated:
            reasons.append("already aggregated")
        elif len(nodes) <= 2:
            reasons.append("no input all-to-all to merge" if not nodes else "already two collectives")
        copied = max(member_bytes([n for n in nodes if n.role != "input_splits"], graph.world_size), default=0)
        return Candidate(self.name, f"input@{m.path}", m.path, "input", not reasons, reasons,
                         {"collectives_removed": max(len(nodes) - 2, 0), "packed_bytes": copied})

    def _output_candidate(self, graph: SparseGraph, m: LiftedModule) -> Candidate:
        pooled = [g for g in m.groups if g.sharding_type in _POOLED]
        nodes = self._nodes(graph, m.path, ("output_pooled", "grad_pooled"))
        nodes = [n for n in nodes if n.op == "all_to_all_single"]
        reasons = self._checks(nodes)
        if "output" in m.aggregated:
            reasons.append("already aggregated")
        elif graph.world_size == 1:
            reasons.append("one rank: no output all-to-all")
        elif len(pooled) < 2:
            reasons.append(f"{len(pooled)} table/column-wise group(s): nothing to merge (row-wise reduce-scatters "
                           f"and data-parallel groups have no all-to-all)")
        copied = max(member_bytes(nodes, graph.world_size), default=0)
        return Candidate(self.name, f"output@{m.path}", m.path, "output", not reasons, reasons,
                         {"collectives_removed": max(len(nodes) - 2, 0), "packed_bytes": copied})

    def predict_ms(self, candidate: Candidate, priors: Priors) -> float:
        saved = candidate.cost_inputs["collectives_removed"] * priors.all_to_all.alpha_ms
        return -saved + priors.lookup.copy_ms(2 * candidate.cost_inputs["packed_bytes"])

    def apply(self, graph: SparseGraph, candidate: Candidate) -> SparseGraph:
        if not candidate.feasible:
            raise ValueError(f"{candidate.id} is not feasible: {candidate.reasons}")
        out = graph.copy()
        m = out.module(candidate.module)
        world = out.world_size
        if candidate.role == "input":
            splits = self._nodes(out, m.path, ("input_splits",))
            payload = self._nodes(out, m.path, _INPUT_ROLES[1:])
            merged = [
                self._merged(splits, f"{m.path}/input_splits", "input_splits", "int64",
                             "[dst][each group's lengths,values,(weights,)batch]",
                             member_bytes(splits, world), False),
                self._merged(payload, f"{m.path}/input_payload", "input_payload", "uint8",
                             "bytes per dst: values | weights | lengths of every group, 8-byte aligned",
                             self._payload_bytes(m, world), True),
            ]
            replaced = splits + payload
        else:
            pooled = self._nodes(out, m.path, ("output_pooled",))
            grads = [n for n in self._nodes(out, m.path, ("grad_pooled",)) if n.op == "all_to_all_single"]
            merged = [
                self._merged(pooled, f"{m.path}/output_pooled", "output_pooled", "float32",
                             "[dst sample block][each group's columns] -> per group concat by src rank",
                             member_bytes(pooled, world), False),
                self._merged(grads, f"{m.path}/grad_pooled", "grad_pooled", "float32",
                             "[dst][each group's columns of dst's samples] -> per group [src sample block], / world",
                             member_bytes(grads, world), False),
            ]
            replaced = pooled + grads
        self._replace(out, replaced, merged)
        m.aggregated = sorted(set(m.aggregated) | {candidate.role})
        out.provenance.append(f"aggregation: {candidate.role} collectives of {m.path} merged "
                              f"({len(replaced)} -> {len(merged)})")
        return out

    @staticmethod
    def _merged(nodes: list[CollectiveNode], node_id: str, role: str, dtype: str, layout: str,
                bytes_per_member: list[int], data_dependent: bool) -> CollectiveNode:
        first = nodes[0]
        after = sorted({d for n in nodes for d in n.after} - {n.id for n in nodes})
        return CollectiveNode(node_id, first.module, None, first.phase, first.op, role, first.process_group, dtype,
                              layout, first.order, bytes_per_member, data_dependent, after)

    @staticmethod
    def _payload_bytes(m: LiftedModule, world: int) -> list[int]:
        """Per member: its packed payload, each destination's chunk rounded up to 8 bytes."""
        lengths_size, values_size = DTYPE_BYTES[m.lengths_dtype], DTYPE_BYTES[m.values_dtype]
        groups = [g for g in m.groups if g.sharding_type in ("table_wise", "column_wise", "row_wise")]
        out = []
        for member in range(world):
            total = 0
            for dst in range(world):
                chunk = 0
                for g in groups:
                    ids = m.ids_to_each_rank(member, g, world)[dst]
                    keys = len(g.features) if g.sharding_type == "row_wise" else g.features_per_rank[dst]
                    chunk += ids * (values_size + (4 if m.weighted else 0))
                    chunk += keys * m.batch_size_per_rank[member] * lengths_size
                total += -(-round(chunk) // 8) * 8
            out.append(total)
        return out

    @staticmethod
    def _replace(graph: SparseGraph, old: list[CollectiveNode], new: list[CollectiveNode]) -> None:
        old_ids = {n.id for n in old}
        position = min(i for i, n in enumerate(graph.nodes) if n.id in old_ids)
        by_phase = {n.phase: n.id for n in new}
        nodes = [n for n in graph.nodes if n.id not in old_ids]
        for n in nodes:  # edges into a replaced node now point at its merged node
            n.after = sorted({by_phase.get(next(o.phase for o in old if o.id == d), d) if d in old_ids else d
                              for d in n.after})
        forward = [n for n in new if n.phase == "forward"]
        backward = [n for n in new if n.phase == "backward"]
        nodes[position:position] = forward
        if backward:
            first_backward = min(i for i, n in enumerate(graph.nodes) if n.id in old_ids and n.phase == "backward")
            kept_before = sum(1 for n in graph.nodes[:first_backward] if n.id not in old_ids)
            nodes[kept_before + len(forward):kept_before + len(forward)] = backward
        graph.nodes = nodes
        for order, node in enumerate(n for n in graph.nodes if isinstance(n, CollectiveNode)):
            node.order = order
