"""Measuring a training step: wall and CPU time, the stage breakdown, the collectives issued."""

from __future__ import annotations

import resource
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np
import torch

from lightning_sparselift.frontend.capture import backward_nodes
from lightning_sparselift.ir.vocab import DTYPE_BYTES

_TOP_OPS = 8
STAGES = ("sparse_forward", "other_forward", "sparse_backward", "other_backward", "other")

# the profiler names input dtypes by their C++ types
_PROFILER_DTYPES = {"float": "float32", "double": "float64", "long": "int64", "long int": "int64", "int": "int32",
                    "c10::Half": "float16", "c10::BFloat16": "bfloat16", "short": "int16", "unsigned char": "uint8",
                    "signed char": "int8"}


class StageTimer:
    """Splits a step into the five stages of the paper's Table 7, by measurement.

    - sparse forward: time inside the sparse module's forward (hooks on it), plus any explicitly
      timed sparse region (:meth:`sparse_region`, for code that is not one module call);
    - sparse backward: time spent executing the autograd nodes that produce the sparse output
      (found by walking its ``grad_fn`` graph each step; timed with node pre/post hooks, so dense
      backward that runs while a sparse collective is in flight is not counted as sparse);
    - other forward: the rest of the forward (from :meth:`forward_start` to :meth:`forward_end`);
    - other backward: the rest of the backward (from the loss node starting to
      :meth:`backward_end`, which the optimizer step's pre-hook calls);
    - other: the rest of the step (optimizer, pipeline bookkeeping, data movement).
    """

    def __init__(self) -> None:
        self.enabled = False
        self._sparse_fwd = 0.0
        self._sparse_bwd = 0.0
        self._marks: dict[str, float] = {}
        self._fwd_start: Optional[float] = None
        self.rows: list[dict[str, float]] = []

    def attach(self, sparse_module: torch.nn.Module) -> None:
        sparse_module.register_forward_pre_hook(lambda *_: self._enter())
        sparse_module.register_forward_hook(lambda _m, _i, out: self._leave(out))

    def _enter(self) -> None:
        if self.enabled:
            self._fwd_start = time.perf_counter()

    def _leave(self, output: Any) -> None:
        if self.enabled and self._fwd_start is not None:
            self._sparse_fwd += time.perf_counter() - self._fwd_start
            self._fwd_start = None
            self.watch_backward(output)

    @contextmanager
    def sparse_region(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.enabled:
            self._sparse_fwd += time.perf_counter() - start

    def watch_backward(self, output: Any) -> None:
        """Time the backward of every autograd node that ``output`` was computed from."""
        if not self.enabled:
            return
        for node in backward_nodes(_tensors(output)):
            starts: list[float] = []
            node.register_prehook(lambda grads, starts=starts: starts.append(time.perf_counter()))
            node.register_hook(lambda gi, go, starts=starts: self._node_done(starts))

    def _node_done(self, starts: list[float]) -> None:
        if starts:
            self._sparse_bwd += time.perf_counter() - starts.pop()

    def forward_start(self) -> None:
        if self.enabled and "forward_start" not in self._marks:
            self._marks["forward_start"] = time.perf_counter()

    def forward_end(self, loss: torch.Tensor) -> None:
        """Called with the loss: the forward ends here and the backward starts when the loss's
        node runs."""
        if not self.enabled:
            return
        self._marks["forward_end"] = time.perf_counter()
        if loss.grad_fn is not None:
            loss.grad_fn.register_prehook(lambda grads: self._mark("backward_start"))

    def backward_end(self) -> None:
        if self.enabled:
            self._mark("backward_end")

    def _mark(self, name: str) -> None:
        self._marks.setdefault(name, time.perf_counter())

    @contextmanager
    def step(self) -> Iterator[None]:
        self.enabled = True
        self._sparse_fwd = self._sparse_bwd = 0.0
        self._marks: dict[str, float] = {}
        start = time.perf_counter()
        try:
            yield
        finally:
            total = time.perf_counter() - start
            self.enabled = False
            m = self._marks
            fwd = m.get("forward_end", start) - m.get("forward_start", start)
            bwd = m.get("backward_end", start) - m.get("backward_start", start)
            self.rows.append({
                "sparse_forward": self._sparse_fwd * 1e3,
                "other_forward": max(fwd - self._sparse_fwd, 0.0) * 1e3,
                "sparse_backward": self._sparse_bwd * 1e3,
                "other_backward": max(bwd - self._sparse_bwd, 0.0) * 1e3,
                "other": max(total - fwd - bwd, 0.0) * 1e3,
                "total": total * 1e3,
            })

    def summary(self) -> dict[str, float]:
        if not self.rows:
            return {}
        return {k: float(np.median([r[k] for r in self.rows])) for k in (*STAGES, "total")}


@dataclass
class CollectiveLog:
    """Collectives one step issued on the process group backend (gloo/nccl), from the profiler:
    this sees C++-issued ones too (DDP's bucket all-reduce); and the ops that took the most CPU
    time in that step (self time, all threads; where the sparse path's time goes)."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    top_ops: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        counts = Counter(c["op"] for c in self.calls)
        return {"count": len(self.calls), "bytes": int(sum(c["bytes"] for c in self.calls)),
                "by_op": {op: {"count": n, "bytes": int(sum(c["bytes"] for c in self.calls if c["op"] == op))}
                          for op, n in sorted(counts.items())}}


@contextmanager
def record_collectives() -> Iterator[CollectiveLog]:
    from torch.profiler import ProfilerActivity, profile

    log = CollectiveLog()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield log
    for event in prof.events():
        backend, _, op = event.name.partition(":")
        if backend not in ("gloo", "nccl") or not op:
            continue
        nbytes = 0
        for shape, dtype in zip(event.input_shapes, event.input_dtypes or []):
            if shape:
                nbytes += int(np.prod(shape)) * DTYPE_BYTES.get(_PROFILER_DTYPES.get(dtype, dtype), 4)
        log.calls.append({"op": op, "bytes": nbytes})
    ranked = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:_TOP_OPS]
    log.top_ops = [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in ranked]


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": float("nan"), "p25": float("nan"), "p75": float("nan")}
    p25, med, p75 = np.percentile(values, [25, 50, 75])
    return {"median": float(med), "p25": float(p25), "p75": float(p75)}


class StepClock:
    """Wall, process-CPU and training-thread CPU time of consecutive steps (the process's CPU
    beyond the training thread's is its other threads': gloo's, the loader's), and the training
    thread's page faults: fresh memory touched, which the kernel maps a page at a time on that
    thread's clock (2-10 us each here; TorchRec's sparse-heavy step took 2,000-2,500 of them)."""

    def __init__(self) -> None:
        self.wall_ms: list[float] = []
        self.cpu_ms: list[float] = []
        self.thread_cpu_ms: list[float] = []
        self.page_faults: list[int] = []
        self._start = (0.0, 0.0, 0.0, 0)

    def begin(self) -> None:
        self._start = (time.perf_counter(), time.process_time(), time.thread_time(), thread_page_faults())

    def end(self, into: Optional["StepClock"] = None) -> None:
        """Record the step since :meth:`begin` (in ``into``, another clock, when given)."""
        clock = self if into is None else into
        wall, cpu, thread, faults = self._start
        clock.wall_ms.append((time.perf_counter() - wall) * 1e3)
        clock.cpu_ms.append((time.process_time() - cpu) * 1e3)
        clock.thread_cpu_ms.append((time.thread_time() - thread) * 1e3)
        clock.page_faults.append(thread_page_faults() - faults)

    @contextmanager
    def time(self) -> Iterator[None]:
        self.begin()
        yield
        self.end()


def thread_page_faults() -> int:
    """The calling thread's page faults served without I/O so far (0 where the OS does not count
    them per thread)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_minflt if who is not None else 0


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a sparse module's output: a tensor, a KeyedTensor or JaggedTensor (their
    values), or tuples, lists and dicts of those."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    values = getattr(output, "values", None)
    return _tensors(values()) if callable(values) else []
