"""``dlrm-baseline``: how the public reference DLRM (``dlrm_s_pytorch.py``, distributed mode)
trains, on the scenario's model (DLRM scenarios only)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lightning_sparselift.bench.systems.base import System, autocast, build_rec_model, dense_optimizer
from lightning_sparselift.cost.calibration import RegionClock
from lightning_sparselift.runtime.buffers import Buffers
from lightning_sparselift.runtime.collectives import IssueOutputAllToAll, WaitOutputAllToAll
from lightning_sparselift.runtime.layout import ExchangeBuffers, PooledLayout


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
    gradient all-to-all with the bottom MLP's backward, the gradient not divided by world size),
    the MLPs each in DDP, plain SGD with sparse gradients. The exchange is the runtime's issue and
    wait (:mod:`~lightning_sparselift.runtime.collectives`) over one pooled group: this rank's
    tables."""

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
        self.dense_optimizer = dense_optimizer(scenario, list(self.bottom.parameters()) + list(self.top.parameters()))
        self.dense_optimizer.register_step_pre_hook(lambda *_: self.timer.backward_end())
        # as the reference exchanges: fresh tensors every step, the gradient not divided by world size
        self.layout = PooledLayout([self.widths], env.batch_size, dist.group.WORLD, [None], env.rank,
                                   ExchangeBuffers.of(Buffers(reuse=False), [0]), divide_grads=False)
        self.clock = RegionClock(torch.device("cpu"))  # (the collectives time their waits on it; not read here)
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
        with autocast(env.precision):
            with timer.sparse_region():
                local = [bag(ids, offsets) for bag, (ids, offsets) in zip(self.bags, self._owned_inputs(step))]
                # [W*B, owned width]: per destination rank, its B rows of every owned table
                pooled = torch.cat(local, dim=1) if local else torch.zeros(w * b, 0)
                box: dict = {}
                received = IssueOutputAllToAll.apply(self.layout, box, self.clock, pooled)
            dense = self.bottom(batch.dense)
            with timer.sparse_region():
                # [B, sum of dims], in table order
                (embeddings,) = WaitOutputAllToAll.apply(received, self.layout, box, self.clock)
            timer.watch_backward(embeddings)
            logits = self.top(dense, embeddings)
            loss = nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1), batch.labels)
        timer.forward_end(loss)
        loss.backward()
        self.dense_optimizer.step()
        self.sparse_optimizer.step()
        self.dense_optimizer.zero_grad()
        self.sparse_optimizer.zero_grad()
        self.losses.append(float(loss.detach()))
