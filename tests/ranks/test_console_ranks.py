"""Sharding on two ranks prints nothing and leaves DDP's buffers rank-local (TorchRec's defaults
fixed where they came from; in one process: tests/unit/test_console.py)."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from helpers import free_port
from lightning_sparselift.embedding_optimizer import EmbeddingOptimizer


class _WithBuffer(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                              feature_names=["f"])], device=torch.device("meta"))
        torch.manual_seed(rank)  # a different dense parameter on each rank: DDP broadcasts rank 0's
        self.dense = nn.Linear(3, 4)
        self.register_buffer("mine", torch.full((2,), float(rank)))  # rank-local: DDP must leave it alone


def _sharding_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from lightning_sparselift.cost.calibration import RegionClock
    from lightning_sparselift.runtime.collectives import PooledReduceScatter
    from lightning_sparselift.runtime.layout import Wire
    from lightning_sparselift.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(f"{record.name}: {record.getMessage()}")

    logging.getLogger().addHandler(Collect())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = _WithBuffer(rank)
            sharded = shard_model(module, world, torch.device("cpu"), {"t": "table_wise"}, EmbeddingOptimizer("sgd"),
                                  dist.group.WORLD, None)
            ddp = sharded.dmp._dmp_wrapped_module
            # the runtime's row-wise collectives (reduce-scatter forward, all-gather backward)
            local = torch.arange(8.0).reshape(4, 2).mul(rank + 1).requires_grad_()
            reduced = PooledReduceScatter.apply(local, dist.group.WORLD, RegionClock(torch.device("cpu")), Wire())
            reduced.backward(torch.ones_like(reduced) * (rank + 1))
        # (DeprecationWarnings are not shown outside __main__ by default; torch.jit's are in TorchRec's code)
        shown = [w for w in caught if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))]
        torch.save({"warnings": [f"{w.category.__name__}: {w.message}" for w in shown], "logs": records,
                    "buffer": module.mine.clone(), "weight": module.dense.weight.detach().clone(),
                    "forward_sync_buffers": ddp.forward_sync_buffers, "ddp": type(ddp).__name__,
                    "reduced": reduced.detach(), "grad": local.grad}, os.path.join(out, f"rank{rank}.pt"))
        del ddp, sharded  # DDP's reducer and the sharded modules hold the process group: gone before it
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharding_on_two_ranks_warns_nothing_and_leaves_buffers_rank_local(tmp_path):
    try:
        mp.start_processes(_sharding_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    except mp.ProcessExitedException as error:
        # both workers finished their work (and destroyed their group), then one aborted at exit:
        # the intermittent exit-time abort of gloo workers, not diagnosed yet
        if error.signal_name == "SIGABRT" and all((tmp_path / f"rank{r}.pt").exists() for r in range(2)):
            pytest.xfail("a worker aborted at interpreter exit after finishing (known intermittent gloo exit abort)")
        raise
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, res in enumerate(results):
        assert res["warnings"] == [] and res["logs"] == [], (res["warnings"], res["logs"])
        assert res["ddp"] == "DistributedDataParallel" and res["forward_sync_buffers"] is False
        assert torch.equal(res["buffer"], torch.full((2,), float(rank)))  # as broadcast_buffers=False: not synced
        # reduce-scatter of rank r's (r + 1) * arange: the sum, 3 * arange, rank r's block of 2 rows
        assert torch.equal(res["reduced"], torch.arange(8.0).reshape(4, 2)[2 * rank:2 * rank + 2] * 3)
        # all-gather of each rank's gradient block ((r + 1) everywhere), / world
        assert torch.equal(res["grad"], torch.tensor([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]) / 2)
    assert torch.equal(results[0]["weight"], results[1]["weight"])  # parameters broadcast from rank 0
