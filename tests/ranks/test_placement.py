"""Under a quantized wire TorchRec's planner prices the exchanges in the codecs' formats and may
place tables otherwise (the sequence scenario's small tables: data-parallel in float32, table-wise
under MX4), and then they train with another optimizer; ``placed_as_exact`` places them as float32
exchanges do, so a parity run compares wire formats alone."""

from __future__ import annotations

import json
import os

import torch
import torch.multiprocessing as mp

from helpers import free_port


def _placement_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    from lightning_sparselift.bench import scenarios
    from lightning_sparselift.bench.systems.base import build_rec_model
    from lightning_sparselift.embedding_optimizer import EmbeddingOptimizer
    from lightning_sparselift.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mx4 = QCommsConfig(forward_precision=CommType.MX4, backward_precision=CommType.MX4)
        placements = {}
        for name, config, exact in (("float32", None, False), ("mx4", mx4, False), ("mx4-placed-as-exact", mx4, True)):
            sharded = shard_model(build_rec_model(scenarios.load("sequence"), 1), world, torch.device("cpu"), None,
                                  EmbeddingOptimizer("sgd"), dist.group.WORLD, None, qcomms_config=config,
                                  placed_as_exact=exact)
            placements[name] = {table: [p.sharding_type, p.ranks] for module in sharded.dmp.plan.plan.values()
                                for table, p in module.items()}
            del sharded
        if rank == 0:
            with open(os.path.join(out, "placements.json"), "w") as f:
                json.dump(placements, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_quantized_wire_can_move_tables_unless_placed_as_exact(tmp_path):
    mp.start_processes(_placement_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    placements = json.loads((tmp_path / "placements.json").read_text())
    assert placements["mx4-placed-as-exact"] == placements["float32"]
    moved = {t for t, p in placements["mx4"].items() if p != placements["float32"][t]}
    assert moved, "TorchRec's planner placed the tables alike under MX4: the test no longer shows why the option exists"
    assert {placements["float32"][t][0] for t in moved} == {"data_parallel"}
