"""The workload the simulator scales: a model built from the config ``sparselift fit`` takes (or a
``sparselift bench`` scenario), and what one of its training steps does on one process, measured without processes or tables: its
sparse modules' inputs (the same capture the strategy records in its first steps, so the lifter
reads them the same way), the dense FLOPs forward, backward and before each sparse module's call
(torch's ``FlopCounterMode``), and the dense kernels a step launches. The tables stay on meta: the
sparse modules' forward is replaced by zeros of their output's shape while the step is counted
(their lookups are priced by the step-time model from their bytes, not from FLOPs)."""

from __future__ import annotations

import copy
import logging
import sys
import time
import types
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_sparselift.frontend.capture import FeatureStats, ModuleCapture, RankCapture, SparseCapture
from lightning_sparselift.simulate.one_rank import OneRankTiming, model_optimizer, time_one_rank, without_trainer


@dataclass
class DenseTiming:
    """The dense part of one training step timed on this machine (the sparse modules' zeros
    instead of lookups), medians of a few steps after a warm-up, on ``threads`` intra-op threads."""

    forward_ms: float
    backward_ms: float
    window_ms: dict[str, float]  # per sparse module: from the root forward's start to its call
    threads: int
    optimizer_ms: float  # the model's dense optimizer: step and zero_grad over the dense parameters


@dataclass
class Workload:
    source: str  # the config file or bench scenario
    model: nn.Module  # its tables on meta
    module_paths: list[str]
    capture: RankCapture  # one process's step at ``batch_size``
    batch_size: int
    forward_flops: float  # per sample, dense
    backward_flops: float
    window_flops: dict[str, float]  # per sample, per sparse module: the dense forward FLOPs before its call
    forward_kernels: int  # per step: the dense kernels forward and backward launch
    backward_kernels: int
    dense_param_bytes: int
    timed: Optional[DenseTiming] = None  # this machine's dense step at ``batch_size`` (None: not timed)
    one_rank: Optional[OneRankTiming] = None  # TorchRec's step at one rank here, at ``batch_size`` (None: not timed)
    _scaled: dict[int, dict[str, ModuleCapture]] = field(default_factory=dict, repr=False)  # by batch per rank

    def capture_at(self, rank: int, world: int, batch_per_rank: int) -> RankCapture:
        """This workload's capture as a rank of ``world`` sees it with ``batch_per_rank`` samples:
        ids per step in proportion to the batch (bag lengths keep their distribution)."""
        if batch_per_rank not in self._scaled:  # (every rank's is the same: one object for all)
            scale = batch_per_rank / self.batch_size
            modules = {}
            for path, m in self.capture.modules.items():
                features = {k: FeatureStats(1, round(f.ids_per_step * scale), dict(f.percentiles))
                            for k, f in m.features.items()}
                modules[path] = ModuleCapture(**{**m.__dict__, "features": features, "batch_size": batch_per_rank})
            self._scaled[batch_per_rank] = modules
        return RankCapture(rank, world, self._scaled[batch_per_rank], self.capture.threads)


class _KernelCount(TorchDispatchMode):
    """The aten calls that launch a kernel (views launch none)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def workload_from_config(config: str, batch_size: int, threads: Optional[int] = None) -> Workload:
    """The model and data of ``config`` (what ``sparselift fit --config`` takes) at ``batch_size``
    samples per rank; its dense step timed on ``threads`` threads when given."""
    from lightning_sparselift.lightning.cli import SparseLiftCLI

    # one process, no training: the trainer is built (the config names it) and never run; its
    # messages and LightningCLI's about the command line (this one's, not the config's) say nothing here
    argv, sys.argv = sys.argv, sys.argv[:1]
    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        cli = SparseLiftCLI(args=["--config", config, "--trainer.devices=1", "--trainer.logger=false",
                                  f"--data.batch_size={batch_size}", f"--data.num_train={4 * batch_size}"], run=False)
    finally:
        sys.argv = argv
        quiet.setLevel(level)
    # (the tables' optimizer is the strategy's option; a config without the strategy trains them with SGD)
    embedding_optimizer = getattr(cli.trainer.strategy, "embedding_optimizer", "sgd")
    return probe_workload(cli.model, cli.datamodule, config, batch_size, threads, embedding_optimizer)


def workload_from_scenario(name: str, batch_size: int, threads: Optional[int] = None) -> Workload:
    """A ``sparselift bench`` scenario's model and data at ``batch_size`` samples per rank."""
    import dataclasses
    import tempfile

    from lightning_sparselift.bench.scenarios import load

    scenario = dataclasses.replace(load(name), batch_size=batch_size)
    with tempfile.TemporaryDirectory() as cache:
        return probe_workload(scenario.module(), scenario.datamodule(4 * batch_size, batch_size, 0, cache),
                              f"scenario {scenario.name}", batch_size, threads, scenario.embedding_optimizer())


def probe_workload(model: nn.Module, data: Any, source: str, batch_size: int, threads: Optional[int] = None,
                   embedding_optimizer: Any = "sgd") -> Workload:
    """Count two training steps of ``model`` on ``data``'s batches (the second is counted; the
    first announces it, as the capture needs); with ``threads``, time its dense step and TorchRec's
    step at one rank (its tables updated by ``embedding_optimizer``) too."""
    from lightning_sparselift.frontend.lift import dense_parameter_bytes
    from lightning_sparselift.sharding import find_sparse_modules

    if hasattr(data, "prepare_data"):
        data.prepare_data()
    data.setup("fit")
    batches = iter(data.train_dataloader())
    first, second, third = next(batches), next(batches), next(batches)
    # (before the sparse modules' forward is replaced below)
    one_rank = time_one_rank(copy.deepcopy(model), [first, second, third], embedding_optimizer,
                             threads) if threads else None
    modules = find_sparse_modules(model)
    unsupported = [p for p, m in modules.items() if _zeros_forward(m) is None]
    if unsupported:
        raise ValueError(f"{source}: the simulator builds graphs of plain EmbeddingBagCollections and "
                         f"EmbeddingCollections; {unsupported} are not")
    for m in modules.values():
        m.forward = types.MethodType(_zeros_forward(m), m)
    capture = SparseCapture(model, list(modules), 0, 1)
    flops, kernels = FlopCounterMode(display=False), _KernelCount()
    window: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, _a, p=p: _mark(window, p, flops)) for p, m in modules.items()]
    with without_trainer():
        try:
            model.train()
            with capture.step(first, second):
                model.training_step(first, 0)
            with flops, capture.step(second, third):
                window.clear()
                with kernels:
                    loss = model.training_step(second, 1)
                forward, forward_kernels = flops.get_total_flops(), kernels.count
                with kernels:
                    loss.backward()
            backward, backward_kernels = flops.get_total_flops() - forward, kernels.count - forward_kernels
        finally:
            for h in hooks:
                h.remove()
            capture.remove()
    result = capture.result()
    errors = capture.errors()
    if errors:
        raise ValueError(f"{source}: {'; '.join(errors.values())}")
    with without_trainer():
        timed = _time_dense(model, second, modules, threads) if threads else None
    return Workload(source, model, list(modules), result, batch_size, forward / batch_size, backward / batch_size,
                    {p: f / batch_size for p, f in window.items()}, forward_kernels, backward_kernels,
                    dense_parameter_bytes(model, list(modules)), timed, one_rank)


def _time_dense(model: nn.Module, batch: Any, modules: dict[str, nn.Module], threads: int, steps: int = 8
                ) -> DenseTiming:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    forward, backward, windows = [], [], defaultdict(list)
    start = [0.0]

    def called(path: str) -> None:
        windows[path].append((time.perf_counter() - start[0]) * 1e3)

    # (the tables are updated by the fused embedding optimizer in backward; here they are on meta)
    optimizer = model_optimizer(model, [p for p in model.parameters() if p.requires_grad and p.device.type != "meta"])
    updates = []
    hooks = [m.register_forward_pre_hook(lambda _m, _a, p=p: called(p)) for p, m in modules.items()]
    try:
        for step in range(steps + 1):
            start[0] = time.perf_counter()
            loss = model.training_step(batch, step)
            middle = time.perf_counter()
            loss.backward()
            done = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            if step:  # (the first warms up)
                forward.append((middle - start[0]) * 1e3)
                backward.append((done - middle) * 1e3)
                updates.append((time.perf_counter() - done) * 1e3)
            else:
                windows.clear()
    finally:
        for h in hooks:
            h.remove()
        torch.set_num_threads(before)
    return DenseTiming(median(forward), median(backward), {p: median(w) for p, w in windows.items()}, threads,
                       median(updates))


def _mark(window: dict[str, float], path: str, flops: FlopCounterMode) -> None:
    window.setdefault(path, float(flops.get_total_flops()))


def _zeros_forward(module: nn.Module) -> Any:
    """A forward giving zeros of the module's output (a leaf that takes gradients), or None for a
    module that is not a plain EmbeddingBagCollection or EmbeddingCollection."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

    if type(module) is EmbeddingBagCollection:
        def pooled(self, features):
            configs = self._embedding_bag_configs
            keys = [f for c in configs for f in c.feature_names]
            dims = [c.embedding_dim for c in configs for _ in c.feature_names]
            return KeyedTensor(keys=keys, length_per_key=dims,
                               values=torch.zeros(features.stride(), sum(dims), requires_grad=True))
        return pooled
    if type(module) is EmbeddingCollection:
        def sequence(self, features):
            dims = {f: c.embedding_dim for c in self._embedding_configs for f in c.feature_names}
            by_key = features.to_dict()
            return {f: JaggedTensor(torch.zeros(by_key[f].values().numel(), d, requires_grad=True),
                                    lengths=by_key[f].lengths()) for f, d in dims.items()}
        return sequence
    return None
