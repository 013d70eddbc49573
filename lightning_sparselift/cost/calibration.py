"""Measured increments: candidates are decided by F(T1) - F(T0), the change of a measured region
when the candidate is applied on top of the incumbent plan (the paper's lookahead calibration).

Here: the clocks that measure a step's regions (:class:`RegionClock`), how a pass's candidates
are measured (:class:`CalibrationProtocol`: ``warmup_pairs`` unmeasured blocks, the region, and
``settle_steps`` for a schedule whose effect spans two steps, e.g. work for step i+1 started
during step i: each observed step is preceded by that many unmeasured steps on the same plan, so
it sees the plan's steady state), and paired steps of two plans judged across ranks
(:class:`PairedSteps`, :func:`judge_pairs`: the steady-state check). Candidates are measured
several at once by :mod:`~lightning_sparselift.cost.design`; every rank measures, and the
decision is the same everywhere (see :mod:`~lightning_sparselift.cost.decision`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist

from lightning_sparselift.cost.decision import DecisionRule, PairedEstimate, paired_estimate

# the autograd nodes of a concatenation and the views it reads (split, narrow, as_subclass), and of
# those the ones whose backward copies (the others' hooks would only add their own cost)
_VIEW_NODES = ("Cat", "Split", "Slice", "Narrow", "Alias", "View")
_COPYING_NODES = ("Cat", "Split", "Slice", "Narrow")


class RegionClock:
    """Wall time spent inside measured regions (the lifted executor's forward chains and backward
    collectives) since the last :meth:`take`; and, apart, the lookup regions' own time (the lookup
    kernels' forward calls and their backward nodes, fused update included) since the last
    :meth:`take_lookup`: on CPU both the training thread's CPU time, which the other rank's work
    and the collectives' waits do not add noise to, and the wall time, which is what counts once a
    lookup runs buckets on threads of their own; the input side's work (permute, splits,
    issuing the payload, recat) on the same clock since the last :meth:`take_input`; and the
    output layouts' packing and unpacking copies on that clock (:meth:`exchange`), which with the
    CPU time of every other thread of the process (on CPU: the collectives' threads, gloo's) make
    a step's ``exchange_cpu``, and with the model's concatenations of a module's values
    (:meth:`concatenation`, while :attr:`times_concatenations`) its ``layout_cpu``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms = 0.0
        self.lookup_ms = 0.0
        self.lookup_wall_ms = 0.0
        self.input_ms = 0.0
        self.exchange_ms = 0.0
        self.concatenation_ms = 0.0
        # whether the reference output's concatenations are timed (runtime/consumer_layout.py):
        # while a design measures on ``layout_cpu`` (on other steps the model's code runs untouched)
        self.times_concatenations = False
        self._node_start: dict[int, tuple[float, float]] = {}
        self._step_start = (0.0, 0.0, 0.0)  # (wall, thread CPU, process CPU) at start_step

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

    def _now(self) -> tuple[float, float]:
        """(the lookup clock: thread CPU on CPU, synchronized wall time on CUDA; wall time), in ms."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            wall = time.perf_counter() * 1e3
            return wall, wall
        return time.thread_time() * 1e3, time.perf_counter() * 1e3

    def _add_lookup(self, start: tuple[float, float]) -> None:
        end = self._now()
        self.lookup_ms += end[0] - start[0]
        self.lookup_wall_ms += end[1] - start[1]

    @contextmanager
    def lookup(self) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._add_lookup(start)

    def lookup_backward(self, out: torch.Tensor) -> None:
        """Count the backward of the lookup that made ``out``: its autograd node, through the
        views and concatenation on its way (an EmbeddingCollection's rows are a view of the flat
        outputs of its table-batched modules, concatenated) to the lookups' own nodes."""
        self._time_nodes(_nodes_below(out, ("Cat", "View")), self._add_lookup)

    def _time_nodes(self, nodes: list[Any], add: Callable[[tuple[float, float]], None]) -> None:
        """Each autograd node's run (from its pre-hook to its hook) added by ``add`` from its start."""
        for n in nodes:
            n.register_prehook(lambda *_, key=id(n): self._node_start.__setitem__(key, self._now()))
            n.register_hook(lambda *_, key=id(n): self._node_done(key, add))

    def _node_done(self, key: int, add: Callable[[tuple[float, float]], None]) -> None:
        start = self._node_start.pop(key, None)
        if start is not None:
            add(start)

    def take_lookup(self) -> tuple[float, float]:
        """(lookup clock ms, lookup wall ms) since the last call."""
        taken = (self.lookup_ms, self.lookup_wall_ms)
        self.lookup_ms = self.lookup_wall_ms = 0.0
        return taken

    @contextmanager
    def input(self) -> Iterator[None]:
        start = self._now()[0]
        try:
            yield
        finally:
            self.input_ms += self._now()[0] - start

    def take_input(self) -> float:
        """The input side's ms on the lookup clock since the last call."""
        taken, self.input_ms = self.input_ms, 0.0
        return taken

    def exchange(self) -> ContextManager[None]:
        """An output layout's packing or unpacking copy (on CUDA not timed: ``exchange_cpu`` is the
        step's wall time there)."""
        return self._thread_cpu("exchange_ms")

    def concatenation(self) -> ContextManager[None]:
        """The model's concatenation of a module's values: the reference output's (its groups'
        outputs into the KeyedTensor's values, and the model's ``torch.cat`` of the keys' views), or
        the consumer layout's writing of the concatenation's other operands (on CUDA not timed:
        ``layout_cpu`` is the step's wall time there)."""
        return self._thread_cpu("concatenation_ms")

    @contextmanager
    def _thread_cpu(self, total: str) -> Iterator[None]:
        """The training thread's CPU time inside, added to the attribute ``total`` (on CUDA nothing)."""
        if self.device.type == "cuda":
            yield
            return
        start = time.thread_time()
        try:
            yield
        finally:
            setattr(self, total, getattr(self, total) + (time.thread_time() - start) * 1e3)

    def concatenation_backward(self, out: torch.Tensor) -> None:
        """Count the backward of the concatenation that made ``out``: its autograd node and the
        view nodes below it that copy (the per-key split of the values: its backward concatenates
        the keys' gradients), down to the output distribution's."""
        if self.device.type == "cuda":
            return
        copying = [n for n in _nodes_below(out, _VIEW_NODES) if any(part in n.name() for part in _COPYING_NODES)]
        self._time_nodes(copying, self._add_concatenation)

    def _add_concatenation(self, start: tuple[float, float]) -> None:
        self.concatenation_ms += self._now()[0] - start[0]

    def start_step(self) -> None:
        """A training step begins: every region counts from here."""
        self.take(), self.take_lookup(), self.take_input()
        self.exchange_ms = self.concatenation_ms = 0.0
        self._step_start = (time.perf_counter(), time.thread_time(), time.process_time())

    def end_step(self) -> dict[str, float]:
        """The step begun last ended: its whole wall time (``step``), on the training thread's
        clock (``step_cpu``; on CUDA that clock misses the device's work: the wall time), its
        regions since :meth:`start_step` (``sparse``, ``lookup``, ``lookup_wall``, ``input``) and
        its exchanges' CPU time (``exchange_cpu``: the layouts' copies on the training thread and
        every other thread's CPU time over the step; on CUDA the wall time) and its output layouts'
        (``layout_cpu``: those copies and the concatenations timed, all on the training thread; on
        CUDA the wall time): what a calibration protocol's ``region`` may name."""
        step_ms = (time.perf_counter() - self._step_start[0]) * 1e3
        if self.device.type == "cpu":
            thread_ms = (time.thread_time() - self._step_start[1]) * 1e3
            others_ms = (time.process_time() - self._step_start[2]) * 1e3 - thread_ms
            step_cpu_ms, exchange_cpu_ms = thread_ms, self.exchange_ms + others_ms
            layout_cpu_ms = self.exchange_ms + self.concatenation_ms
        else:
            step_cpu_ms = exchange_cpu_ms = layout_cpu_ms = step_ms
        lookup_ms, lookup_wall_ms = self.take_lookup()
        return {"step_ms": step_ms, "sparse_ms": self.take(), "lookup_ms": lookup_ms, "lookup_wall_ms": lookup_wall_ms,
                "step_cpu_ms": step_cpu_ms, "input_ms": self.take_input(), "exchange_cpu_ms": exchange_cpu_ms,
                "layout_cpu_ms": layout_cpu_ms}


def _nodes_below(out: torch.Tensor, through: tuple[str, ...]) -> list[Any]:
    """The autograd node that made ``out`` and those below it, each once, descending only through
    nodes whose name holds one of ``through``."""
    nodes, todo = [], [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in nodes:
            continue
        nodes.append(node)
        if any(part in node.name() for part in through):
            todo += [n for n, _ in node.next_functions]
    return nodes


@dataclass
class CalibrationProtocol:
    """How a pass's candidates are measured (in a
    :class:`~lightning_sparselift.cost.design.FactorialDesign`, possibly with other passes'): the
    paper's Table 5 warmup, then as many measured blocks as the decision rule needs."""

    warmup_pairs: int = 1  # unmeasured blocks first
    # what F measures: "sparse" (the executor's regions), "step" (the whole step's wall time),
    # "step_cpu" (the whole step on the training thread's CPU clock on CPU, its wall time on CUDA:
    # for candidates whose effect is compute on that thread anywhere in the step, e.g. copies the
    # model's own code makes; the clock leaves out the waits and preemptions that are most of a
    # CPU step's noise), "lookup" (the lookup regions' forward and backward on the training
    # thread's clock, see RegionClock: for candidates that change only the lookups' compute),
    # "lookup_wall" (the same regions' wall time: for candidates that spread that compute over
    # threads), "input" (the input distribution's work on the lookup clock: for candidates that
    # change only its compute) or "exchange_cpu" (the output layouts' copies on the training
    # thread and the collectives' threads' CPU time, on CPU; the step's wall time on CUDA: for
    # candidates that change what the exchanges move, on a host whose cores the collectives'
    # threads share with the training) or "layout_cpu" (those copies on the training thread and
    # the model's concatenations of the modules' values, see RegionClock.concatenation: for
    # candidates that change how a module's output reaches the model's concatenation)
    region: str = "sparse"
    settle_steps: int = 0  # unmeasured steps on the same plan before each observed one


@dataclass
class Measurement:
    observations_ms: list[list[list[float]]]  # per rank, per measured pair: [F(T0), F(T1)]
    estimate: PairedEstimate  # of the slowest rank's pairs: what the decision uses

    @property
    def increment_ms(self) -> float:
        return self.estimate.increment_ms


class PairedRuns:
    """Training steps scheduled as pairs of runs, each run ``1 + settle_steps`` steps on one arm
    whose last step is observed: what the next step runs, and whether it is observed."""

    def __init__(self, settle_steps: int) -> None:
        self.settle_steps = settle_steps
        self._schedule: list[tuple[Any, bool]] = []  # per step: (its arm, observed)
        self._steps = 0

    def _add_pair(self, first: Any, second: Any) -> None:
        run = 1 + self.settle_steps
        self._schedule += [(arm, i == run - 1) for arm in (first, second) for i in range(run)]

    def _upcoming(self) -> Optional[tuple[Any, bool]]:
        """The next step's (arm, observed); None once the scheduled steps ran."""
        return self._schedule[self._steps] if self._steps < len(self._schedule) else None

    @property
    def done(self) -> bool:
        """The scheduled steps ran: time to take a measurement."""
        return self._steps == len(self._schedule)

    @property
    def recorded(self) -> int:
        """Steps run so far."""
        return self._steps

    @property
    def planned(self) -> int:
        """Steps scheduled so far."""
        return len(self._schedule)


class PairedSteps(PairedRuns):
    """Real training steps in pairs, T0 (the incumbent) then T1 (the candidate, or the installed
    plan a steady-state check verifies): ``warmup_pairs`` unmeasured pairs, then measured ones,
    each half a run of ``1 + settle_steps`` steps whose last step is observed."""

    def __init__(self, warmup_pairs: int, settle_steps: int) -> None:
        super().__init__(settle_steps)
        self.warmup_pairs = warmup_pairs
        self._observed: list[tuple[bool, float, float]] = []  # (ran T1, F, the step's wall ms)

    def add_pairs(self, pairs: int) -> None:
        for _ in range(pairs):
            self._add_pair(False, True)

    def next_uses_candidate(self) -> Optional[bool]:
        """Whether the next step runs T1 (True) or T0 (False); None once the scheduled steps ran."""
        upcoming = self._upcoming()
        return None if upcoming is None else upcoming[0]

    def record(self, f_ms: float, step_ms: Optional[float] = None) -> None:
        """The measured region of the step just run and the step's wall time (default: the region
        is the step); settle steps are not observed."""
        uses, observed = self._schedule[self._steps]
        if observed:
            self._observed.append((uses, f_ms, f_ms if step_ms is None else step_ms))
        self._steps += 1

    def _measured(self) -> list[list[tuple[bool, float, float]]]:
        """This rank's complete measured pairs, T0's observation first."""
        observed = self._observed[2 * self.warmup_pairs:]
        return [sorted(observed[i:i + 2], key=lambda o: o[0]) for i in range(0, len(observed) - 1, 2)]

    def pairs(self) -> list[list[float]]:
        """This rank's complete measured pairs: [F(T0), F(T1)] each."""
        return [[f for _, f, _ in pair] for pair in self._measured()]

    def incumbent_steps(self) -> list[float]:
        """Per measured pair, the wall time of its T0 step (what ``min_gain`` is a fraction of)."""
        return [pair[0][2] for pair in self._measured()]


def judge_pairs(pairs: list[list[float]], group: Any, rule: DecisionRule, looks: int,
                incumbent_steps: Optional[list[float]] = None, min_gain: Optional[float] = None) -> Measurement:
    """All ranks' [F(T0), F(T1)] pairs gathered; per pair, each arm's slowest rank; the increment
    estimated from those (the same result on every rank). ``incumbent_steps``: per pair the T0
    step's wall time, when the region is not the step (the smallest gain is a fraction of the step,
    ``min_gain``, by default the rule's for whole steps)."""
    steps = incumbent_steps if incumbent_steps is not None else [t0 for t0, _ in pairs]
    local = torch.tensor([[t0, t1, s] for (t0, t1), s in zip(pairs, steps)], dtype=torch.float64).reshape(-1, 3)
    gathered = gather_ranks(local, group)
    slowest = torch.stack(gathered).amax(dim=0)
    estimate = paired_estimate(slowest[:, 0].tolist(), slowest[:, 1].tolist(), rule.confidence, looks,
                               rule.min_gain if min_gain is None else min_gain, slowest[:, 2].tolist())
    return Measurement([g[:, :2].tolist() for g in gathered], estimate)


def gather_ranks(local: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``local`` (the same shape everywhere), on the CPU, in rank order."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [local]
    # NCCL exchanges only CUDA tensors
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    sent = local.to(device) if device is not None else local
    gathered = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, sent, group=group)
    return [g.cpu() for g in gathered]
