"""Quality parity (the paper's Table 4): ``torchrec`` (the exact reference) and other systems
trained for one epoch from the same initial weights on the same data, then scored on the same
held-out split; and the quality bound a setting that changes numerics (``numerics="fast"``, a
quantized wire) must meet, fixed before measuring: over seeds, |mean delta AUC| <= 0.001 and mean
relative delta logloss <= 0.2% against the exact reference."""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_sparselift.bench.runner import BenchConfig, _data, _write_atomically, spawn_workers
from lightning_sparselift.bench.systems import SYSTEMS as BENCH_SYSTEMS
from lightning_sparselift.bench.systems.base import BenchEnv, System, build_sharded
from lightning_sparselift.bench.systems.sparselift import SparseLift
from lightning_sparselift.initial_tables import shard_regions

REFERENCE = "torchrec"
DEFAULT_SYSTEMS = (REFERENCE, "sparselift")
# the systems a parity run trains: TorchRec's path and SparseLift's, with their wire formats
SYSTEMS = (REFERENCE, "torchrec-qcomm", "torchrec-mx4", "sparselift", "sparselift-qcomm", "sparselift-fast",
           "sparselift-uncalibrated", "sparselift-fast-uncalibrated")
AUC_BOUND, LOGLOSS_BOUND = 0.001, 0.002  # |mean delta AUC|, mean relative delta logloss


def check_systems(systems: list[str]) -> None:
    """ValueError unless ``systems`` starts with the reference and holds only parity systems."""
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"system(s) {unknown} do not run in a parity run; it trains {list(SYSTEMS)}")
    if not systems or systems[0] != REFERENCE:
        raise ValueError(f"a parity run compares with {REFERENCE!r}, its first system; got {systems}")


def _module(system: System) -> torch.nn.Module:
    return system.model if isinstance(system, SparseLift) else system.dmp


def _whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s floating-point weights, sharded tables whole on every rank (every rank calls it)."""
    out = {}
    for key, value in module.state_dict().items():
        if isinstance(value, ShardedTensor):
            whole = torch.zeros(value.size(), dtype=value.dtype)
            for tensor, region in shard_regions(value):
                whole[region] = tensor
            dist.all_reduce(whole)  # (the shards are disjoint: the sum is every rank's shards in place)
            out[key] = whole
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            out[key] = value.detach().clone()
    return out


def _assign(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Each rank's part of ``weights`` (whole, by state-dict name) written in place into
    ``module``'s state (a sharded table's shards are views of its kernel's weights); the digest
    check after it shows the copy took."""
    with torch.no_grad():
        for key, value in module.state_dict().items():
            if key not in weights:
                continue
            whole = weights[key]
            if isinstance(value, ShardedTensor):
                for tensor, region in shard_regions(value):
                    tensor.copy_(whole[region])
            else:
                value.copy_(whole)


def _digest(module: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """Per weight of ``module``'s state dict (every rank calls it): the float64 sum and sum of
    squares of its values, whole tables whatever their sharding."""
    out = {}
    for key, value in module.state_dict().items():
        if isinstance(value, ShardedTensor):
            local = [s.tensor.double() for s in value.local_shards()]
            sums = torch.tensor([sum(float(t.sum()) for t in local), sum(float(t.square().sum()) for t in local)],
                                dtype=torch.float64)
            dist.all_reduce(sums)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            sums = torch.stack([value.double().sum(), value.double().square().sum()])
        else:
            continue
        out[key] = tuple(sums.tolist())
    return out


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
    _assign(model, _whole(trained))  # (sharded as the evaluation model is, whatever the trained one's plan)
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
    scenario = config.load_scenario()
    dm = _data(config, scenario)
    train = dm.split("train")
    steps = len(train) // (scenario.batch_size * config.world_size)
    env = BenchEnv(scenario, rank, config.world_size, train, seed=config.seed, pool=steps, precision=config.precision,
                   placed_as_exact=True)
    systems = {name: BENCH_SYSTEMS[name](env) for name in config.systems}
    for system in systems.values():
        system.setup()
    # the same tables in the same places (placed_as_exact: TorchRec's planner would move some under a
    # quantized wire, and a moved table trains with another optimizer) and the same initial weights:
    # the reference's, whole, copied into every other system's shards (tables built on meta are
    # initialized shard by shard), then checked
    weights = _whole(_module(systems[REFERENCE]))
    for name, system in systems.items():
        if name != REFERENCE:
            _assign(_module(system), weights)
    del weights
    initial = _digest(_module(systems[REFERENCE]))
    for name, system in systems.items():
        if (found := _digest(_module(system))) != initial:
            differ = sorted(k for k in initial.keys() | found.keys()
                            if not np.allclose(initial.get(k, np.nan), found.get(k, np.nan), rtol=1e-9, atol=0))
            if differ:
                raise RuntimeError(f"{name} does not start from {REFERENCE}'s weights: {differ[:5]}")
    curves, wall, quality = {}, {}, {}
    val = dm.split("val")
    for name, system in systems.items():
        start = time.perf_counter()
        for step in range(steps):
            system.step(step)
        wall[name] = time.perf_counter() - start
        local = torch.tensor(system.losses[:steps], dtype=torch.float64)
        dist.all_reduce(local)
        curves[name] = (local / config.world_size).tolist()
        quality[name] = _evaluate(env, _module(system), val)
    if rank == 0:
        _write_atomically(out, {"steps": steps, "curves": curves, "quality": quality, "train_s": wall})
    dist.barrier()
    dist.destroy_process_group()


def run(config: BenchConfig) -> dict[str, Any]:
    config.validate()
    check_systems(config.systems)
    scenario = config.load_scenario()
    _data(config, scenario)
    raw, teardown_error = spawn_workers(_worker, config, "parity.json")
    reference = np.array(raw["curves"][REFERENCE])
    q0 = raw["quality"][REFERENCE]
    against = {}
    for name in config.systems[1:]:
        diff = reference - np.array(raw["curves"][name])
        q = raw["quality"][name]
        against[name] = {"delta_auc": q["roc_auc"] - q0["roc_auc"],
                         "relative_delta_logloss": (q["logloss"] - q0["logloss"]) / q0["logloss"],
                         "loss_mae": float(np.abs(diff).mean()), "loss_rmse": float(math.sqrt((diff ** 2).mean())),
                         "identical": bool(np.array_equal(reference, raw["curves"][name]))}
    return {
        "schema": "sparselift-parity/2",
        "scenario": scenario.name, "optimizer": scenario.optimizer, "world_size": config.world_size, "seed": config.seed,
        "epoch_steps": raw["steps"], "global_batch": scenario.batch_size * config.world_size,
        "compared": list(config.systems), "quality": raw["quality"], "against_reference": against,
        "loss_curves": raw["curves"],
        "train_s": raw["train_s"],
        "teardown_error": teardown_error,
    }


def bound(summaries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system, over the runs ``summaries`` (seeds): the mean delta AUC and mean relative delta
    logloss against the reference, and whether they meet the bound."""
    out = {}
    for name in summaries[0]["against_reference"]:
        runs = [s["against_reference"][name] for s in summaries]
        auc = float(np.mean([r["delta_auc"] for r in runs]))
        logloss = float(np.mean([r["relative_delta_logloss"] for r in runs]))
        out[name] = {"runs": len(runs), "mean_delta_auc": auc, "mean_relative_delta_logloss": logloss,
                     "within": abs(auc) <= AUC_BOUND and logloss <= LOGLOSS_BOUND}
    return out


def bound_table(summaries: list[dict[str, Any]]) -> str:
    """Markdown: per scenario and system, each seed's deltas against the reference, their means and
    whether they meet the bound."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for summary in summaries:
        runs.setdefault(summary["scenario"], []).append(summary)
    lines = [f"Bound: |mean delta AUC| <= {AUC_BOUND}, mean relative delta logloss <= {LOGLOSS_BOUND:.1%} "
             f"(against {REFERENCE}, over seeds)", "",
             "| scenario | system | seeds | delta AUC per seed | rel. delta logloss per seed | loss MAE x1e5 per seed | "
             "mean delta AUC | mean rel. delta logloss | within the bound |", "|---|---|---|---|---|---|---|---|---|"]
    for scenario, group in runs.items():
        group.sort(key=lambda s: s["seed"])
        for name, verdict in bound(group).items():
            per = [s["against_reference"][name] for s in group]
            auc = ", ".join(f"{p['delta_auc']:+.5f}" for p in per)
            logloss = ", ".join(f"{p['relative_delta_logloss']:+.3%}" for p in per)
            mae = ", ".join(f"{p['loss_mae'] * 1e5:.1f}" for p in per)
            seeds = ",".join(str(s["seed"]) for s in group)
            lines.append(f"| {scenario} | {name} | {seeds} | {auc} | {logloss} | {mae} | "
                         f"{verdict['mean_delta_auc']:+.5f} | {verdict['mean_relative_delta_logloss']:+.3%} | "
                         f"{'yes' if verdict['within'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def markdown(summary: dict[str, Any]) -> str:
    q = summary["quality"]
    lines = [f"### Quality parity: {summary['scenario']}, world size {summary['world_size']}, seed {summary['seed']}, "
             f"one epoch ({summary['epoch_steps']} steps of {summary['global_batch']} samples)", "",
             "| system | ROC-AUC | AP | LogLoss | delta AUC | rel. delta logloss | loss MAE (x1e5) | loss RMSE (x1e5) | "
             "losses identical |", "|---|---|---|---|---|---|---|---|---|"]
    for name in summary["compared"]:
        a = summary["against_reference"].get(name)
        extra = ("- | - | - | - | reference" if a is None else
                 f"{a['delta_auc']:+.5f} | {a['relative_delta_logloss']:+.4%} | {a['loss_mae'] * 1e5:.3f} | "
                 f"{a['loss_rmse'] * 1e5:.3f} | {'yes' if a['identical'] else 'no'}")
        lines.append(f"| {name} | {q[name]['roc_auc']:.4f} | {q[name]['ap']:.4f} | {q[name]['logloss']:.5f} | {extra} |")
    return "\n".join(lines) + "\n"
