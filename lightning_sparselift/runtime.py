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

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparselift.capture import copy_features, resolve_features, same_features
from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.lift import LiftedModule, ShardingGroup, SparseGraph
from lightning_sparselift.validation import InputCheck


@dataclass
class PooledLayout:
    """The layout of one (possibly merged) table/column-wise output all-to-all: every rank's
    pooled [world*B, D_local] blocks go back to the ranks that own the samples (per destination:
    its B rows of every group, group after group); the gradients take the reverse path and are
    divided by world size, as TorchRec's backward all-to-all does."""

    dims: list[list[int]]  # per group: output columns of each rank
    batch_size: int
    group: Any
    column_index: list[Optional[Tensor]]  # per group: column permutation after the exchange
    rank: int

    @property
    def world(self) -> int:
        return len(self.dims[0])

    def send_outputs(self, locals_: tuple[Tensor, ...]) -> tuple[Tensor, list[int], list[int]]:
        b = self.batch_size
        if len(locals_) == 1 and locals_[0].is_contiguous():
            send = locals_[0].view(-1)  # one group: its destination blocks are already consecutive rows
        else:
            send = torch.cat([local[r * b:(r + 1) * b].reshape(-1) for r in range(self.world) for local in locals_])
        recv_sizes = [b * sum(d[s] for d in self.dims) for s in range(self.world)]
        return send, recv_sizes, [b * sum(d[self.rank] for d in self.dims)] * self.world

    def unpack_outputs(self, received: Tensor) -> tuple[Tensor, ...]:
        b = self.batch_size
        per_group: list[list[Tensor]] = [[] for _ in self.dims]
        for s, chunk in enumerate(received.split([b * sum(d[s] for d in self.dims) for s in range(self.world)])):
            for g, piece in enumerate(chunk.split([b * d[s] for d in self.dims])):
                per_group[g].append(piece.view(b, self.dims[g][s]))
        outs = []
        for pieces, index in zip(per_group, self.column_index):
            out = torch.cat(pieces, dim=1)
            outs.append(out if index is None else out.index_select(1, index))
        return tuple(outs)

    def send_grads(self, grads: tuple[Tensor, ...]) -> tuple[Tensor, list[int], list[int]]:
        b = self.batch_size
        by_source = []
        for grad, index, d in zip(grads, self.column_index, self.dims):
            if index is not None:
                unpermuted = torch.empty_like(grad)
                unpermuted[:, index] = grad
                grad = unpermuted
            by_source.append(grad.split(d, dim=1))
        send_sizes = [b * sum(d[s] for d in self.dims) for s in range(self.world)]
        send = grads[0].new_empty(sum(send_sizes))
        offset = 0
        for s in range(self.world):  # each source rank's columns, copied once into their place
            for g, d in enumerate(self.dims):
                send[offset:offset + b * d[s]].view(b, d[s]).copy_(by_source[g][s])
                offset += b * d[s]
        local = sum(b * d[self.rank] for d in self.dims)
        return send, [local] * self.world, send_sizes

    def unpack_grads(self, received: Tensor) -> list[Tensor]:
        b, world = self.batch_size, self.world
        if len(self.dims) == 1:  # one group: the sources' blocks are already its rows, in order
            return [received.view(world * b, self.dims[0][self.rank]).div_(world)]
        local_sizes = [b * d[self.rank] for d in self.dims]
        per_group: list[list[Tensor]] = [[] for _ in self.dims]
        for chunk in received.split([sum(local_sizes)] * world):
            for g, piece in enumerate(chunk.split(local_sizes)):
                per_group[g].append(piece.view(b, self.dims[g][self.rank]))
        return [torch.cat(p).div_(world) for p in per_group]


def _exchange(send: Tensor, recv_sizes: list[int], send_sizes: list[int], group: Any, async_op: bool = False
              ) -> tuple[Tensor, Any]:
    received = send.new_empty(sum(recv_sizes))
    work = dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=group, async_op=async_op)
    return received, work


class MergedPooledAllToAll(torch.autograd.Function):
    """The output all-to-all of :class:`PooledLayout`, synchronous in both directions."""

    @staticmethod
    def forward(ctx: Any, layout: PooledLayout, clock: RegionClock, *locals_: Tensor) -> tuple[Tensor, ...]:
        received, _ = _exchange(*layout.send_outputs(locals_), layout.group)
        ctx.layout, ctx.clock = layout, clock
        return layout.unpack_outputs(received)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        with ctx.clock.region():
            received, _ = _exchange(*ctx.layout.send_grads(grads), ctx.layout.group)
            return (None, None, *ctx.layout.unpack_grads(received))


class IssuePooledAllToAll(torch.autograd.Function):
    """Starts the output all-to-all; :class:`WaitPooledAllToAll` finishes it. In backward the
    roles swap: the wait's backward starts the gradient all-to-all and this backward waits for
    it, so whatever autograd runs in between (the backward of compute that ran between issue and
    wait in forward, e.g. the bottom MLP) overlaps the exchange."""

    @staticmethod
    def forward(ctx: Any, layout: PooledLayout, box: dict, clock: RegionClock, *locals_: Tensor) -> Tensor:
        received, box["work"] = _exchange(*layout.send_outputs(locals_), layout.group, async_op=True)
        ctx.layout, ctx.box, ctx.clock = layout, box, clock
        return received

    @staticmethod
    def backward(ctx: Any, _unused: Tensor) -> tuple[Optional[Tensor], ...]:
        with ctx.clock.region():
            ctx.box.pop("grad_work").wait()
            return (None, None, None, *ctx.layout.unpack_grads(ctx.box.pop("grad_received")))


class WaitPooledAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, received: Tensor, layout: PooledLayout, box: dict, clock: RegionClock) -> tuple[Tensor, ...]:
        with clock.region():
            box.pop("work").wait()
        ctx.layout, ctx.box, ctx.shape = layout, box, received.shape
        return layout.unpack_outputs(received)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        ctx.box["grad_received"], ctx.box["grad_work"] = _exchange(*ctx.layout.send_grads(grads), ctx.layout.group,
                                                                   async_op=True)
        # the issue's backward reads the gradient from the box; this one only orders autograd
        return grads[0].new_empty(ctx.shape), None, None, None


class PooledReduceScatter(torch.autograd.Function):
    """Row-wise output dist: partial sums of every rank's rows, reduced and scattered by sample
    block; the gradient is all-gathered and divided by world size."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any, clock: RegionClock) -> Tensor:
        world = dist.get_world_size(group)
        out = local.new_empty((local.size(0) // world, local.size(1)))
        dist.reduce_scatter_tensor(out, local, group=group)
        ctx.group, ctx.world, ctx.shape, ctx.clock = group, world, local.shape, clock
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        with ctx.clock.region():
            full = grad.new_empty(ctx.shape)
            dist.all_gather_into_tensor(full, grad.contiguous(), group=ctx.group)
            return full.div_(ctx.world), None, None


@dataclass
class _GroupRuntime:
    """Tensors precomputed from a group's plain description."""

    spec: ShardingGroup
    lookup: nn.Module
    local_keys: list[str]
    recat: Optional[Tensor]
    block_sizes: Optional[Tensor]
    column_index: Optional[Tensor]


@dataclass
class _Prefetch:
    """The next batch's input distribution, started during the step before (``next_batch``)."""

    features: Any  # a copy of what was distributed (the batch may be changed in place before its step)
    complete: Optional[Callable[[], list[Any]]]  # waits and returns each group's KJT; None: uneven batch sizes

    def drain(self) -> None:
        """Finish this rank's side of the exchange without using it."""
        if self.complete is not None:
            self.complete()


class LiftedForward:
    """The installed ``forward`` of one sharded module (identity plan: TorchRec's collectives,
    issued by us)."""

    def __init__(self, spec: LiftedModule, sharded: nn.Module, world_size: int, rank: int, group: Any,
                 device: torch.device, clock: RegionClock) -> None:
        self.spec = spec
        self.module = sharded
        self.clock = clock
        self._pending: Optional[tuple[Any, tuple[list[Tensor], list[tuple]]]] = None
        self._upcoming: Any = None  # the features of the next training step, as the loop announced them
        self._prefetch: Optional[_Prefetch] = None
        # TorchRec's own forward, for the steps where ranks pass different batch sizes
        self.torchrec_forward = type(sharded).forward.__get__(sharded)
        self.torchrec_steps = 0
        self.early_steps = 0  # calls finished from a latency-hiding early start
        self.early_starts = 0  # early starts that ran (one per step unless a start is discarded)
        self.prefetches = 0  # next-batch input distributions started
        self.prefetched_steps = 0  # training calls whose input distribution the step before started
        self.follow(spec)
        self.world = world_size
        self.rank = rank
        self.group = group
        self.device = device
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

    def follow(self, spec: LiftedModule) -> None:
        """Switch to what ``spec`` (this module after the plan's passes) asks for."""
        self.aggregate_input = "input" in spec.aggregated
        self.aggregate_output = "output" in spec.aggregated
        self.early_start = "early_start" in spec.schedules
        self.next_batch = "next_batch" in spec.schedules

    def _check(self, features: Any) -> None:
        if features.variable_stride_per_key():
            raise ValueError(f"{self.spec.path}: inputs with a variable batch size per feature (VBE) are not "
                             f"supported by the lifted executor (use executor='torchrec')")
        if list(features.keys()) != self.spec.keys:
            raise ValueError(f"{self.spec.path}: the KJT keys {features.keys()} are not in the order of the captured "
                             f"batches {self.spec.keys}; keep one key order for the whole run")

    def __call__(self, features: Any) -> Any:
        self._check(features)
        if self._pending is not None and same_features(self._pending[0], features):
            _, (out, pending) = self._pending
            self._pending = None
            self.early_steps += 1
            result = self._finish(out, pending)
        else:
            self._discard_pending()
            ran = self._run(features, defer=False)
            if ran is None:
                # Every rank saw the same batch sizes in the splits exchange, so every rank takes this
                # branch together: TorchRec's path handles per-rank batch sizes (e.g. a short last batch).
                self.torchrec_steps += 1
                result = self.torchrec_forward(features)
            else:
                result = self._finish(*ran)
        if self.next_batch and self._upcoming is not None and self._training():
            self._start_next()
        return result

    def start(self, features: Any) -> None:
        """Latency hiding: run this step's input dist and lookups now and leave the output
        all-to-all in flight; the module's call with the same ``features`` finishes it."""
        if self._pending is not None and same_features(self._pending[0], features):
            # the root forward ran again on the same input: Lightning calls the LightningModule for
            # its forward redirection and again in training_step (with DDP's copy of the batch)
            return
        self._discard_pending()
        self._run_pre_hooks(features)
        self._check(features)
        result = self._run(features, defer=True)
        self.early_starts += 1
        if result is not None:  # (None: uneven batch sizes; the call hands the step to TorchRec)
            self._pending = (features, result)

    def announce(self, features: Any) -> None:
        """The features the next training step will pass (None: unknown). With ``next_batch``
        their input distribution starts after this step's call, and their input check now (its
        ranks' all-gather runs during this step's work until then)."""
        self._upcoming = features
        if self.next_batch and features is not None:
            for hook in self.module._forward_pre_hooks.values():
                if isinstance(hook, InputCheck):
                    hook.start(features, backward=True)

    def _start_next(self) -> None:
        features, self._upcoming = self._upcoming, None
        if features.device() != self.device:
            features = features.to(self.device, non_blocking=True)
        self._run_pre_hooks(features)  # e.g. input validation, before its ids go to other ranks
        self._check(features)
        self._discard_prefetch()
        with self.clock.region():
            self._prefetch = _Prefetch(copy_features(features), self._start_input_dist(features))
        self.prefetches += 1

    def _take_prefetch(self, features: Any) -> Optional[_Prefetch]:
        """The prefetched input distribution of this training step's ``features``."""
        if self._prefetch is None or not self._training():
            return None  # (an evaluation call in between leaves it for the next training step)
        prefetch, self._prefetch = self._prefetch, None
        if not same_features(prefetch.features, features):
            prefetch.drain()
            raise RuntimeError(
                f"{self.spec.path}: this training step's features are not the ones the training loop announced as "
                f"next (their input distribution started during the previous step): a hook, callback or the model "
                f"changed the batch after it was announced. Plan without the next-batch schedule "
                f"(optimizations=['aggregation', 'latency_hiding:early_start']) or stop changing the sparse "
                f"features after loading.")
        self.prefetched_steps += 1
        return prefetch

    def _training(self) -> bool:
        return self.module.training and torch.is_grad_enabled()

    def _run_pre_hooks(self, features: Any) -> None:
        """The module's forward pre-hooks (e.g. input validation), for work started outside its call."""
        for hook_id, hook in self.module._forward_pre_hooks.items():
            if hook_id in self.module._forward_pre_hooks_with_kwargs:
                hook(self.module, (features,), {})
            else:
                hook(self.module, (features,))

    def _discard_pending(self) -> None:
        if self._pending is not None:  # started but never consumed: complete the exchange, drop it
            for *_, box, _received in self._pending[1][1]:
                box.pop("work").wait()
            self._pending = None

    def _discard_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.drain()
            self._prefetch = None

    def discard(self) -> None:
        """Complete and drop work started for a step that will not run (training ended)."""
        self._discard_pending()
        self._discard_prefetch()
        self._upcoming = None

    def _run(self, features: Any, defer: bool) -> Optional[tuple[list[Tensor], list[tuple]]]:
        with self.clock.region():
            prefetch = self._take_prefetch(features)
            complete = prefetch.complete if prefetch is not None else self._start_input_dist(features)
            if complete is None:
                return None
            distributed = complete()
            return self._output_dist([g.lookup(kjt) for g, kjt in zip(self.groups, distributed)], features.stride(),
                                     defer)

    def _finish(self, out: list[Tensor], pending: list[tuple]) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        for indices, layout, box, received in pending:
            for i, tensor in zip(indices, WaitPooledAllToAll.apply(received, layout, box, self.clock)):
                out[i] = tensor
        values = out[0] if len(out) == 1 else torch.cat(out, dim=1)
        return KeyedTensor(keys=self.spec.embedding_names, length_per_key=self.spec.embedding_dims, values=values,
                           key_dim=1)

    # ------------------------------------------------------------------ input dist
    @torch.no_grad()
    def _start_input_dist(self, features: Any) -> Optional[Callable[[], list[Any]]]:
        """Permute, bucketize, exchange the splits and issue the payload all-to-alls. Returns
        what waits for them and builds the KJT each group's lookup reads; None when ranks passed
        different batch sizes."""
        permuted = features.permute(self.spec.feature_order, self.order) if self.order is not None else features
        parts = permuted.split(self.splits)
        bucketized = [self._bucketize(g, p) if g.spec.sharding_type == "row_wise" else p
                      for g, p in zip(self.groups, parts)]
        exchanged = [i for i, g in enumerate(self.groups) if g.spec.sharding_type != "data_parallel"]
        if self.world == 1 or not exchanged:
            return (lambda: bucketized) if features.stride() > 0 else None
        kjts = [bucketized[i] for i in exchanged]
        groups = [self.groups[i] for i in exchanged]
        counts = [self._send_counts(g, kjt) for g, kjt in zip(groups, kjts)]
        received = self._exchange_splits(kjts, counts)
        if len({row[-1] for table in received for row in table}) > 1 or features.stride() == 0:
            return None  # every rank knows every rank's batch size here, so all hand the step to TorchRec
        recv = [([row[0] for row in table], [row[1] for row in table]) for table in received]
        if self.aggregate_input:
            wait = self._exchange_packed(kjts, counts, recv)
        else:
            waits = [self._exchange_tensors(kjt, send, got) for kjt, send, got in zip(kjts, counts, recv)]
            wait = lambda: [w() for w in waits]  # noqa: E731

        def complete() -> list[Any]:
            with torch.no_grad():
                out = list(bucketized)
                for i, g, kjt, (lengths, values, weights) in zip(exchanged, groups, kjts, wait()):
                    out[i] = self._received_kjt(g, lengths, values, weights, kjt.stride())
                return out

        return complete

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

    def _exchange_splits(self, kjts: list[Any], counts: list[tuple[list[int], list[int]]]) -> list[list[list[int]]]:
        """Per group, per source rank: [lengths, values, (weights,) batch size] it sends here. One
        all-to-all per group (TorchRec's layout), or one for all groups when aggregated."""
        rows = []
        for kjt, (lengths, values) in zip(kjts, counts):
            group_rows = [lengths, values] + ([values] if kjt.weights_or_none() is not None else [])
            rows.append(torch.tensor(group_rows + [[kjt.stride()] * self.world], dtype=torch.int64).t())
        if self.aggregate_input:
            send = torch.cat(rows, dim=1).contiguous()  # [dst, all groups' columns]
            received = torch.empty_like(send)
            dist.all_to_all_single(received, send, group=self.group)
            tables = received.split([r.size(1) for r in rows], dim=1)
        else:
            tables = []
            for row in rows:
                send = row.contiguous()
                received = torch.empty_like(send)
                dist.all_to_all_single(received, send, group=self.group)
                tables.append(received)
        return [t.tolist() for t in tables]

    def _exchange_tensors(self, kjt: Any, send: tuple[list[int], list[int]], recv: tuple[list[int], list[int]]
                          ) -> Callable[[], tuple[Tensor, Tensor, Optional[Tensor]]]:
        """TorchRec's payload exchange: one all-to-all each for lengths, values and weights,
        issued now; the returned function waits for them."""
        tensors = [(kjt.lengths(), send[0], recv[0]), (kjt.values(), send[1], recv[1])]
        if kjt.weights_or_none() is not None:
            tensors.append((kjt.weights(), send[1], recv[1]))
        outputs, works = [], []
        for tensor, out_splits, in_splits in tensors:
            out = tensor.new_empty(sum(in_splits))
            works.append(dist.all_to_all_single(out, tensor, in_splits, out_splits, group=self.group,
                                                async_op=True))
            outputs.append(out)

        def wait() -> tuple[Tensor, Tensor, Optional[Tensor]]:
            for work in works:
                work.wait()
            return outputs[0], outputs[1], outputs[2] if len(outputs) > 2 else None

        return wait

    def _exchange_packed(self, kjts: list[Any], counts: list[tuple[list[int], list[int]]],
                         recv: list[tuple[list[int], list[int]]]
                         ) -> Callable[[], list[tuple[Tensor, Tensor, Optional[Tensor]]]]:
        """Every group's lengths, values and weights in one byte-packed all-to-all (see
        :func:`pack_by_destination`), issued now; the returned function waits and unpacks."""
        sections = []  # per group: [(tensor, send counts, recv counts)] for values, weights, lengths
        for kjt, send, got in zip(kjts, counts, recv):
            group = [(kjt.values(), send[1], got[1])]
            if kjt.weights_or_none() is not None:
                group.append((kjt.weights(), send[1], got[1]))
            group.append((kjt.lengths(), send[0], got[0]))
            sections.append(group)
        flat = [sec for group in sections for sec in group]
        buffer, send_bytes = pack_by_destination([(t, c) for t, c, _ in flat], self.world)
        recv_layout = [(t.dtype, got) for t, _, got in flat]
        recv_bytes = packed_sizes(recv_layout, self.world)
        received = buffer.new_empty(sum(recv_bytes))
        work = dist.all_to_all_single(received, buffer, recv_bytes, send_bytes, group=self.group, async_op=True)

        def wait() -> list[tuple[Tensor, Tensor, Optional[Tensor]]]:
            work.wait()
            unpacked = unpack_by_source(received, recv_layout, recv_bytes)
            out, i = [], 0
            for group in sections:
                values = unpacked[i]
                weights = unpacked[i + 1] if len(group) == 3 else None
                lengths = unpacked[i + len(group) - 1]
                out.append((lengths, values, weights))
                i += len(group)
            return out

        return wait

    def _received_kjt(self, g: _GroupRuntime, lengths: Tensor, values: Tensor, weights: Optional[Tensor],
                      batch: int) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        if g.recat is not None:
            lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
                g.recat, lengths.view(-1, batch), values, weights, values.numel())
            lengths = lengths.view(-1)
        return KeyedJaggedTensor(keys=g.local_keys, values=values, weights=weights, lengths=lengths,
                                 stride=batch * self.world).sync()

    # ------------------------------------------------------------------ output dist
    def _output_dist(self, locals_: list[Tensor], batch_size: int, defer: bool) -> tuple[list[Tensor], list[tuple]]:
        """Every group's output (data-parallel and one-rank groups as they are), and the output
        all-to-alls left in flight when ``defer``."""
        out, pending = list(locals_), []
        if self.world == 1:
            return out, pending
        pooled = [i for i, g in enumerate(self.groups) if g.spec.sharding_type in ("table_wise", "column_wise")]
        exchanges = [pooled] if self.aggregate_output and len(pooled) > 1 else [[i] for i in pooled]
        for indices in exchanges:
            layout = PooledLayout([self.groups[i].spec.dim_sum_per_rank for i in indices], batch_size, self.group,
                                  [self.groups[i].column_index for i in indices], self.rank)
            tensors = [locals_[i] for i in indices]
            if defer:
                box: dict = {}
                pending.append((indices, layout, box, IssuePooledAllToAll.apply(layout, box, self.clock, *tensors)))
            else:
                for i, tensor in zip(indices, MergedPooledAllToAll.apply(layout, self.clock, *tensors)):
                    out[i] = tensor
        for i, g in enumerate(self.groups):
            if g.spec.sharding_type == "row_wise":
                out[i] = PooledReduceScatter.apply(locals_[i], self.group, self.clock)
        return out, pending


def packed_sizes(layout: list[tuple[torch.dtype, list[int]]], world: int) -> list[int]:
    """Bytes per rank of a packed buffer holding, per rank, ``counts[rank]`` elements of each
    section, sections ordered by element size (largest first), each rank's chunk padded to 8."""
    sizes = []
    for rank in range(world):
        nbytes = sum(counts[rank] * dtype.itemsize for dtype, counts in layout)
        sizes.append((nbytes + 7) // 8 * 8)
    return sizes


def _section_order(dtypes: list[torch.dtype]) -> list[int]:
    # largest elements first: every section then starts aligned to its element size
    return sorted(range(len(dtypes)), key=lambda i: -dtypes[i].itemsize)


def pack_by_destination(sections: list[tuple[Tensor, list[int]]], world: int) -> tuple[Tensor, list[int]]:
    """One uint8 buffer holding, for each destination rank in turn, its slice of every section
    (``counts[rank]`` consecutive elements of each 1-D tensor): a lossless byte-level packing of
    tensors of different dtypes into one all-to-all. Returns the buffer and bytes per destination.

    Example (2 ranks; values int64 counts [2, 1], lengths int32 counts [1, 1])::

        [v0 v1 | l0 pad] [v2 | l1 pad]     each destination chunk 8-byte aligned
    """
    order = _section_order([t.dtype for t, _ in sections])
    pieces = [[] for _ in range(world)]
    for i in order:
        tensor, counts = sections[i]
        for rank, piece in enumerate(tensor.contiguous().view(torch.uint8).split(
                [c * tensor.element_size() for c in counts])):
            pieces[rank].append(piece)
    sizes = packed_sizes([(t.dtype, c) for t, c in sections], world)
    device = sections[0][0].device
    chunks = []
    for rank in range(world):
        used = sum(p.numel() for p in pieces[rank])
        chunks.extend(pieces[rank])
        if sizes[rank] > used:
            chunks.append(torch.zeros(sizes[rank] - used, dtype=torch.uint8, device=device))
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=device), sizes


def unpack_by_source(buffer: Tensor, layout: list[tuple[torch.dtype, list[int]]], sizes: list[int]) -> list[Tensor]:
    """Inverse of :func:`pack_by_destination` on the receiving side: per section, the elements
    every source rank sent, concatenated in source order."""
    order = _section_order([dtype for dtype, _ in layout])
    parts: list[list[Tensor]] = [[] for _ in layout]
    for rank, chunk in enumerate(buffer.split(sizes)):
        offset = 0
        for i in order:
            dtype, counts = layout[i]
            nbytes = counts[rank] * dtype.itemsize
            parts[i].append(chunk[offset:offset + nbytes].view(dtype))
            offset += nbytes
    return [torch.cat(p) if len(p) > 1 else p[0].clone() for p in parts]


@dataclass
class InstalledExecutor:
    """What :func:`install` changed; :meth:`use` switches plans, :meth:`uninstall` restores
    TorchRec's path."""

    graph: SparseGraph
    forwards: dict[str, LiftedForward]
    clock: RegionClock
    _restore: list[Callable[[], None]]

    def use(self, graph: SparseGraph) -> None:
        """Run ``graph`` (the installed graph after passes: same modules, other collectives)."""
        if sorted(m.path for m in graph.modules) != sorted(self.forwards):
            raise ValueError(f"graph modules {[m.path for m in graph.modules]} are not the installed "
                             f"{sorted(self.forwards)}")
        for spec in graph.modules:
            self.forwards[spec.path].follow(spec)
        self.graph = graph

    def announce(self, batch: Any) -> None:
        """The batch the next training step will pass to the model (None: not known). Modules
        planned with ``next_batch`` start its input distribution during this step."""
        for forward in self.forwards.values():
            path = forward.spec.batch_input
            forward.announce(resolve_features((batch,), {}, path, forward.spec.keys)
                             if batch is not None and path is not None else None)

    def discard(self) -> None:
        """Training ended: complete and drop what was started for a step that will not run."""
        for forward in self.forwards.values():
            forward.discard()

    def uninstall(self) -> None:
        self.discard()
        for restore in self._restore:
            restore()
        self._restore.clear()


def install(graph: SparseGraph, model: nn.Module, group: Any, device: torch.device) -> InstalledExecutor:
    """Run every module of ``graph`` through a :class:`LiftedForward` from now on. ``model`` is
    the root whose forward the training step calls (where latency hiding starts modules early)."""
    world = dist.get_world_size(group) if graph.world_size > 1 else 1
    if world != graph.world_size:
        raise ValueError(f"the graph was lifted for {graph.world_size} rank(s), the process group has {world}")
    rank = dist.get_rank(group) if world > 1 else 0
    clock = RegionClock(device)
    forwards, restore = {}, []
    for spec in graph.modules:
        sharded = model.get_submodule(spec.path)
        forward = LiftedForward(spec, sharded, world, rank, group, device, clock)
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

    def start_early(_root: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (_root.training and torch.is_grad_enabled()):
            return
        for forward in forwards.values():
            if forward.early_start and forward.spec.root_input is not None:
                features = resolve_features(args, kwargs, forward.spec.root_input, forward.spec.keys)
                if features is not None:  # (None: this call's arguments hold no such KJT there)
                    forward.start(features)

    restore.append(model.register_forward_pre_hook(start_early, with_kwargs=True).remove)
    return InstalledExecutor(graph, forwards, clock, restore)
