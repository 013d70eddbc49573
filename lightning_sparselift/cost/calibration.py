"""Measured increments: candidates are decided by F(T1) - F(T0), the change of a measured region
when the candidate is applied on top of the incumbent plan (the paper's lookahead calibration).

A :class:`Calibrator` runs one candidate's protocol step by step: ``warmup_pairs`` unmeasured
pairs, then ``measured_pairs`` pairs, a pair being one real training step on the incumbent (T0)
and one with the candidate (T1). A schedule whose effect spans two steps (work for step i+1
started during step i) needs ``settle_steps``: each observed step is preceded by that many
unmeasured steps on the same plan, so it sees the plan's steady state. Every rank measures; :func:`rank_consistent_increment` makes
the decision the same everywhere: each rank keeps the minimum of its observations, the decision
uses the maximum over ranks (a step is gated by its slowest rank).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist


class RegionClock:
    """Wall time spent inside measured regions (the lifted executor's forward chains and backward
    collectives) since the last :meth:`take`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms = 0.0

    @contextmanager
    def region(self) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.ms += (time.perf_counter() - start) * 1e3

    def take(self) -> float:
        ms, self.ms = self.ms, 0.0
        return ms


@dataclass
class CalibrationProtocol:
    """How a pass's candidates are measured (the paper's Table 5 budgets, warmup excluded)."""

    warmup_pairs: int = 1
    measured_pairs: int = 2
    region: str = "sparse"  # what F measures: "sparse" (the executor's regions) or "step" (whole step)
    settle_steps: int = 0  # unmeasured steps on the same plan before each observed one

    @property
    def steps(self) -> int:
        return 2 * (self.warmup_pairs + self.measured_pairs) * (1 + self.settle_steps)


@dataclass
class Measurement:
    candidate: str
    observations_ms: list[list[float]]  # per rank: F(T1) - F(T0) of each measured pair
    increment_ms: float  # the maximum over ranks of each rank's minimum: what the decision uses


class Calibrator:
    """Schedules T0/T1 steps for one candidate and collects its measured pairs."""

    def __init__(self, candidate: str, protocol: CalibrationProtocol) -> None:
        self.candidate = candidate
        self.protocol = protocol
        run = 1 + protocol.settle_steps
        # per step: (runs the candidate, observed); the last step of each run is observed
        self._schedule = [(uses, i == run - 1) for _ in range(protocol.warmup_pairs + protocol.measured_pairs)
                          for uses in (False, True) for i in range(run)]
        self._steps = 0
        self._observed: list[float] = []

    def next_uses_candidate(self) -> Optional[bool]:
        """Whether the next step runs T1 (True) or T0 (False); None once the protocol is done."""
        return self._schedule[self._steps][0] if self._steps < len(self._schedule) else None

    def record(self, f_ms: float) -> None:
        """The measured region of the step just run (ignored for settle steps)."""
        if self._schedule[self._steps][1]:
            self._observed.append(f_ms)
        self._steps += 1

    @property
    def done(self) -> bool:
        return self._steps == len(self._schedule)

    @property
    def recorded(self) -> int:
        """Steps run so far."""
        return self._steps

    def increments(self) -> list[float]:
        skip = 2 * self.protocol.warmup_pairs
        pairs = self._observed[skip:]
        return [pairs[i + 1] - pairs[i] for i in range(0, len(pairs), 2)]

    def measurement(self, group: Any) -> Measurement:
        return rank_consistent_increment(self.candidate, self.increments(), group)


def rank_consistent_increment(candidate: str, increments: list[float], group: Any) -> Measurement:
    local = torch.tensor(increments, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
    else:
        gathered = [local]
    per_rank = [g.tolist() for g in gathered]
    minima = [min(obs) for obs in per_rank]
    return Measurement(candidate, per_rank, max(minima))
