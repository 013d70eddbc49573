"""TorchRec's kernels of the input regions a generated kernel can replace (permute, bucketize,
recat), timed on each module's own shape at the start of a planning round (here, in the session,
which may run the runtime's kernels for the cost model). The step-time model
(:mod:`~lightning_sparselift.cost.step_model`) prices those regions with these times: bytes over
the copy bandwidth miss what they cost, mostly fixed costs per call and per key (a KJT permute of
26 one-hot keys, 107 kB: 0.29 ms here, the bytes 0.01 ms), so it predicted the generated input
kernel's gain 5-15x too small.

Each rank times its own shapes (its batch, the ids its members feed), on synthetic data of the
captured sizes, on its training thread's CPU clock; the times are gathered so that every rank
plans from the same inputs."""

from __future__ import annotations

import time
import warnings
from statistics import median
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from lightning_sparselift.ir.schedule import INPUT_REGIONS
from lightning_sparselift.ir.steps import ComputeNode

if TYPE_CHECKING:
    from lightning_sparselift.ir import LiftedModule, SparseGraph

_REPS = 5  # timed calls per region, after one that warms up: the median


def measure_reference_inputs(graph: SparseGraph, rank: int, device: torch.device,
                             group: Any = None) -> dict[str, list[float]]:
    """Per input-region node id of ``graph`` (its generated kernel may still be building), per
    rank: the thread CPU ms of TorchRec's kernel for it on that rank's shape (without a process group:
    every rank's shape, timed here). Nothing on an accelerator, where the training thread only
    launches these regions (the model's ``launch_ms``)."""
    if device.type != "cpu":
        return {}
    world = graph.world_size
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list[dict[str, float]] = [{} for _ in range(world)]
        dist.all_gather_object(everyone, _measure(graph, rank), group=group)
    else:
        everyone = [_measure(graph, r) for r in range(world)]
    timed = set.intersection(*(set(ranks) for ranks in everyone))
    return {node_id: [ranks[node_id] for ranks in everyone] for node_id in sorted(timed)}


def _measure(graph: SparseGraph, rank: int) -> dict[str, float]:
    out = {}
    for node in graph.nodes:
        if not isinstance(node, ComputeNode) or node.op not in INPUT_REGIONS:
            continue
        try:  # (an estimate: a shape the probe cannot make up must not stop the training)
            out[node.id] = _time(_reference_call(graph.module(node.module), node, rank, graph.world_size))
        except Exception as e:
            warnings.warn(f"SparseLift: TorchRec's {node.op} kernel of {node.id} could not be timed on rank {rank}'s "
                          f"shape ({type(e).__name__}: {e}); the step-time model prices the region by its bytes")
    return out


def _time(call: Callable[[], Any]) -> float:
    times = []
    for _ in range(_REPS + 1):
        start = time.thread_time()
        call()
        times.append((time.thread_time() - start) * 1e3)
    return float(median(times[1:]))


def _reference_call(m: LiftedModule, node: ComputeNode, rank: int, world: int) -> Callable[[], Any]:
    """TorchRec's kernel of the input region ``node`` on synthetic data of ``rank``'s shape."""
    from lightning_sparselift.runtime.kernels import bucketize_fbgemm, permute_torchrec, recat_fbgemm, recat_order

    batch = m.batch_size_per_rank[rank]
    stats = m.ids_per_step[rank]
    if node.op == "permute":
        features = _features(m, m.keys, batch, stats)
        order = torch.tensor(m.feature_order, dtype=torch.int32)
        return lambda: permute_torchrec(features, m.feature_order, order).split([len(m.feature_order)])
    (i,) = node.groups
    g = m.groups[i]
    if node.op == "bucketize":
        features = _features(m, g.features, batch, stats, rows=sum(g.block_sizes) * world)
        blocks = torch.tensor(g.block_sizes, dtype=torch.int64)
        return lambda: bucketize_fbgemm(features, blocks, world, not m.pooled)
    if node.op == "recat":
        # what arrived from every rank, [src][key][sample]: the rank's keys (row-wise: every key's
        # block of ids), the ids its lookups read; every rank's batch this rank's (ranks that pass
        # different batch sizes never reach the recat)
        keys = g.keys_on_rank(rank)
        sent = [m.ids_to_each_rank(src, g, world)[rank] for src in range(world)]
        arrived = [_features(m, keys, batch, _spread(keys, sent[src])) for src in range(world)]
        lengths = torch.cat([f.lengths() for f in arrived])
        values = torch.cat([f.values() for f in arrived])
        weights = torch.cat([f.weights() for f in arrived]) if m.weighted else None
        recat = recat_order(len(keys), world)
        return lambda: recat_fbgemm(keys, recat, lengths, values, weights, batch, world).offsets()
    raise ValueError(f"no reference call for the input region {node.op!r}")


def _spread(keys: list[str], ids: float) -> dict[str, float]:
    return {k: ids / max(len(keys), 1) for k in keys}


def _features(m: LiftedModule, keys: list[str], batch: int, ids: dict[str, float], rows: int = 1 << 20) -> Any:
    """A KJT of ``keys`` over ``batch`` samples holding about ``ids[key]`` ids per key (bags of
    the mean length, the remainder one id longer), ids below ``rows``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(0)
    lengths = []
    for key in keys:
        total = max(round(ids.get(key, 0.0)), 0)
        bag, extra = divmod(total, max(batch, 1))
        lengths.append(torch.full((batch,), bag, dtype=torch.int64) + (torch.arange(batch) < extra))
    length = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int64)
    count = int(length.sum())
    values = torch.randint(0, max(rows, 1), (count,), generator=generator, dtype=getattr(torch, m.values_dtype))
    weights = torch.rand(count, generator=generator) if m.weighted else None
    return KeyedJaggedTensor(keys=list(keys), values=values, weights=weights,
                             lengths=length.to(getattr(torch, m.lengths_dtype)), stride=batch)
