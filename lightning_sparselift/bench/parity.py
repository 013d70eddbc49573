"""Quality parity (the paper's Table 4): ``torchrec`` and ``sparselift`` trained for one epoch
from the same initial weights on the same data, then scored on the same held-out split."""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_sparselift.bench import scenarios
from lightning_sparselift.bench.runner import BenchConfig, _data, _write_atomically, spawn_workers
from lightning_sparselift.bench.systems.base import BenchEnv, build_sharded
from lightning_sparselift.bench.systems.sparselift import SparseLift
from lightning_sparselift.bench.systems.torchrec import TorchRecSparseDist

SYSTEMS = ("torchrec", "sparselift")


def _gather_1d(t: torch.Tensor) -> torch.Tensor:
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, t.numel())
    biggest = max(sizes)
    out = [t.new_zeros(biggest) for _ in sizes]
    dist.all_gather(out, torch.nn.functional.pad(t, (0, biggest - t.numel())))
    return torch.cat([o[:n] for o, n in zip(out, sizes)])


def _evaluate(env: BenchEnv, trained: torch.nn.Module, val) -> dict[str, float]:
    """Scores a fresh, unpipelined copy of ``trained`` (a train pipeline may hold prefetched
    inputs in the trained module's sharded forwards)."""
    from torchmetrics.functional.classification import binary_auroc, binary_average_precision

    model, _, _, _ = build_sharded(env, validate_inputs=False)
    model.load_state_dict(trained.state_dict())
    b, w = env.batch_size, env.world_size
    preds, labels = [], []
    with torch.no_grad():
        for i in range(len(val) // (b * w)):
            batch = val.batch((i * w + env.rank) * b, (i * w + env.rank + 1) * b)
            _, logits = model(batch)
            preds.append(torch.sigmoid(logits))
            labels.append(batch.labels)
    p, y = _gather_1d(torch.cat(preds)), _gather_1d(torch.cat(labels))
    return {"roc_auc": float(binary_auroc(p, y.long())), "ap": float(binary_average_precision(p, y.long())),
            "logloss": float(torch.nn.functional.binary_cross_entropy(p.double(), y.double())),
            "samples": int(p.numel())}


def _worker(rank: int, config: BenchConfig, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(config.threads_per_rank)
    dist.init_process_group("gloo", rank=rank, world_size=config.world_size, timeout=timedelta(seconds=config.timeout_s))
    scenario = scenarios.load(config.scenario)
    dm = _data(config, scenario)
    train = dm.split("train")
    steps = len(train) // (scenario.batch_size * config.world_size)
    env = BenchEnv(scenario, rank, config.world_size, train, seed=config.seed, pool=steps, precision=config.precision)
    torchrec, sparselift = TorchRecSparseDist(env), SparseLift(env)
    torchrec.setup()
    sparselift.setup()
    sparselift.model.load_state_dict(torchrec.dmp.state_dict())  # the same initial weights, tables included
    curves, wall = {}, {}
    for system in (torchrec, sparselift):
        start = time.perf_counter()
        for step in range(steps):
            system.step(step)
        wall[system.name] = time.perf_counter() - start
        local = torch.tensor(system.losses[:steps], dtype=torch.float64)
        dist.all_reduce(local)
        curves[system.name] = (local / config.world_size).tolist()
    val = dm.split("val")
    quality = {"torchrec": _evaluate(env, torchrec.dmp, val), "sparselift": _evaluate(env, sparselift.model, val)}
    if rank == 0:
        _write_atomically(out, {"steps": steps, "curves": curves, "quality": quality, "train_s": wall})
    dist.barrier()
    dist.destroy_process_group()


def run(config: BenchConfig) -> dict[str, Any]:
    config.validate()
    scenario = scenarios.load(config.scenario)
    _data(config, scenario)
    raw, teardown_error = spawn_workers(_worker, config, "parity.json")
    a, b = np.array(raw["curves"]["torchrec"]), np.array(raw["curves"]["sparselift"])
    diff = a - b
    return {
        "schema": "sparselift-parity/1",
        "scenario": scenario.name, "world_size": config.world_size,
        "epoch_steps": raw["steps"], "global_batch": scenario.batch_size * config.world_size,
        "quality": raw["quality"],
        "loss_curves": raw["curves"],
        "loss_mae": float(np.abs(diff).mean()), "loss_rmse": float(math.sqrt((diff ** 2).mean())),
        "identical": bool(np.array_equal(a, b)),
        "train_s": raw["train_s"],
        "teardown_error": teardown_error,
    }


def markdown(summary: dict[str, Any]) -> str:
    q = summary["quality"]
    lines = [f"### Quality parity: {summary['scenario']}, world size {summary['world_size']}, one epoch "
             f"({summary['epoch_steps']} steps of {summary['global_batch']} samples)", "",
             "| system | ROC-AUC | AP | LogLoss | loss MAE (x1e5) | loss RMSE (x1e5) |", "|---|---|---|---|---|---|"]
    for name in SYSTEMS:
        extra = ("- | -" if name == "torchrec" else
                 f"{summary['loss_mae'] * 1e5:.3f} | {summary['loss_rmse'] * 1e5:.3f}")
        lines.append(f"| {name} | {q[name]['roc_auc']:.4f} | {q[name]['ap']:.4f} | {q[name]['logloss']:.5f} | {extra} |")
    lines.append("")
    lines.append("Per-step training losses identical: " + ("yes" if summary["identical"] else "no"))
    return "\n".join(lines) + "\n"
