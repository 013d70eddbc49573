"""Small models, data and trainers for the multi-process CPU tests (fork launcher, gloo)."""

from __future__ import annotations

import json
import socket
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import torch

from lightning_sparselift import CriteoDataModule, DLRMModule, SparseLiftStrategy

TINY_TABLES = [40, 40, 300, 300, 1000, 7]
# a calibration budget of 5 measured pairs: one look at 95% (the fewest pairs its signed-rank bounds
# exist for; the default 99% needs 7), so every candidate is decided within 12 steps; and a round's
# budget set, so these short runs calibrate every design (by default a round takes a third of the steps left)
ONE_LOOK = {"calibration_confidence": 0.95, "calibration_max_pairs": 5, "calibration_max_steps": 240}
# what executor_in_use says once the lifted executor runs: a plan, or a planning round's trial plans
# (a short run can end while calibrating)
LIFTED = ("sparselift", "calibrating")
# examples/own_model.py's default length: room for a cold cache's kernel builds (calibration waits
# for them, up to kernel_builds.PATIENCE_S), the round's budget and the steady-state check
FULL = 3700


def assert_calibration_finished(decisions: list[dict[str, Any]]) -> None:
    """The planning round ended inside the run: every feasible candidate decided, or left by the
    round's calibration budget (a noisy host's), none by training's end."""
    left = [f"{d['candidate']}: {d['reason']}" for d in decisions
            if d["feasible"] and not d["decided"] and "the round's calibration budget" not in d["reason"]]
    assert not left, "calibration did not finish:\n" + "\n".join(left)


# what a worker prints when it aborts at interpreter exit (seen intermittently after training
# finished: a known exit-time abort of gloo workers, not diagnosed yet)
EXIT_ABORT = "terminate called without an active exception"


def free_port() -> int:
    """A TCP port free on this host now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_data(tmp_cache: Path, **kwargs: Any) -> CriteoDataModule:
    args = dict(batch_size=32, num_train=512, num_val=300, num_test=300, rows_per_feature=TINY_TABLES,
                cache_dir=str(tmp_cache), seed=3)
    args.update(kwargs)
    return CriteoDataModule(**args)


def tiny_model(dm: CriteoDataModule, **kwargs: Any) -> DLRMModule:
    args = dict(embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1],
                feature_names=dm.feature_names, dense_optimizer="adam", dense_lr=0.01)
    args.update(kwargs)
    return DLRMModule(dm.table_sizes, **args)


def trainer(devices: int, strategy: Optional[SparseLiftStrategy] = None, **kwargs: Any) -> L.Trainer:
    args = dict(accelerator="cpu", devices=devices, max_epochs=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    args.update(kwargs)
    return L.Trainer(strategy=strategy or SparseLiftStrategy(start_method="fork"), **args)


def local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's view of the model: local shards of sharded tables, plain tensors as they are."""
    out = {}
    for key, value in module.state_dict().items():
        if hasattr(value, "local_shards"):
            for i, shard in enumerate(value.local_shards()):
                out[f"{key}#shard{i}"] = shard.tensor.detach().clone()
        else:
            out[key] = value.detach().clone()
    return out


class DumpLocalState(L.Callback):
    """Saves each rank's local model (and fused optimizer) state at the start or end of fit."""

    def __init__(self, folder: Path, at: str = "end"):
        self.folder = Path(folder)
        self.at = at

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at == "start":
            self.dump(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at == "end":
            self.dump(trainer)

    def dump(self, trainer: L.Trainer) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        state = local_state(trainer.strategy.model)
        for key, value in trainer.strategy.fused_optimizer.state_dict()["state"].items():
            for name, tensor in value.items():
                if hasattr(tensor, "local_shards"):
                    for i, shard in enumerate(tensor.local_shards()):
                        state[f"optim/{key}/{name}#shard{i}"] = shard.tensor.detach().clone()
        torch.save(state, self.folder / f"rank{trainer.global_rank}.pt")


def load_dumps(folder: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def assert_same_dumps(reference: Path, other: Path, world_size: int = 2) -> list[dict[str, torch.Tensor]]:
    """Every rank's dumped state in ``other`` is bit-identical to ``reference``'s (the same keys);
    returns the reference's."""
    wanted = load_dumps(reference, world_size)
    for rank, (want, got) in enumerate(zip(wanted, load_dumps(other, world_size))):
        assert want.keys() == got.keys(), f"rank {rank}: other state keys"
        assert [k for k in want if not torch.equal(want[k], got[k])] == [], f"rank {rank} differs from the reference"
    return wanted


class ExecutorReport(L.Callback):
    """Each rank's counters of the installed executor and the plan's decisions, at the end of fit."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        executor, plan = strategy.lifted_executor, strategy.execution_plan
        report = {"executor": strategy.executor_in_use, "fallback": strategy.executor_fallback_reason,
                  "early_steps": sum(f.early_steps for f in executor.executors.values()) if executor else 0,
                  "prefetched_steps": sum(f.prefetched_steps for f in executor.executors.values()) if executor else 0,
                  "buffers_reused": sum(f.buffers.reused for f in executor.executors.values()) if executor else 0,
                  "decisions": [[d.candidate, d.accepted, d.decided or not d.feasible]
                                for d in plan.decisions]
                  if plan else None,
                  "measured": [d.candidate for d in plan.decisions if d.measured_ms is not None] if plan else None,
                  # (as assert_calibration_finished reads them: the feasible candidates left undecided, why)
                  "left": [{"candidate": d.candidate, "reason": d.reason, "feasible": d.feasible, "decided": d.decided}
                           for d in plan.decisions if d.feasible and not d.decided] if plan else None}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"report{trainer.global_rank}.json").write_text(json.dumps(report))


class GraphReport(L.Callback):
    """Rank 0's lifted graph at the end of fit: its modules, those left on TorchRec's path, explain()."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        executor = trainer.strategy.lifted_executor
        graph = executor.graph if executor is not None else None
        plan = {path: {t: p.sharding_type for t, p in tables.items()}
                for path, tables in trainer.strategy.sharding_plan.plan.items()}
        report = {"plan": plan, **({"modules": [m.path for m in graph.modules], "not_lifted": graph.not_lifted,
                                    "explain": graph.explain()} if graph else {})}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"graph{trainer.global_rank}.json").write_text(json.dumps(report))


class RecordWarnings(L.Callback):
    """Saves the warnings each rank raised during training and which executor it ended on, to
    ``folder/rank<r>.pt`` (the rank processes' callbacks are copies: the fork launcher)."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_start(self, trainer, pl_module):
        self._recording = warnings.catch_warnings(record=True)
        self._caught = self._recording.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, pl_module):
        self._recording.__exit__(None, None, None)
        torch.save({"executor": trainer.strategy.executor_in_use,
                    "warnings": [str(w.message) for w in self._caught]},
                   self.folder / f"rank{trainer.global_rank}.pt")
