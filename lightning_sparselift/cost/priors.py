"""The machine's constants the step-time model (:mod:`.step_model`) reads, from short
micro-benchmarks at the start of a planning round: an alpha-beta fit of the all-to-all, the copy
bandwidth and the cores per rank. The model's predictions order the candidates; measurements decide
(:mod:`lightning_sparselift.cost.calibration`)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

# payload sizes of the all-to-all micro-benchmark without a graph (bytes per member)
_PROBE_BYTES = (256, 16 * 1024, 256 * 1024, 2 * 1024 * 1024)
_PROBE_REPS = 7
_MOST_PROBES = 6


@dataclass
class AlphaBeta:
    """t(bytes) = alpha_ms + bytes * beta_ms_per_byte, for one collective on one process group."""

    op: str
    process_group: str
    alpha_ms: float
    beta_ms_per_byte: float
    samples: list[tuple[int, float]]  # (bytes per member, slowest rank's median ms)

    def predict_ms(self, nbytes: float) -> float:
        return self.alpha_ms + nbytes * self.beta_ms_per_byte


@dataclass
class LookupModel:
    """The copy bandwidth (a read and a write per byte): what the step-time model prices its
    compute with (:meth:`~.step_model.StepModel.copy_ms`)."""

    bandwidth_bytes_per_ms: float


@dataclass
class Priors:
    all_to_all: AlphaBeta
    lookup: LookupModel
    seconds: float  # time the micro-benchmarks took
    cores_per_rank: float = 1.0  # the cores of a rank's host over the ranks on it (the fewest of any rank)


def _fit(samples: list[tuple[int, float]]) -> tuple[float, float]:
    x = torch.tensor([float(b) for b, _ in samples], dtype=torch.float64)
    y = torch.tensor([t for _, t in samples], dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    alpha, beta = torch.linalg.lstsq(design, y.unsqueeze(1)).solution.squeeze(1).tolist()
    return max(alpha, 0.0), max(beta, 0.0)


def _slowest(values: list[float], group: Any) -> list[float]:
    """Element-wise maximum over ranks (a collective is as slow as its slowest member), so every
    rank fits the same model."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def probe_sizes(graph_bytes: Sequence[int], most: int = _MOST_PROBES) -> list[int]:
    """The all-to-all payloads to time: the smallest of ``_PROBE_BYTES`` (the latency) and up to
    ``most - 1`` of the graph's own (bytes per member), spread from its smallest to its largest."""
    sizes = sorted({int(b) for b in graph_bytes if b > 0} | {_PROBE_BYTES[0]})
    if len(sizes) <= most:
        return sizes
    picks = {round(i * (len(sizes) - 1) / (most - 1)) for i in range(most)}
    return [sizes[i] for i in sorted(picks)]


def measure_priors(group: Any, device: torch.device, sizes: Sequence[int] = _PROBE_BYTES) -> Priors:
    """Fit the priors on this machine: per size (bytes per member, e.g. :func:`probe_sizes` of
    the graph's collectives), ``_PROBE_REPS`` all-to-alls, each after a barrier (so a rank's time is
    the transfer, not its wait for the others), the median per rank and the slowest rank's; and
    one large copy for the memory bandwidth."""
    start = time.perf_counter()
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    medians = []
    for nbytes in sizes:
        send = torch.zeros(max(nbytes // 4 // world, 1) * world, dtype=torch.float32, device=device)
        recv = torch.empty_like(send)
        times = []
        for _ in range(_PROBE_REPS + 1):
            if world > 1:
                dist.barrier(group=group)
            t0 = time.perf_counter()
            if world > 1:
                dist.all_to_all_single(recv, send, group=group)
            else:
                recv.copy_(send)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        medians.append(float(torch.tensor(times[1:]).median()))  # the first one warms up
    medians = _slowest(medians, group)
    samples = [(send_bytes, t) for send_bytes, t in zip(sizes, medians)]
    alpha, beta = _fit(samples)
    source = torch.ones(8 * 1024 * 1024, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    copies = []
    for _ in range(3):
        t0 = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        copies.append((time.perf_counter() - t0) * 1e3)
    copy_ms = _slowest([min(copies)], group)[0]
    bandwidth = 2 * source.numel() * 4 / max(copy_ms, 1e-6)
    cores = -_slowest([-_cores_per_rank(group, world)], group)[0]
    return Priors(AlphaBeta("all_to_all_single", f"world[{world}]", alpha, beta, samples), LookupModel(bandwidth),
                  time.perf_counter() - start, cores)


def measure_step_latency(group: Any, compute_ms: Sequence[float] = (0.5, 1.0, 2.0), reps: int = 32) -> float:
    """The all-to-all's latency as a training step meets it (ms, the slowest rank's): the smallest
    probe payload issued after compute on every rank (``reps`` times after each of
    ``compute_ms``), as a step issues its exchanges after the lookups or the dense layers, not
    after a barrier as :func:`measure_priors` times it. Where the ranks share cores the backend's
    threads sleep while the ranks compute and the collective must wake them, and a rank the OS
    preempted arrives a compute period late: here from 0.05 ms (as back to back) to 2.5 ms, the
    median anywhere in 0.13-1.2 ms from one probe to the next. A step's collectives add up, so
    the mean is what a step pays (a tenth at each end left out: another tenant's burst; 0.5-1.5
    ms here from one probe to the next)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return 0.0
    send = torch.zeros(max(_PROBE_BYTES[0] // 4 // world, 1) * world)
    recv, work = torch.empty_like(send), torch.ones(64, 64)
    times = []
    for gap in compute_ms:
        for rep in range(reps + 1):
            end = time.perf_counter() + gap / 1e3
            while time.perf_counter() < end:
                work = torch.tanh(work @ work)
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            if rep:  # (the first after a change of gap settles the ranks)
                times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    cut = len(times) // 10
    kept = times[cut:len(times) - cut]
    return _slowest([sum(kept) / len(kept)], group)[0]


def _cores_per_rank(group: Any, world: int) -> float:
    """The cores this process may run on over the ranks on its host (ranks grouped by host name)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    hosts: list[Any] = [socket.gethostname()]
    if world > 1:
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return max(cores / hosts.count(socket.gethostname()), 1.0) if cores else 1.0
