"""The systems the benchmark compares, all on the same model shape, data and process group.

Every system trains the same scenario (same dense modules, same batches) and exposes
``step()`` (one full training step) plus the hook points the stage timer needs. Data is
prepared before timing: a step never generates or slices data.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lightning_sparselift.bench.measure import StageTimer
from lightning_sparselift.bench.scenarios import FAMILIES, Scenario
from lightning_sparselift.data import RecArrays, RecBatch


@dataclass
class BenchEnv:
    scenario: Scenario
    rank: int
    world_size: int
    arrays: RecArrays
    seed: int = 0
    pool: int = 32  # distinct batches per rank, cycled
    warmup_steps: int = 5  # untimed steps before measuring
    _local: list[RecBatch] = field(default_factory=list)
    _global: list[list[RecBatch]] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.scenario.batch_size

    def _batch(self, index: int) -> RecBatch:
        b = self.batch_size
        count = len(self.arrays) // b
        if count < self.world_size:
            raise ValueError(f"{len(self.arrays)} samples are fewer than one batch per rank")
        index %= (count // self.world_size) * self.world_size
        return self.arrays.batch(index * b, (index + 1) * b)

    def local_batch(self, step: int) -> RecBatch:
        if not self._local:
            self._local = [self._batch(i * self.world_size + self.rank) for i in range(self.pool)]
        return self._local[step % self.pool]

    def global_batch(self, step: int) -> list[RecBatch]:
        """The batches of all ranks at ``step`` (rank order): what DLRM-Baseline's replicated
        sparse inputs read."""
        if not self._global:
            self._global = [[self._batch(i * self.world_size + r) for r in range(self.world_size)]
                            for i in range(self.pool)]
        return self._global[step % self.pool]

    def local_iterator(self) -> Iterator[RecBatch]:
        step = 0
        while True:
            yield self.local_batch(step)
            step += 1


def build_rec_model(scenario: Scenario, seed: int) -> nn.Module:
    """The scenario's recommendation model (tables on meta), seeded so every system starts
    from the same dense weights."""
    torch.manual_seed(seed)
    return scenario.module().model


class WithLoss(nn.Module):
    """``model(batch) -> (loss, logits)``, the interface TorchRec's train pipelines expect."""

    def __init__(self, rec: nn.Module):
        super().__init__()
        self.rec = rec

    def forward(self, batch: RecBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.rec(batch.dense, batch.sparse).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def _dense_optimizer(scenario: Scenario, params: Any) -> torch.optim.Optimizer:
    from lightning_sparselift.rec_module import DENSE_OPTIMIZERS

    return DENSE_OPTIMIZERS[scenario.optimizer.get("dense", "sgd")](params, lr=scenario.optimizer.get("dense_lr", 0.1))


class System:
    name = ""
    families: tuple[str, ...] = FAMILIES  # the scenario families it can run

    def __init__(self, env: BenchEnv):
        self.env = env
        self.timer = StageTimer()
        self.losses: list[float] = []  # training loss of every step (this rank's batch)

    def setup(self) -> None:
        raise NotImplementedError

    def step(self, step: int) -> None:
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        """What the system wants in its result beside the timings."""
        return {}

    @property
    def ready(self) -> bool:
        """False while the system still runs its own warmup (timing waits for it)."""
        return True

    def _timed_model(self, model: nn.Module, sparse: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Hook the stage timer into ``model`` (forward), its loss (backward start), ``sparse``
        (the sparse path) and ``optimizer`` (backward end)."""
        self.timer.attach(sparse)
        model.register_forward_pre_hook(lambda *_: self.timer.forward_start())
        model.register_forward_hook(lambda _m, _i, out: self._forward_done(out[0]))
        if optimizer is not None:
            optimizer.register_step_pre_hook(lambda *_: self.timer.backward_end())


    def _timed_sharded(self, wrapped: "WithLoss", combined: Any) -> None:
        """:meth:`_timed_model` for a DMP-sharded model and its CombinedOptimizer (the dense
        optimizer's step marks the end of backward)."""
        self._timed_model(wrapped, wrapped.rec.sparse_arch, dict(combined.optimizers)["dense"]._optimizer)

    def _forward_done(self, loss: torch.Tensor) -> None:
        self.timer.forward_end(loss)
        if loss.requires_grad:  # training forwards only
            self.losses.append(float(loss.detach()))


class LoopSystem(System):
    """A plain loop: forward, backward, optimizer step."""

    model: nn.Module
    optimizer: Any

    def step(self, step: int) -> None:
        loss, _ = self.model(self.env.local_batch(step))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


class ConstantSparse(nn.Module):
    """Stands in for the sparse path: a fixed tensor of the sparse output's shape."""

    def __init__(self, rec: nn.Module, batch_size: int):
        super().__init__()
        from torchrec.sparse.jagged_tensor import KeyedTensor

        configs = rec.sparse_arch.embedding_bag_configs() if hasattr(rec.sparse_arch, "embedding_bag_configs") \
            else rec.sparse_arch.embedding_bag_collection.embedding_bag_configs()
        keys = [f for c in configs for f in c.feature_names]
        dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        generator = torch.Generator().manual_seed(1)
        if hasattr(rec.sparse_arch, "embedding_bag_collection"):  # TorchRec SparseArch -> [B, F, D]
            self.output = torch.randn(batch_size, len(keys), dims[0], generator=generator)
        else:  # an EmbeddingBagCollection -> KeyedTensor
            self.output = KeyedTensor(keys=keys, length_per_key=dims,
                                      values=torch.randn(batch_size, sum(dims), generator=generator))

    def forward(self, features: Any) -> Any:
        return self.output


class ConstantSequences(nn.Module):
    """Stands in for a :class:`~lightning_sparselift.sequence_model.SequenceSparseArch`: fixed
    pooled embeddings, and for each sequence feature fixed rows in the batch's own lengths (the
    attention over the history costs what it costs on the real data)."""

    def __init__(self, sparse_arch: nn.Module, batch_size: int, max_ids: int):
        super().__init__()
        from torchrec.sparse.jagged_tensor import KeyedTensor

        generator = torch.Generator().manual_seed(1)
        bag_configs = sparse_arch.bags.embedding_bag_configs()
        dims = [c.embedding_dim for c in bag_configs for _ in c.feature_names]
        self.pooled = KeyedTensor(keys=sparse_arch.bag_features, length_per_key=dims,
                                  values=torch.randn(batch_size, sum(dims), generator=generator))
        (items,) = sparse_arch.sequences.embedding_configs()
        self.rows = torch.randn(max_ids, items.embedding_dim, generator=generator)
        self.sequence_features = list(sparse_arch.sequence_features)

    def forward(self, features: Any) -> tuple[Any, dict[str, Any]]:
        from torchrec.sparse.jagged_tensor import JaggedTensor

        jagged = features.to_dict()
        sequences = {}
        for f in self.sequence_features:
            lengths = jagged[f].lengths()
            sequences[f] = JaggedTensor(values=self.rows[: int(lengths.sum())], lengths=lengths)
        return self.pooled, sequences


def stand_in_sparse(rec: nn.Module, env: "BenchEnv") -> nn.Module:
    """A constant stand-in for ``rec``'s sparse part with its output's shapes (dense-only)."""
    from lightning_sparselift.sequence_model import SequenceSparseArch

    if isinstance(rec.sparse_arch, SequenceSparseArch):
        most = max(int(env.local_batch(i).sparse.lengths().sum()) for i in range(env.pool))
        return ConstantSequences(rec.sparse_arch, env.batch_size, most)
    return ConstantSparse(rec, env.batch_size)


class DenseOnly(LoopSystem):
    name = "dense-only"

    def setup(self) -> None:
        rec = build_rec_model(self.env.scenario, self.env.seed)
        rec.sparse_arch = stand_in_sparse(rec, self.env)
        self.model = nn.parallel.DistributedDataParallel(WithLoss(rec), broadcast_buffers=False)
        self.optimizer = _dense_optimizer(self.env.scenario, self.model.parameters())
        self._timed_model(self.model.module, rec.sparse_arch, self.optimizer)


def _shard(env: BenchEnv, validate_inputs: bool, sharding_types: Optional[dict[str, str]] = None,
           embedding_optimizer: Optional[Any] = None, generated_adam: bool = True
           ) -> tuple[nn.Module, Any, nn.Module, list[str]]:
    from lightning_sparselift.sharding import EmbeddingOptimizer, combine_optimizers, shard_model

    wrapped = WithLoss(build_rec_model(env.scenario, env.seed))
    sharded = shard_model(wrapped, env.world_size, torch.device("cpu"), sharding_types,
                          EmbeddingOptimizer.parse(embedding_optimizer or env.scenario.embedding_optimizer()),
                          dist.group.WORLD, dist.group.WORLD if validate_inputs else None, generated_adam)
    dense = _dense_optimizer(env.scenario, sharded.dmp.parameters())
    return sharded.dmp, combine_optimizers(sharded.dmp, dense), wrapped, sharded.sparse_module_paths


class _TorchRecPipeline(System):
    """TorchRec DistributedModelParallel (its planner, fused TBE, DDP dense) driven by one of
    TorchRec's train pipelines."""

    pipeline_class: Callable[..., Any]

    def setup(self) -> None:
        # (TorchRec as its users run it: no generated kernel, so no Adam on CPU tables)
        dmp, optimizer, wrapped, _ = _shard(self.env, validate_inputs=False, generated_adam=False)
        self.dmp, self.optimizer = dmp, optimizer
        self.pipeline = self.pipeline_class(model=dmp, optimizer=optimizer, device=torch.device("cpu"))
        self.batches = self.env.local_iterator()
        self._timed_sharded(wrapped, optimizer)

    def step(self, step: int) -> None:
        self.pipeline.progress(self.batches)  # returns the logits; the loss stays inside the pipeline


class TorchRecBase(_TorchRecPipeline):
    name = "torchrec-base"

    @property
    def pipeline_class(self):
        from torchrec.distributed.train_pipeline import TrainPipelineBase

        return TrainPipelineBase


class TorchRecSparseDist(_TorchRecPipeline):
    name = "torchrec"

    @property
    def pipeline_class(self):
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        return TrainPipelineSparseDist


class SparseLift(LoopSystem):
    """The model as ``SparseLiftStrategy`` installs it, in a bare loop (no Lightning): TorchRec's
    path for the strategy's ``warmup_batches`` captured steps, then the lifted executor."""

    name = "sparselift"

    def __init__(self, env: BenchEnv, strategy_kwargs: Optional[dict[str, Any]] = None):
        super().__init__(env)
        from lightning_sparselift import SparseLiftStrategy

        self.strategy = SparseLiftStrategy(**{**bench_strategy_kwargs(env), **(strategy_kwargs or {})})
        self._position = 0

    def setup(self) -> None:
        from lightning_sparselift.session import SparseLiftSession

        s = self.strategy
        self.model, self.optimizer, wrapped, paths = _shard(self.env, s.validate_inputs, s.sharding_types,
                                                            s.embedding_optimizer)
        self.session = (SparseLiftSession(wrapped, self.model.plan, paths, dist.group.WORLD, torch.device("cpu"),
                                          s.session_options)
                        if s.executor == "sparselift" else None)
        self._timed_sharded(wrapped, self.optimizer)

    def step(self, step: int) -> None:
        # a continuous stream of batches (as TorchRec's pipelines read theirs), so the batch
        # announced as next is the one the next call trains on, across the runner's blocks
        position, self._position = self._position, self._position + 1
        if self.session is None:
            return super().step(position)
        self.session.begin_step(self.env.local_batch(position), self.env.local_batch(position + 1))
        super().step(position)
        if self.session.end_step():  # the plan is installed (or TorchRec's path kept)
            if self.session.installed is None:
                raise RuntimeError(f"sparselift: the sparse path could not be lifted: {self.session.fallback_reason}")
            time_early_starts(self.session.installed, self.timer)

    @property
    def ready(self) -> bool:
        return self.session is None or self.session.done

    def report(self) -> dict[str, Any]:
        return session_report(self.session)


def session_report(session: Any) -> dict[str, Any]:
    """What a SparseLift session lifted, planned and verified (the bare loop's and the Lightning
    system's alike)."""
    if session is None or session.installed is None:
        return {"executor": "torchrec"}
    graph, plan = session.installed.graph, session.plan
    return {"executor": "sparselift", "lift_s": session.lift_seconds, "graph_fingerprint": graph.fingerprint(),
            "graph_collectives_per_step": len(graph.collectives()), "graph_explain": graph.explain(),
            "calibration_s": plan.calibration_s, "calibration_steps": plan.calibration_steps,
            "calibration_excess_s": plan.calibration_excess_s, "cost_s": session.cost_s,
            "planning_s": plan.planning_s, "plan_explain": plan.explain(),
            "plan_decisions": [asdict(d) for d in plan.decisions],
            "kernel_builds": [asdict(b) for b in plan.kernel_builds],
            "predicted_change_ms": plan.predicted_change_ms, "measured_change_ms": plan.measured_change_ms,
            # the steady-state check against the identity plan (predicted vs measured step change)
            "verification": asdict(session.verification) if session.verification else None,
            "verification_steps": sum(v.steps for v in session.verifications)}


def time_early_starts(installed: Any, timer: StageTimer) -> None:
    """Count latency hiding's early start (input dist, lookups, issuing the output all-to-all)
    as sparse forward in the stage breakdown: it runs before the sparse module's call, which is
    all the module hooks see."""
    for forward in installed.executors.values():
        def timed(features: Any, start: Callable[[Any], None] = forward.start) -> None:
            with timer.sparse_region():
                start(features)

        forward.start = timed


def _ablation(name: str, optimizations: Optional[list[str]], doc: str, **options: Any) -> type[SparseLift]:
    """A ``sparselift`` system whose planner may use only ``optimizations`` (None: all), with
    other strategy ``options``."""
    def __init__(self, env: BenchEnv) -> None:
        SparseLift.__init__(self, env, {**({} if optimizations is None else {"optimizations": optimizations}),
                                        **options})

    return type(name, (SparseLift,), {"name": name, "__init__": __init__, "__doc__": doc})


ABLATIONS = [
    _ablation("sparselift-identity", [], "SparseLift's executor with the identity plan (no optimization pass)."),
    _ablation("sparselift-no-latency-hiding", ["aggregation", "codegen", "subgraph_parallelism"],
              "SparseLift without the latency-hiding pass."),
    _ablation("sparselift-no-aggregation", ["latency_hiding", "codegen", "subgraph_parallelism"],
              "SparseLift without the aggregation pass."),
    _ablation("sparselift-no-next-batch", ["aggregation", "latency_hiding:early_start", "codegen",
                                           "subgraph_parallelism"],
              "SparseLift without latency hiding's next-batch input distribution."),
    # (buckets run generated kernels: without code generation there is no subgraph parallelism either)
    _ablation("sparselift-no-codegen", ["aggregation", "latency_hiding"], "SparseLift without code generation."),
    _ablation("sparselift-no-subgraph", ["aggregation", "latency_hiding", "codegen"],
              "SparseLift without subgraph parallelism."),
    _ablation("sparselift-no-output-layout", ["aggregation", "latency_hiding", "codegen:lookup", "subgraph_parallelism"],
              "SparseLift without code generation's output layout (the model's concatenation copies)."),
    _ablation("sparselift-fresh-buffers", None, "SparseLift allocating its per-step buffers every step.",
              reuse_buffers=False),
]


class _IssuePooledAllToAll(torch.autograd.Function):
    """Starts the pooled-embedding all-to-all; :class:`_WaitPooledAllToAll` finishes it. In
    backward the roles swap: the wait's backward starts the gradient all-to-all and this
    backward waits for it, so autograd runs the bottom MLP's backward in between (DLRM's
    reference schedule)."""

    @staticmethod
    def forward(ctx, pooled: torch.Tensor, box: dict, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        ctx.box, ctx.shape = box, pooled.shape
        out = pooled.new_empty(sum(out_splits))
        box["work"] = dist.all_to_all_single(out, pooled.reshape(-1), out_splits, in_splits, async_op=True)
        return out

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        ctx.box.pop("grad_work").wait()
        return ctx.box.pop("grad_in").view(ctx.shape), None, None, None


class _WaitPooledAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, box: dict, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        ctx.box, ctx.in_splits, ctx.out_splits = box, in_splits, out_splits
        box.pop("work").wait()
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_in = grad.new_empty(sum(ctx.in_splits))
        ctx.box["grad_in"] = grad_in
        ctx.box["grad_work"] = dist.all_to_all_single(grad_in, grad.contiguous(), ctx.in_splits, ctx.out_splits,
                                                      async_op=True)
        return torch.zeros_like(grad), None, None, None


class _TopArch(nn.Module):
    """The scenario model's interaction and top MLP over [B, sum of dims] pooled embeddings."""

    def __init__(self, rec: nn.Module, num_features: int):
        super().__init__()
        self.inter = getattr(rec, "inter_arch", None)  # DLRM / DCN; the concat model has none
        self.over = rec.over_arch
        self.num_features = num_features

    def forward(self, dense: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        if self.inter is not None:
            return self.over(self.inter(dense, embeddings.view(dense.shape[0], self.num_features, -1)))
        return self.over(torch.cat([dense, embeddings], dim=1))


class DLRMBaseline(System):
    """How the public reference DLRM (``dlrm_s_pytorch.py``, distributed mode) trains: one
    ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table, tables split contiguously across
    ranks, sparse inputs replicated (each rank reads its tables' ids for the global batch), one
    asynchronous all-to-all of the pooled embeddings overlapped with the bottom MLP (and the
    gradient all-to-all with the bottom MLP's backward), the MLPs each in DDP, plain SGD with
    sparse gradients."""

    name = "dlrm-baseline"
    families = ("dlrm",)

    def setup(self) -> None:
        env, scenario = self.env, self.env.scenario
        rec = build_rec_model(scenario, env.seed)
        features = scenario.feature_names
        owners = np.array_split(np.arange(len(features)), env.world_size)
        self.owned = [int(i) for i in owners[env.rank]]
        self.widths = [sum(scenario.dims[i] for i in part) for part in owners]
        torch.manual_seed(env.seed + 1 + env.rank)
        self.bags = nn.ModuleList(nn.EmbeddingBag(scenario.rows[i], scenario.dims[i], mode="sum", sparse=True)
                                  for i in self.owned)
        # broadcast_buffers=False as in TorchRec's DDP: no buffer broadcast every forward
        self.bottom = nn.parallel.DistributedDataParallel(rec.dense_arch, broadcast_buffers=False)
        self.top = nn.parallel.DistributedDataParallel(_TopArch(rec, len(features)), broadcast_buffers=False)
        self.sparse_optimizer = torch.optim.SGD(self.bags.parameters(), lr=scenario.optimizer.get("embedding_lr", 0.1))
        self.dense_optimizer = _dense_optimizer(scenario, list(self.bottom.parameters()) + list(self.top.parameters()))
        self.dense_optimizer.register_step_pre_hook(lambda *_: self.timer.backward_end())
        self._inputs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _owned_inputs(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(ids, offsets) over the global batch for each owned table (prepared once per batch)."""
        key = step % self.env.pool
        if key not in self._inputs:
            per_rank = [b.sparse.to_dict() for b in self.env.global_batch(step)]
            inputs = []
            for i in self.owned:
                jts = [d[self.env.scenario.feature_names[i]] for d in per_rank]
                ids = torch.cat([jt.values() for jt in jts])
                lengths = torch.cat([jt.lengths() for jt in jts]).long()
                inputs.append((ids, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])))
            self._inputs[key] = inputs
        return self._inputs[key]

    def step(self, step: int) -> None:
        env, b, w = self.env, self.env.batch_size, self.env.world_size
        batch = env.local_batch(step)
        timer = self.timer
        timer.forward_start()
        with timer.sparse_region():
            local = [bag(ids, offsets) for bag, (ids, offsets) in zip(self.bags, self._owned_inputs(step))]
            # [W*B, owned width] -> per destination rank: its B rows of every owned table
            pooled = (torch.cat(local, dim=1) if local else torch.zeros(w * b, 0)).view(w, b, -1)
            in_splits = [b * self.widths[env.rank]] * w
            out_splits = [b * width for width in self.widths]
            box: dict = {}
            received = _IssuePooledAllToAll.apply(pooled, box, in_splits, out_splits)
        dense = self.bottom(batch.dense)
        with timer.sparse_region():
            received = _WaitPooledAllToAll.apply(received, box, in_splits, out_splits)
        timer.watch_backward(received)
        chunks = [c.view(b, width) for c, width in zip(received.split(out_splits), self.widths)]
        logits = self.top(dense, torch.cat(chunks, dim=1))  # embeddings [B, sum of dims] in table order
        loss = nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1), batch.labels)
        timer.forward_end(loss)
        loss.backward()
        self.dense_optimizer.step()
        self.sparse_optimizer.step()
        self.dense_optimizer.zero_grad()
        self.sparse_optimizer.zero_grad()
        self.losses.append(float(loss.detach()))


SYSTEMS: dict[str, type[System]] = {cls.name: cls for cls in (DLRMBaseline, TorchRecBase, TorchRecSparseDist,
                                                              DenseOnly, SparseLift, *ABLATIONS)}
LIGHTNING_SYSTEM = "sparselift-lightning"
ALL_SYSTEMS = [*SYSTEMS, LIGHTNING_SYSTEM]


def bench_strategy_kwargs(env: BenchEnv) -> dict[str, Any]:
    """The strategy options of both sparselift systems."""
    return {
        # off: the systems compare sparse paths (TorchRec checks nothing); benchmarks/checks_cost.py measures the checks
        "validate_inputs": False,
        "embedding_optimizer": env.scenario.embedding_optimizer(),
        # capture inside the untimed warmup (the strategy's default is 3 steps)
        "warmup_batches": max(1, min(3, env.warmup_steps)),
    }


def lightning_env(rank: int, world_size: int) -> None:
    """Environment that makes Lightning treat the benchmark's processes as externally launched
    (TorchElastic-style), so ``Trainer.fit`` runs inside them without starting new ones."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_RUN_ID="sparselift-bench")
