"""The graph for people: ``explain`` (text) and ``to_dot`` (Graphviz)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_sparselift.kjt import describe_path
from lightning_sparselift.ir.schedule import bucket_label, describe_buckets
from lightning_sparselift.ir.steps import CollectiveNode
from lightning_sparselift.ir.vocab import COLUMN_SHARDED, ROW_SHARDED

if TYPE_CHECKING:
    from lightning_sparselift.ir.graph import LiftedModule, SparseGraph

# what each collective role carries, in which layout
ROLE_LAYOUTS = {
    "input_splits": "[dst][each group's lengths,values,(weights,)batch]",
    "input_lengths": "[dst][key][sample] -> recat to [key][src][sample]",
    "input_values": "ids by [dst][key][sample] -> recat to [key][src][sample]",
    "input_weights": "as input_values",
    "input_payload": "bytes per dst: values | weights | lengths of every group, aligned",
    "output_pooled": "[dst sample block][each group's columns] -> per group concat by src rank (+ column order)",
    "grad_pooled": "[dst][each group's columns of dst's samples] -> [src sample block], / world",
    "output_sequence": "rows [key][src][sample] -> [src][key][sample] -> rows of each dst's ids in its key order "
                       "(row-wise: unbucketized)",
    "grad_sequence": "row gradients by [src] -> [key][src][sample]",
    "output_partial_sums": "[dst sample block][columns], summed over members",
    "grad_all_gather": "[src sample block][columns], / world",
    "dp_table_grad": "full table gradients (DDP buckets)",
    "dense_grad": "dense gradients (DDP buckets)",
}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n}"


def explain(graph: "SparseGraph") -> str:
    threads = (f" ({'/'.join(map(str, graph.threads_per_rank))} intra-op thread(s) per rank)"
               if graph.threads_per_rank else "")
    if graph.device != "cpu":
        threads += f", tables on {graph.device}"
    if graph.workspace_budget_bytes is not None:
        threads += f", workspace budget {human_bytes(graph.workspace_budget_bytes)} per rank"
    if graph.incumbent_buckets:
        threads += ", planned from lookups in " + ", ".join(f"{g} buckets ({path})"
                                                           for path, g in graph.incumbent_buckets.items())
    lines = [f"SparseGraph (SRSV) v{graph.version}: {graph.world_size} rank(s){threads}, backend {graph.backend}, "
             f"fingerprint {graph.fingerprint()}"]
    lines += [f"pass applied: {p}" for p in graph.provenance]
    for m in graph.modules:
        lines += _module(m)
    lines += [f"module {path}: not lifted, TorchRec's path: {why}" for path, why in graph.not_lifted.items()]
    lines.append("step (collectives in issue order; bytes = what each member puts in):")
    nodes = graph.nodes
    for phase in ("forward", "backward"):
        for n in nodes:
            if n.phase != phase:
                continue
            where = n.module.split(".")[-1] + ("/" + "+".join(f"g{g}" for g in n.groups) if n.groups else "")
            if isinstance(n, CollectiveNode):
                approx = "~" if n.data_dependent else ""
                sizes = ",".join(approx + human_bytes(b) for b in n.bytes_per_member)
                timing = f"at {n.issue}" if n.issue == n.wait else f"issued {n.issue}, waited {n.wait}"
                lines.append(f"  {phase[:3]} #{n.order:<3d} {n.op:<17s} {n.role:<22s} {where:<28s} {n.dtype:<7s} "
                             f"{sizes}  {timing}; {ROLE_LAYOUTS[n.role]}")
            else:
                rank = "every rank" if n.rank is None else f"rank {n.rank}"
                work = ", ".join(f"{k}={v:,.0f}" for k, v in n.workload.items())
                lines.append(f"  {phase[:3]}      {n.op:<17s} {rank:<22s} {where:<28s} {work} [{n.kernel}]"
                             + (f", workspace {human_bytes(n.workspace_bytes)}" if n.workspace_bytes else ""))
    collectives = graph.collectives()
    total = sum(sum(n.bytes_per_member) for n in collectives)
    lines.append(f"{len(collectives)} collectives per step, {human_bytes(total)} put in by all members; "
                 f"dense parameters {human_bytes(graph.dense_param_bytes)}")
    kept = [f"{m.path}/g{g.index}" for m in graph.modules for g in m.groups if g.not_lifted]
    if kept:
        lines.append(f"(and the collectives TorchRec's modules issue for {', '.join(kept)}: not lifted)")
    return "\n".join(lines)


def _module(m: "LiftedModule") -> list[str]:
    batch = ",".join(map(str, sorted(set(m.batch_size_per_rank))))
    kind = "pooled" if m.pooled else "sequence (one row per id, a JaggedTensor per feature)"
    lines = [f"module {m.path}: {kind}, {len(m.keys)} features, {'weighted' if m.weighted else 'unweighted'}, "
             f"batch {batch}/rank, ids {m.lengths_dtype}/{m.values_dtype}"
             + ("" if not m.feature_order else ", keys permuted into group order")
             + ("" if not m.mean_after_reduce else ", output divided by bag lengths after the reduce-scatter "
                "(TorchRec's row-wise mean pooling)")]
    if m.root_input is not None:
        lines.append(f"  input available when the root forward begins: {describe_path(m.root_input)}")
    if m.batch_input is not None:
        lines.append(f"  input found in the batch the loop announces as next: {describe_path(m.batch_input, 'batch')}")
    if m.consumer is not None:
        lines.append(f"  output concatenated by the model: {len(m.consumer.keys)} keys in one torch.cat, after "
                     f"{m.consumer.before} and before {m.consumer.after} columns of other operands")
    elif m.pooled:
        lines.append(f"  output not concatenated as a whole: {m.consumer_note}")
    for g in m.groups:
        lines.append(f"  group {g.index} {g.sharding_type}: {len(g.features)} keys, {sum(g.embedding_dims)} output columns")
        if g.not_lifted:
            lines.append(f"    runs TorchRec's input dist, lookup and output dist of the group: {g.not_lifted}")
        by_rank: dict[Any, list[str]] = {}
        for t in g.tables:
            part = f"{t.table}[{t.rows}x{t.dim}"
            if g.sharding_type in ROW_SHARDED:
                part += f" rows {t.row_offset}+"
            if g.sharding_type in COLUMN_SHARDED:
                part += f" cols {t.col_offset}+"
            by_rank.setdefault("all" if t.rank is None else t.rank, []).append(part + "]")
        for rank, parts in by_rank.items():
            lines.append(f"    rank {rank}: " + ", ".join(parts))
    s = m.schedule
    lines.append(f"  schedule: lookups at {s.lookup_at}")
    for e in s.inputs:
        lines.append(f"    input  {e.label:<10s} {e.packing:<10s} issued {e.issue} on {e.process_group}"
                     + (f", stream {e.stream}" if e.stream else ""))
    split = {g: e for e in s.outputs if e.split for g in e.groups}
    for e in s.outputs:
        on = f"one per bucket on {', '.join(e.split)}" if e.split else f"on {e.process_group}"
        lines.append(f"    output {e.label:<10s} {e.op:<17s} waited {e.wait} {on}"
                     + (f", stream {e.stream}" if e.stream else ""))
    if s.wire:
        lines.append(f"    wire: {', '.join(f'{role}={name}' for role, name in sorted(s.wire.items()))} "
                     f"(communication precision, numerics='fast')")
    kernels = sorted({f"{r.name}={r.kernel}" for r in s.regions})
    lines.append(f"    kernels: {', '.join(kernels)}")
    for r in s.regions:
        if r.buckets:
            how = "pipelined" if any(g in split for g in r.groups) else "concurrent"
            lines.append(f"    {r.name} {bucket_label(r.groups)} in {len(r.buckets)} {how} buckets: "
                         + describe_buckets(r.buckets))
    for g in m.groups:
        for name, note in sorted(g.lookup_notes.items()):
            lines.append(f"    g{g.index} has no {name} lookup kernel: {note}")
    return lines


def to_dot(graph: "SparseGraph") -> str:
    """Graphviz source of the step (``dot -Tpng``)."""
    out = ["digraph srsv {", "  rankdir=TB; node [fontname=Helvetica, fontsize=10];"]
    for n in graph.nodes:
        if isinstance(n, CollectiveNode):
            label = f"{n.op}\\n{n.role}\\n{human_bytes(max(n.bytes_per_member))}/member"
            out.append(f'  "{n.id}" [shape=box, style=filled, fillcolor="#ffd9a0", label="{label}"];')
        else:
            rank = "" if n.rank is None else f" r{n.rank}"
            out.append(f'  "{n.id}" [shape=ellipse, label="{n.op}{rank}"];')
        for dep in n.after:
            out.append(f'  "{dep}" -> "{n.id}";')
    out.append("}")
    return "\n".join(out)
