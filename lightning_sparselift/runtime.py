"""Runtime: the executor that runs a lifted sparse path.

:func:`install` replaces the ``forward`` of every lifted ShardedEmbeddingBagCollection (on the
instance, as TorchRec's own train pipelines do) with a :class:`LiftedForward` that runs the
module's graph with our own input distribution (fbgemm permute / bucketize and
``all_to_all_single``), TorchRec's lookup modules (so parameters, fused optimizer state,
``state_dict`` and checkpoints stay TorchRec's), and our own output distribution as autograd
Functions. Every step moves the same bytes in the same layouts as TorchRec and does the same
arithmetic (the only arithmetic on the path is the /world_size of the embedding gradients, which
TorchRec applies in its backward collectives), so results are bit-identical.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparselift.lift import LiftedModule, ShardingGroup, SparseGraph


class PooledAllToAll(torch.autograd.Function):
    """Table/column-wise output dist: every rank's pooled [world*B, D_local] block goes back to
    the ranks that own the samples; the gradient takes the reverse path divided by world size."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, dim_sum_per_rank: list[int], batch_size: int, group: Any,
                column_index: Optional[Tensor]) -> Tensor:
        world = len(dim_sum_per_rank)
        local_dim = local.size(1)
        received = local.new_empty(batch_size * sum(dim_sum_per_rank))
        dist.all_to_all_single(received, local.contiguous().view(-1),
                               [batch_size * d for d in dim_sum_per_rank], [batch_size * local_dim] * world,
                               group=group)
        chunks = received.split([batch_size * d for d in dim_sum_per_rank])
        out = torch.cat([c.view(batch_size, d) for c, d in zip(chunks, dim_sum_per_rank)], dim=1)
        ctx.dims, ctx.batch_size, ctx.group, ctx.local_dim = dim_sum_per_rank, batch_size, group, local_dim
        ctx.column_index = column_index
        return out if column_index is None else out.index_select(1, column_index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        if ctx.column_index is not None:
            unpermuted = torch.empty_like(grad)
            unpermuted[:, ctx.column_index] = grad
            grad = unpermuted
        world = len(ctx.dims)
        send = torch.cat([g.contiguous().view(-1) for g in grad.split(ctx.dims, dim=1)])
        received = grad.new_empty(world * ctx.batch_size * ctx.local_dim)
        dist.all_to_all_single(received, send, [ctx.batch_size * ctx.local_dim] * world,
                               [ctx.batch_size * d for d in ctx.dims], group=ctx.group)
        return received.view(world * ctx.batch_size, ctx.local_dim).div_(world), None, None, None, None


class PooledReduceScatter(torch.autograd.Function):
    """Row-wise output dist: partial sums of every rank's rows, reduced and scattered by sample
    block; the gradient is all-gathered and divided by world size."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any) -> Tensor:
        world = dist.get_world_size(group)
        out = local.new_empty((local.size(0) // world, local.size(1)))
        dist.reduce_scatter_tensor(out, local, group=group)
        ctx.group, ctx.world, ctx.shape = group, world, local.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        full = grad.new_empty(ctx.shape)
        dist.all_gather_into_tensor(full, grad.contiguous(), group=ctx.group)
        return full.div_(ctx.world), None


@dataclass
class _GroupRuntime:
    """Tensors precomputed from a group's plain description."""

    spec: ShardingGroup
    lookup: nn.Module
    local_keys: list[str]
    recat: Optional[Tensor]
    block_sizes: Optional[Tensor]
    column_index: Optional[Tensor]


class LiftedForward:
    """The installed ``forward`` of one sharded module (identity plan: TorchRec's collectives,
    issued by us)."""

    def __init__(self, spec: LiftedModule, sharded: nn.Module, world_size: int, rank: int, group: Any,
                 device: torch.device) -> None:
        self.spec = spec
        # TorchRec's own forward, for the steps where ranks pass different batch sizes
        self.torchrec_forward = type(sharded).forward.__get__(sharded)
        self.torchrec_steps = 0
        self.world = world_size
        self.rank = rank
        self.group = group
        self.order = torch.tensor(spec.feature_order, dtype=torch.int32, device=device) if spec.feature_order else None
        self.splits = [len(g.features) for g in spec.groups]
        self.groups = []
        for g, lookup in zip(spec.groups, sharded._lookups):
            keys = g.keys_on_rank(rank) if g.sharding_type != "data_parallel" else list(g.features)
            recat = None
            if world_size > 1 and g.sharding_type != "data_parallel" and keys:
                n = len(keys)
                recat = torch.tensor([i + j * n for i in range(n) for j in range(world_size)], dtype=torch.int32,
                                     device=device)
            blocks = torch.tensor(g.block_sizes, dtype=torch.int64, device=device) if g.block_sizes else None
            columns = torch.tensor(g.column_order, dtype=torch.long, device=device) if g.column_order else None
            self.groups.append(_GroupRuntime(g, lookup, keys, recat, blocks, columns))

    def __call__(self, features: Any) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        if features.variable_stride_per_key():
            raise ValueError(f"{self.spec.path}: inputs with a variable batch size per feature (VBE) are not "
                             f"supported by the lifted executor (use executor='torchrec')")
        if list(features.keys()) != self.spec.keys:
            raise ValueError(f"{self.spec.path}: the KJT keys {features.keys()} are not in the order of the captured "
                             f"batches {self.spec.keys}; keep one key order for the whole run")
        with torch.no_grad():
            permuted = features.permute(self.spec.feature_order, self.order) if self.order is not None else features
            distributed = self._input_dist(permuted.split(self.splits))
        if distributed is None:
            # Every rank saw the same batch sizes in the splits exchange, so every rank takes this
            # branch together: TorchRec's path handles per-rank batch sizes (e.g. a short last batch).
            self.torchrec_steps += 1
            return self.torchrec_forward(features)
        embeddings = [self._output_dist(g, g.lookup(kjt), features.stride())
                      for g, kjt in zip(self.groups, distributed)]
        values = embeddings[0] if len(embeddings) == 1 else torch.cat(embeddings, dim=1)
        return KeyedTensor(keys=self.spec.embedding_names, length_per_key=self.spec.embedding_dims, values=values,
                           key_dim=1)

    # ------------------------------------------------------------------ input dist
    def _input_dist(self, parts: list[Any]) -> Optional[list[Any]]:
        """The KJT each group's lookup reads; None when ranks passed different batch sizes."""
        bucketized = [self._bucketize(g, p) if g.spec.sharding_type == "row_wise" else p
                      for g, p in zip(self.groups, parts)]
        if self.world == 1:
            return bucketized
        # splits of every group first (as TorchRec issues them), then each group's payload
        payloads = []
        for g, kjt in zip(self.groups, bucketized):
            if g.spec.sharding_type == "data_parallel":
                payloads.append(None)
                continue
            payloads.append(self._exchange_splits(g, kjt))
        strides = {tuple(p[4]) for p in payloads if p is not None}
        if any(len(set(s)) > 1 for s in strides):
            return None
        out = []
        for g, kjt, splits in zip(self.groups, bucketized, payloads):
            out.append(kjt if splits is None else self._exchange_payload(g, kjt, *splits[:4]))
        return out

    def _bucketize(self, g: _GroupRuntime, kjt: Any) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        lengths, values, weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
            kjt.lengths().view(-1), kjt.values(), bucketize_pos=False, sequence=False,
            block_sizes=g.block_sizes.to(kjt.values().dtype), my_size=self.world, weights=kjt.weights_or_none())
        return KeyedJaggedTensor(keys=list(kjt.keys()) * self.world, values=values, weights=weights,
                                 lengths=lengths.view(-1), stride=kjt.stride())

    def _send_counts(self, g: _GroupRuntime, kjt: Any) -> tuple[list[int], list[int]]:
        """Lengths and values each destination rank gets from this rank's (key-major) KJT."""
        per_rank = g.spec.features_per_rank if g.spec.sharding_type != "row_wise" else \
            [len(g.spec.features)] * self.world
        per_key = kjt.length_per_key()
        lengths, values, start = [], [], 0
        for n in per_rank:
            lengths.append(n * kjt.stride())
            values.append(sum(per_key[start:start + n]))
            start += n
        return lengths, values

    def _exchange_splits(self, g: _GroupRuntime, kjt: Any) -> tuple[list[int], list[int], list[int], list[int],
                                                                      list[int]]:
        send_lengths, send_values = self._send_counts(g, kjt)
        rows = [send_lengths, send_values] + ([send_values] if kjt.weights_or_none() is not None else [])
        rows.append([kjt.stride()] * self.world)
        send = torch.tensor(rows, dtype=torch.int64).t().contiguous().view(-1)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        table = received.view(self.world, len(rows)).tolist()
        return send_lengths, send_values, [row[0] for row in table], [row[1] for row in table], [r[-1] for r in table]

    def _exchange_payload(self, g: _GroupRuntime, kjt: Any, send_lengths: list[int], send_values: list[int],
                          recv_lengths: list[int], recv_values: list[int]) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        batch = kjt.stride()
        tensors = [(kjt.lengths(), send_lengths, recv_lengths), (kjt.values(), send_values, recv_values)]
        weights = kjt.weights_or_none()
        if weights is not None:
            tensors.append((weights, send_values, recv_values))
        outputs, works = [], []
        for tensor, send, recv in tensors:
            out = tensor.new_empty(sum(recv))
            works.append(dist.all_to_all_single(out, tensor, recv, send, group=self.group, async_op=True))
            outputs.append(out)
        for work in works:
            work.wait()
        lengths, values = outputs[0], outputs[1]
        weights = outputs[2] if weights is not None else None
        if g.recat is not None:
            lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
                g.recat, lengths.view(-1, batch), values, weights, values.numel())
            lengths = lengths.view(-1)
        return KeyedJaggedTensor(keys=g.local_keys, values=values, weights=weights, lengths=lengths,
                                 stride=batch * self.world).sync()

    # ------------------------------------------------------------------ output dist
    def _output_dist(self, g: _GroupRuntime, local: Tensor, batch_size: int) -> Tensor:
        kind = g.spec.sharding_type
        if self.world == 1 or kind == "data_parallel":
            return local
        if kind == "row_wise":
            return PooledReduceScatter.apply(local, self.group)
        return PooledAllToAll.apply(local, g.spec.dim_sum_per_rank, batch_size, self.group, g.column_index)


@dataclass
class InstalledExecutor:
    """What :func:`install` changed; :meth:`uninstall` restores TorchRec's path."""

    graph: SparseGraph
    forwards: dict[str, LiftedForward]
    _restore: list[Callable[[], None]]

    def uninstall(self) -> None:
        for restore in self._restore:
            restore()
        self._restore.clear()


def install(graph: SparseGraph, model: nn.Module, group: Any, device: torch.device) -> InstalledExecutor:
    """Run every module of ``graph`` through a :class:`LiftedForward` from now on."""
    world = dist.get_world_size(group) if graph.world_size > 1 else 1
    if world != graph.world_size:
        raise ValueError(f"the graph was lifted for {graph.world_size} rank(s), the process group has {world}")
    rank = dist.get_rank(group) if world > 1 else 0
    forwards, restore = {}, []
    for spec in graph.modules:
        sharded = model.get_submodule(spec.path)
        forward = LiftedForward(spec, sharded, world, rank, group, device)
        had_own = "forward" in sharded.__dict__
        previous = sharded.__dict__.get("forward")
        sharded.forward = forward

        def undo(sharded: nn.Module = sharded, had_own: bool = had_own, previous: Any = previous) -> None:
            if had_own:
                sharded.forward = previous
            else:
                del sharded.forward

        forwards[spec.path] = forward
        restore.append(undo)
    return InstalledExecutor(graph, forwards, restore)


class SparsePathWarmup:
    """Capture the first ``warmup_batches`` training steps on TorchRec's path, then lift the
    sparse path, check every rank built the same graph, and install the lifted executor.

    Wrap each training step (forward, backward, optimizer step) in :meth:`step`. All ranks take
    the same decision: if any rank cannot lift (:class:`~lightning_sparselift.lift.LiftError`),
    every rank keeps TorchRec's path and :attr:`fallback_reason` says why; if ranks lift
    different graphs, every rank raises.
    """

    def __init__(self, model: nn.Module, sharding_plan: Any, module_paths: list[str], warmup_batches: int,
                 group: Any, device: torch.device) -> None:
        from lightning_sparselift.capture import SparseCapture

        if warmup_batches < 1:
            raise ValueError("the lifted executor needs warmup_batches >= 1: TorchRec builds its dists on the first "
                             "forward, and the lift is checked against them")
        self.model, self.plan, self.paths = model, sharding_plan, module_paths
        self.warmup_batches, self.group, self.device = warmup_batches, group, device
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.capture: Optional[Any] = SparseCapture(model, module_paths, rank, self.world)
        self.installed: Optional[InstalledExecutor] = None
        self.fallback_reason: Optional[str] = None
        self.lift_seconds = 0.0

    @property
    def done(self) -> bool:
        return self.capture is None

    def step(self) -> Any:
        return self.capture.step() if self.capture is not None else nullcontext()

    def after_step(self) -> bool:
        """Call after each wrapped step; lifts and installs once enough steps were captured.
        Returns True on the step that finished the warmup."""
        if self.capture is None or self.capture.steps < self.warmup_batches:
            return False
        start = time.perf_counter()
        self._lift_and_install()
        self.lift_seconds = time.perf_counter() - start
        return True

    def _all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _lift_and_install(self) -> None:
        from lightning_sparselift.capture import gather_captures
        from lightning_sparselift.lift import LiftError, check_against_runtime, dense_parameter_bytes, lift

        capture, self.capture = self.capture, None
        capture.remove()
        captures = gather_captures(capture.result(), self.group)
        errors = [e for errors in self._all_gather(capture.errors()) for e in errors]
        graph, status = None, None
        if not errors:
            try:
                graph = lift(self.model, self.plan, self.paths, captures, self.group, self.device,
                             dense_parameter_bytes(self.model, self.paths))
                check_against_runtime(graph, self.model)
                status = graph.fingerprint()
            except LiftError as error:
                status = f"error: {error}"
        statuses = self._all_gather(status)
        errors += sorted({s[len("error: "):] for s in statuses if s and s.startswith("error: ")})
        if errors:
            self.fallback_reason = "; ".join(sorted(set(errors)))
            return
        if len(set(statuses)) > 1:
            raise RuntimeError(f"ranks lifted different sparse graphs (fingerprints by rank: {statuses}); they would "
                               f"issue different collectives. Check that every rank runs the same model and sharding "
                               f"plan with the same input features.")
        self.installed = install(graph, self.model, self.group, self.device)
