"""Capture: what the first real batches show about the sparse path.

While TorchRec's own path runs the first ``capture_steps`` training steps, a forward pre-hook on
every sharded EmbeddingBagCollection records its input KeyedJaggedTensor (keys, dtypes, weighted
or not, the batch size; per feature: ids per step and bag length percentiles) and where it came
from (the root forward's arguments, the step's batch, the batch announced as next).
The result is plain data; :func:`gather_captures` makes every rank hold every rank's capture, so
the graph lifted from it is the same everywhere.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from lightning_sparselift.frontend.consumer import OutputTrace
from lightning_sparselift.ir.vocab import dtype_name
from lightning_sparselift.kjt import copy_features, find_kjts, resolve_path, same_features

_PERCENTILES = (50, 90, 99)


@dataclass
class FeatureStats:
    """One feature's bags on one rank over the captured steps."""

    steps: int
    ids: int
    percentiles: dict[str, float]  # bag length percentiles: {"p50": ..., "p90": ..., "p99": ...}

    @property
    def ids_per_step(self) -> float:
        return self.ids / max(self.steps, 1)


@dataclass
class ModuleCapture:
    """One sharded module's input on one rank."""

    keys: list[str]
    weighted: bool
    batch_size: int
    lengths_dtype: str
    values_dtype: str
    features: dict[str, FeatureStats]
    # where the module's input KJT already was when the root module's forward began (the same
    # object in every captured step), e.g. [["arg", 0], ["attr", "sparse"]]; None if not there
    root_input: Optional[list[list[Any]]] = None
    # where it was in the step's batch (as the training loop passed it), e.g. [["arg", 0], ["attr", "sparse"]]
    batch_input: Optional[list[list[Any]]] = None
    # per captured step: whether the batch the loop announced as next during the step before held
    # exactly the features the module received (None: nothing announced, or no batch path)
    announced_exact: list[Optional[bool]] = field(default_factory=list)
    calls_per_step: int = 1  # the most calls of the module in one captured step
    # how the model concatenated the pooled output, [key order, before, after] (frontend.consumer),
    # the same in every captured step; else None and consumer_note says what the model did
    consumer: Optional[list[Any]] = None
    consumer_note: str = ""
    # per captured step, this rank's wall ms from the root forward's start to the module's call,
    # less the earlier sparse modules' calls (the dense compute an early start can overlap), and
    # of the module's call itself (TorchRec's sparse forward, its output awaited)
    window_ms: list[float] = field(default_factory=list)
    call_ms: list[float] = field(default_factory=list)
    # per captured step, the training thread's CPU ms in TorchRec's lookup modules of the module:
    # their forward calls and their outputs' backward nodes (the fused update included)
    lookup_ms: list[float] = field(default_factory=list)


@dataclass
class RankCapture:
    rank: int
    world_size: int
    modules: dict[str, ModuleCapture]
    threads: int = 1  # the rank's intra-op threads (torch.get_num_threads()) while capturing
    step_ms: list[float] = field(default_factory=list)  # each captured step's wall ms on this rank
    # each captured step's CPU ms of the process beyond the training thread's (the collectives'
    # backend threads, mostly)
    other_cpu_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankCapture":
        modules = {p: ModuleCapture(**{**m, "features": {f: FeatureStats(**s) for f, s in m["features"].items()}})
                   for p, m in data["modules"].items()}
        return cls(data["rank"], data["world_size"], modules, data.get("threads", 1), data.get("step_ms", []),
                   data.get("other_cpu_ms", []))


class _FeatureAccumulator:
    def __init__(self) -> None:
        self.lengths: list[torch.Tensor] = []

    def stats(self, steps: int) -> FeatureStats:
        lengths = torch.cat(self.lengths) if self.lengths else torch.zeros(0, dtype=torch.long)
        as_float = lengths.double()
        percentiles = ({f"p{p}": float(torch.quantile(as_float, p / 100)) for p in _PERCENTILES}
                       if lengths.numel() else {f"p{p}": 0.0 for p in _PERCENTILES})
        return FeatureStats(steps=steps, ids=int(lengths.sum()), percentiles=percentiles)


class SparseCapture:
    """Hooks on the sharded modules of ``model`` at ``module_paths`` that record their inputs in
    the steps run inside :meth:`step`."""

    def __init__(self, model: nn.Module, module_paths: list[str], rank: int, world_size: int) -> None:
        """``model`` is the root whose forward the training step calls; its arguments are where a
        sparse module's input can be found before the module runs."""
        self.rank = rank
        self.world_size = world_size
        self.steps = 0
        self._active = False  # inside a captured training step
        self._inputs: dict[str, dict[str, Any]] = {}
        self._features: dict[str, dict[str, _FeatureAccumulator]] = defaultdict(lambda: defaultdict(_FeatureAccumulator))
        self._handles = [model.register_forward_pre_hook(self._root_hook, with_kwargs=True)]
        self._root_kjts: dict[int, list[list[Any]]] = {}
        self._root_inputs: dict[str, list[Any]] = defaultdict(list)
        self._batch_kjts: dict[int, list[list[Any]]] = {}
        self._batch_inputs: dict[str, list[Any]] = defaultdict(list)
        self._announced: dict[str, Any] = {}  # copies of the KJTs of the batch the loop said comes next, by path
        self._expected: dict[str, Any] = {}  # what the step before announced for this step
        self._announced_exact: dict[str, list[Optional[bool]]] = defaultdict(list)
        self._calls: dict[str, int] = defaultdict(int)
        self._max_calls: dict[str, int] = defaultdict(int)
        self._outputs: dict[str, list[OutputTrace]] = defaultdict(list)
        # this step's clock readings: the root forward's start, each module's call and return
        self._root_start: Optional[float] = None
        self._call_times: dict[str, tuple[float, Optional[float]]] = {}
        self._window_ms: dict[str, list[float]] = defaultdict(list)
        self._call_ms: dict[str, list[float]] = defaultdict(list)
        self._step_ms: list[float] = []
        self._other_cpu_ms: list[float] = []
        self._lookup_ms: dict[str, list[float]] = defaultdict(list)
        self._lookup_now: dict[str, float] = defaultdict(float)  # this step's, per module path
        self._timed: set[str] = set()  # the modules whose lookups carry the timing hooks
        self._model, self._paths = model, list(module_paths)
        for path in module_paths:
            module = model.get_submodule(path)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(path), with_kwargs=True))
            # first among the module's forward hooks: it waits for TorchRec's awaitable output, which
            # a hook that read the output before (e.g. the step check's) would have waited for already
            self._handles.append(module.register_forward_hook(self._output_hook(path), prepend=True))

    def _pre_hook(self, path: str):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._active:
                return  # outside a captured training step (e.g. validation)
            kjt = args[0] if args else kwargs["features"]
            self._root_inputs[path].append(self._root_kjts.get(id(kjt)))
            batch_path = self._batch_kjts.get(id(kjt))
            self._batch_inputs[path].append(batch_path)
            announced = self._expected.get(repr(batch_path))
            self._announced_exact[path].append(same_features(kjt, announced) if announced is not None else None)
            self._calls[path] += 1
            self._call_times.setdefault(path, (time.perf_counter(), None))
            self._observe(path, kjt)
        return hook

    def _output_hook(self, path: str):
        def hook(_module: nn.Module, _args: tuple, output: Any) -> Any:
            from torchrec.distributed.types import LazyAwaitable
            from torchrec.sparse.jagged_tensor import KeyedTensor

            if not self._active:
                return None
            # (TorchRec's sharded module returns its output as an awaitable the first use waits
            # for; waiting here only moves that wait to the module's return)
            kt = output.wait() if isinstance(output, LazyAwaitable) else output
            start, end = self._call_times.get(path, (None, None))
            if start is not None and end is None:
                self._call_times[path] = (start, time.perf_counter())
            if not isinstance(kt, KeyedTensor):
                return None if kt is output else kt
            trace = OutputTrace(list(kt.keys()), list(kt.length_per_key()))
            self._outputs[path].append(trace)
            return trace.wrap(kt)
        return hook

    def _root_hook(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._active:
            self._root_kjts = find_kjts(args, kwargs)
            if self._root_start is None:
                self._root_start = time.perf_counter()

    def _observe(self, path: str, kjt: Any) -> None:
        if kjt.variable_stride_per_key():
            self._inputs[path] = {"error": f"{path}: inputs with a variable batch size per feature (VBE) are not "
                                           f"supported by the lifted executor"}
            return
        batch_size = kjt.stride()
        keys = list(kjt.keys())
        previous = self._inputs.get(path)
        if previous is not None and previous.get("keys") != keys:
            self._inputs[path] = {"error": f"{path}: the KJT key order changed between batches ({previous.get('keys')} "
                                           f"then {keys})"}
            return
        self._inputs[path] = {"keys": keys, "weighted": kjt.weights_or_none() is not None, "batch_size": batch_size,
                              "lengths_dtype": dtype_name(kjt.lengths().dtype),
                              "values_dtype": dtype_name(kjt.values().dtype)}
        lengths = kjt.lengths().detach().view(len(keys), batch_size).cpu() if keys else None
        for i, key in enumerate(keys):
            self._features[path][key].lengths.append(lengths[i].long())

    @contextmanager
    def step(self, batch: Any = None, next_batch: Any = None) -> Iterator[None]:
        """Record the sparse modules' inputs in one training step. ``batch`` is what the training
        loop passes to its step (where the modules' inputs are looked for), ``next_batch`` the
        batch the loop will pass next, if it knows it."""
        self._active = True
        self._batch_kjts = find_kjts((batch,), {}) if batch is not None else {}
        # copied now: a change made in place before the next step must show as a difference
        self._expected, self._announced = self._announced, {
            repr(path): copy_features(resolve_path((next_batch,), {}, path))
            for path in (find_kjts((next_batch,), {}) if next_batch is not None else {}).values()}
        self._calls.clear()
        self._root_start, self._call_times = None, {}
        self._time_lookups()
        self._lookup_now.clear()
        start, others = time.perf_counter(), time.process_time() - time.thread_time()
        try:
            yield
        finally:
            self._step_ms.append((time.perf_counter() - start) * 1e3)
            self._other_cpu_ms.append((time.process_time() - time.thread_time() - others) * 1e3)
            self._record_windows()
            for path in self._timed:
                self._lookup_ms[path].append(self._lookup_now[path])
            self._active = False
            self._batch_kjts = {}
            for path, calls in self._calls.items():
                self._max_calls[path] = max(self._max_calls[path], calls)
            self.steps += 1

    def _time_lookups(self) -> None:
        """Hooks timing each sparse module's lookup modules (TorchRec keeps them in ``_lookups``,
        a plain list), once they exist."""
        for path in self._paths:
            lookups = getattr(self._model.get_submodule(path), "_lookups", None)
            if path in self._timed or not lookups:
                continue
            self._timed.add(path)
            for lookup in lookups:
                self._handles.append(lookup.register_forward_pre_hook(_lookup_started))
                self._handles.append(lookup.register_forward_hook(self._lookup_done(path)))

    def _lookup_done(self, path: str):
        def hook(module: nn.Module, _args: tuple, output: Any) -> None:
            if not self._active:
                return
            self._lookup_now[path] += (time.thread_time() - module._sparselift_capture_start) * 1e3
            # every node of the lookup's backward, not only its output's: an EmbeddingCollection's
            # lookup returns a view of fbgemm's output and several groups a cat of theirs, whose own
            # backward is nothing beside fbgemm's (with the fused update) below them
            for node in _lookup_nodes(output):
                started: list[float] = []
                node.register_prehook(lambda *_, started=started: started.append(time.thread_time()))
                node.register_hook(lambda *_, started=started: self._lookup_backward_done(path, started))
        return hook

    def _lookup_backward_done(self, path: str, started: list[float]) -> None:
        if started and self._active:
            self._lookup_now[path] += (time.thread_time() - started.pop()) * 1e3

    def _record_windows(self) -> None:
        """Each module's window and call in the step that ended (modules in call order)."""
        if self._root_start is None:
            return
        earlier = 0.0  # ms of the sparse calls before this one
        for path, (start, end) in sorted(self._call_times.items(), key=lambda item: item[1][0]):
            self._window_ms[path].append(max((start - self._root_start) * 1e3 - earlier, 0.0))
            if end is not None:
                self._call_ms[path].append((end - start) * 1e3)
                earlier += (end - start) * 1e3

    def errors(self) -> dict[str, str]:
        """Why a module's captured inputs cannot be lifted, by module path."""
        return {path: v["error"] for path, v in self._inputs.items() if "error" in v}

    def result(self) -> RankCapture:
        modules = {}
        for path, info in self._inputs.items():
            if "error" in info:
                continue
            features = {k: self._features[path][k].stats(self.steps) for k in info["keys"]}
            modules[path] = ModuleCapture(features=features, root_input=common_path(self._root_inputs[path]),
                                          batch_input=common_path(self._batch_inputs[path]),
                                          announced_exact=self._announced_exact[path],
                                          calls_per_step=self._max_calls[path], **info,
                                          **self._consumer(path), window_ms=self._window_ms[path],
                                          call_ms=self._call_ms[path], lookup_ms=self._lookup_ms[path])
        return RankCapture(self.rank, self.world_size, modules, torch.get_num_threads(), self._step_ms,
                           self._other_cpu_ms)

    def _consumer(self, path: str) -> dict[str, Any]:
        """How the model concatenated the module's output: the same way in every captured call, or why not."""
        results = [trace.result() for trace in self._outputs[path]]
        if not results:
            return {"consumer_note": "the module returned no KeyedTensor in the captured steps"}
        found = [r for r, _ in results]
        if found[0] is not None and all(r == found[0] for r in found):
            return {"consumer": found[0]}
        notes = [n for _, n in results if n]
        return {"consumer_note": notes[0] if notes else "the model concatenated the pooled values differently "
                                                         "in different captured steps"}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def backward_nodes(tensors: list[torch.Tensor]) -> list[Any]:
    """The autograd nodes ``tensors`` were computed from, down to the leaves (their gradient
    accumulators left out)."""
    nodes, seen, stack = [], set(), [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return nodes


def _lookup_nodes(output: Any) -> list[Any]:
    """The autograd nodes of a lookup's output down to its tables (the lookup's input ids take no
    gradient, so nothing below them is another module's)."""
    return backward_nodes([output]) if isinstance(output, torch.Tensor) else []


def _lookup_started(module: nn.Module, _args: tuple) -> None:
    module._sparselift_capture_start = time.thread_time()


def common_path(paths: list[Any]) -> Any:
    """The path every observation (step or rank) agrees on, else None."""
    return paths[0] if paths and all(p == paths[0] for p in paths) else None


def gather_captures(capture: RankCapture, group: Any = None) -> list[RankCapture]:
    """Every rank's capture, on every rank (one all-gather of plain data)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [capture]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, capture.to_dict(), group=group)
    return [RankCapture.from_dict(d) for d in gathered]
