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

from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.lift import LiftedModule, ShardingGroup, SparseGraph


class MergedPooledAllToAll(torch.autograd.Function):
    """Table/column-wise output dist of one or several groups in one all-to-all: every rank's
    pooled [world*B, D_local] blocks go back to the ranks that own the samples (per destination:
    its B rows of every group, group after group); the gradients take the reverse path and are
    divided by world size, as TorchRec's backward all-to-all does."""

    @staticmethod
    def forward(ctx: Any, dims: list[list[int]], batch_size: int, group: Any, column_index: list[Optional[Tensor]],
                clock: RegionClock, *locals_: Tensor) -> tuple[Tensor, ...]:
        world = len(dims[0])
        rank = dist.get_rank(group)
        send = torch.cat([local[r * batch_size:(r + 1) * batch_size].reshape(-1)
                          for r in range(world) for local in locals_])
        recv_sizes = [batch_size * sum(d[s] for d in dims) for s in range(world)]
        received = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(received, send, recv_sizes, [batch_size * sum(d[rank] for d in dims)] * world,
                               group=group)
        per_group: list[list[Tensor]] = [[] for _ in dims]
        for s, chunk in enumerate(received.split(recv_sizes)):
            for g, piece in enumerate(chunk.split([batch_size * d[s] for d in dims])):
                per_group[g].append(piece.view(batch_size, dims[g][s]))
        outs = []
        for pieces, index in zip(per_group, column_index):
            out = torch.cat(pieces, dim=1)
            outs.append(out if index is None else out.index_select(1, index))
        ctx.dims, ctx.batch_size, ctx.group, ctx.column_index, ctx.rank = dims, batch_size, group, column_index, rank
        ctx.clock = clock
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        with ctx.clock.region():
            return (None, None, None, None, None, *MergedPooledAllToAll._local_grads(ctx, grads))

    @staticmethod
    def _local_grads(ctx: Any, grads: tuple[Tensor, ...]) -> list[Tensor]:
        dims, batch, world = ctx.dims, ctx.batch_size, len(ctx.dims[0])
        by_source = []
        for grad, index, d in zip(grads, ctx.column_index, dims):
            if index is not None:
                unpermuted = torch.empty_like(grad)
                unpermuted[:, index] = grad
                grad = unpermuted
            by_source.append(grad.split(d, dim=1))
        send = torch.cat([by_source[g][s].contiguous().view(-1) for s in range(world) for g in range(len(dims))])
        local_sizes = [batch * d[ctx.rank] for d in dims]
        received = send.new_empty(world * sum(local_sizes))
        dist.all_to_all_single(received, send, [sum(local_sizes)] * world,
                               [batch * sum(d[s] for d in dims) for s in range(world)], group=ctx.group)
        per_group: list[list[Tensor]] = [[] for _ in dims]
        for chunk in received.split([sum(local_sizes)] * world):
            for g, piece in enumerate(chunk.split(local_sizes)):
                per_group[g].append(piece.view(batch, dims[g][ctx.rank]))
        return [torch.cat(p).div_(world) for p in per_group]


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


class LiftedForward:
    """The installed ``forward`` of one sharded module (identity plan: TorchRec's collectives,
    issued by us)."""

    def __init__(self, spec: LiftedModule, sharded: nn.Module, world_size: int, rank: int, group: Any,
                 device: torch.device, clock: RegionClock) -> None:
        self.spec = spec
        self.clock = clock
        # TorchRec's own forward, for the steps where ranks pass different batch sizes
        self.torchrec_forward = type(sharded).forward.__get__(sharded)
        self.torchrec_steps = 0
        # what the execution plan switches on (communication aggregation)
        self.aggregate_input = "input" in spec.aggregated
        self.aggregate_output = "output" in spec.aggregated
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
        with self.clock.region():
            with torch.no_grad():
                permuted = features.permute(self.spec.feature_order, self.order) if self.order is not None \
                    else features
                distributed = self._input_dist(permuted.split(self.splits))
            if distributed is not None:
                embeddings = self._output_dist([g.lookup(kjt) for g, kjt in zip(self.groups, distributed)],
                                               features.stride())
        if distributed is None:
            # Every rank saw the same batch sizes in the splits exchange, so every rank takes this
            # branch together: TorchRec's path handles per-rank batch sizes (e.g. a short last batch).
            self.torchrec_steps += 1
            return self.torchrec_forward(features)
        values = embeddings[0] if len(embeddings) == 1 else torch.cat(embeddings, dim=1)
        return KeyedTensor(keys=self.spec.embedding_names, length_per_key=self.spec.embedding_dims, values=values,
                           key_dim=1)

    # ------------------------------------------------------------------ input dist
    def _input_dist(self, parts: list[Any]) -> Optional[list[Any]]:
        """The KJT each group's lookup reads; None when ranks passed different batch sizes."""
        bucketized = [self._bucketize(g, p) if g.spec.sharding_type == "row_wise" else p
                      for g, p in zip(self.groups, parts)]
        exchanged = [i for i, g in enumerate(self.groups) if g.spec.sharding_type != "data_parallel"]
        if self.world == 1 or not exchanged:
            return bucketized
        kjts = [bucketized[i] for i in exchanged]
        groups = [self.groups[i] for i in exchanged]
        counts = [self._send_counts(g, kjt) for g, kjt in zip(groups, kjts)]
        received = self._exchange_splits(kjts, counts)
        if len({row[-1] for table in received for row in table}) > 1:
            return None
        recv = [([row[0] for row in table], [row[1] for row in table]) for table in received]
        if self.aggregate_input:
            tensors = self._exchange_packed(kjts, counts, recv)
        else:
            tensors = [self._exchange_tensors(kjt, send, got) for kjt, send, got in zip(kjts, counts, recv)]
        out = list(bucketized)
        for i, g, kjt, (lengths, values, weights) in zip(exchanged, groups, kjts, tensors):
            out[i] = self._received_kjt(g, lengths, values, weights, kjt.stride())
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
            for send in rows:
                received = torch.empty_like(send.contiguous())
                dist.all_to_all_single(received, send.contiguous(), group=self.group)
                tables.append(received)
        return [t.tolist() for t in tables]

    def _exchange_tensors(self, kjt: Any, send: tuple[list[int], list[int]],
                          recv: tuple[list[int], list[int]]) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """TorchRec's payload exchange: one all-to-all each for lengths, values and weights."""
        tensors = [(kjt.lengths(), send[0], recv[0]), (kjt.values(), send[1], recv[1])]
        if kjt.weights_or_none() is not None:
            tensors.append((kjt.weights(), send[1], recv[1]))
        outputs, works = [], []
        for tensor, out_splits, in_splits in tensors:
            out = tensor.new_empty(sum(in_splits))
            works.append(dist.all_to_all_single(out, tensor, in_splits, out_splits, group=self.group,
                                                async_op=True))
            outputs.append(out)
        for work in works:
            work.wait()
        return outputs[0], outputs[1], outputs[2] if len(outputs) > 2 else None

    def _exchange_packed(self, kjts: list[Any], counts: list[tuple[list[int], list[int]]],
                         recv: list[tuple[list[int], list[int]]]) -> list[tuple[Tensor, Tensor, Optional[Tensor]]]:
        """Every group's lengths, values and weights in one byte-packed all-to-all (see
        :func:`pack_by_destination`)."""
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
        dist.all_to_all_single(received, buffer, recv_bytes, send_bytes, group=self.group)
        unpacked = unpack_by_source(received, recv_layout, recv_bytes)
        out, i = [], 0
        for group in sections:
            values = unpacked[i]
            weights = unpacked[i + 1] if len(group) == 3 else None
            lengths = unpacked[i + len(group) - 1]
            out.append((lengths, values, weights))
            i += len(group)
        return out

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
    def _output_dist(self, locals_: list[Tensor], batch_size: int) -> list[Tensor]:
        if self.world == 1:
            return locals_
        out = list(locals_)
        pooled = [i for i, g in enumerate(self.groups) if g.spec.sharding_type in ("table_wise", "column_wise")]
        if self.aggregate_output and len(pooled) > 1:
            merged = MergedPooledAllToAll.apply(
                [self.groups[i].spec.dim_sum_per_rank for i in pooled], batch_size, self.group,
                [self.groups[i].column_index for i in pooled], self.clock, *[locals_[i] for i in pooled])
            for i, tensor in zip(pooled, merged):
                out[i] = tensor
        else:
            for i in pooled:
                g = self.groups[i]
                out[i] = MergedPooledAllToAll.apply([g.spec.dim_sum_per_rank], batch_size, self.group,
                                                    [g.column_index], self.clock, locals_[i])[0]
        for i, g in enumerate(self.groups):
            if g.spec.sharding_type == "row_wise":
                out[i] = PooledReduceScatter.apply(locals_[i], self.group, self.clock)
        return out


def packed_sizes(layout: list[tuple[torch.dtype, list[int]]], world: int) -> list[int]:
    """Bytes per rank of a packed buffer holding, per rank, ``counts[rank]`` elements of each
    section, sections ordered by element size (largest first), each rank's chunk padded to 8."""
    sizes = []
    for rank in range(world):
        nbytes = sum(counts[rank] * _itemsize(dtype) for dtype, counts in layout)
        sizes.append((nbytes + 7) // 8 * 8)
    return sizes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _section_order(dtypes: list[torch.dtype]) -> list[int]:
    # largest elements first: every section then starts aligned to its element size
    return sorted(range(len(dtypes)), key=lambda i: -_itemsize(dtypes[i]))


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
            nbytes = counts[rank] * _itemsize(dtype)
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
            forward = self.forwards[spec.path]
            forward.aggregate_input = "input" in spec.aggregated
            forward.aggregate_output = "output" in spec.aggregated
        self.graph = graph

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
    return InstalledExecutor(graph, forwards, clock, restore)
