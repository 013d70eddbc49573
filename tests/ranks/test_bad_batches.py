"""Bad training batches after the warmup, on one rank or all: every rank stops with the same
clear error before any collective can mismatch or any update is applied, or every rank handles
the step alike (empty batches everywhere; ``non_finite='skip'``)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as L
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from helpers import LIFTED, local_state, tiny_data, tiny_model, trainer
from lightning_sparselift import CriteoDataModule, RecBatch, SparseLiftStrategy
from lightning_sparselift.lightning.step_check import NonFiniteError
from lightning_sparselift.validation import SparseInputError

AT = 5  # after the 3 captured steps: the lifted executor runs (and has announced this batch a step ahead)


class Corrupted:
    """A training loader whose batch ``at`` (None: every batch) is changed by ``corrupt`` on
    ``ranks``, before anything (the lookahead included) sees it."""

    def __init__(self, loader: Any, rank: int, ranks: tuple[int, ...], at: Optional[int], corrupt: Callable) -> None:
        self.loader, self.rank, self.ranks, self.at, self.corrupt = loader, rank, ranks, at, corrupt

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            yield self.corrupt(batch) if self.at in (i, None) and self.rank in self.ranks else batch


class CorruptedData(CriteoDataModule):
    def __init__(self, corrupt: Callable, ranks: tuple[int, ...] = (1,), at: Optional[int] = AT,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.corrupt, self.ranks, self.at = corrupt, ranks, at

    def train_dataloader(self) -> Any:
        return Corrupted(super().train_dataloader(), self.trainer.global_rank, self.ranks, self.at, self.corrupt)


def _data(tmp_cache: Path, corrupt: Callable, **kwargs: Any) -> CorruptedData:
    base = tiny_data(tmp_cache)
    args = {**base.hparams, **kwargs}
    return CorruptedData(corrupt, **args)


def _first_samples(batch: RecBatch, n: int) -> RecBatch:
    kjt = batch.sparse
    keys, b = kjt.keys(), kjt.stride()
    lengths = kjt.lengths().view(len(keys), b)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.sum(1).cumsum(0)])
    values = torch.cat([kjt.values()[offsets[k]:offsets[k] + int(lengths[k, :n].sum())] for k in range(len(keys))])
    sparse = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths[:, :n].reshape(-1), stride=n)
    return RecBatch(batch.dense[:n], sparse, batch.labels[:n], batch.weights[:n])


def _with_inf_dense(batch: RecBatch) -> RecBatch:
    dense = batch.dense.clone()
    dense[3, 7] = float("inf")
    return dataclasses.replace(batch, dense=dense)


def _with_int32_ids(batch: RecBatch) -> RecBatch:
    kjt = batch.sparse
    sparse = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().int(), lengths=kjt.lengths(), stride=kjt.stride())
    return dataclasses.replace(batch, sparse=sparse)


def _with_lengths_off_by_one(batch: RecBatch) -> RecBatch:
    kjt = batch.sparse
    lengths = kjt.lengths().clone()
    lengths[0] += 1
    return dataclasses.replace(batch, sparse=KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=lengths,
                                                               stride=kjt.stride()))


def _fit(dm: Any, **strategy_kwargs: Any) -> None:
    L.seed_everything(0)
    t = trainer(2, SparseLiftStrategy(start_method="fork", **strategy_kwargs), limit_val_batches=0)
    t.fit(tiny_model(dm), dm)


class UnchangedOnError(L.Callback):
    """Whether the model (tables, dense weights, optimizer state) is what it was before batch ``at``
    when the step on it fails (seen as the error leaves the strategy's optimizer step, in the
    rank's own process)."""

    def __init__(self, folder: Path, at: int = AT):
        self.folder, self.at = folder, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != self.at:
            return
        strategy, before = trainer.strategy, self._state(trainer)
        step = strategy.optimizer_step

        def checked_step(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            except Exception:
                after = self._state(trainer)
                unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in after)
                (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(unchanged))
                if trainer.global_rank != 0:
                    time.sleep(2)  # the launcher stops the other ranks once one exits: let rank 0 answer too
                raise

        strategy.optimizer_step = checked_step

    @staticmethod
    def _state(trainer):
        state = local_state(trainer.strategy.model)
        for key, value in trainer.strategy.optimizers[0].state_dict()["state"].items():
            for name, tensor in value.items():
                if hasattr(tensor, "local_shards"):
                    for i, shard in enumerate(tensor.local_shards()):
                        state[f"optim/{key}/{name}#{i}"] = shard.tensor.detach().clone()
                elif isinstance(tensor, torch.Tensor):
                    state[f"optim/{key}/{name}"] = tensor.detach().clone()
        return state


# the strategy's paths: TorchRec's; the lifted executor while it calibrates; every feasible pass
# installed after the capture (the consumer layout's gradient never passes the module's output values)
PATHS = {"torchrec": dict(executor="torchrec"), "sparselift": dict(executor="sparselift"),
         "every_pass": dict(executor="sparselift", calibrate=False)}


@pytest.mark.parametrize("path", list(PATHS))
def test_inf_in_dense_features_on_one_rank_stops_every_rank(path, tmp_path, data_cache):
    dm = _data(data_cache, _with_inf_dense)
    L.seed_everything(0)
    strategy = SparseLiftStrategy(start_method="fork", embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05},
                                  **PATHS[path])
    t = trainer(2, strategy, limit_val_batches=0, callbacks=[UnchangedOnError(tmp_path)])
    with pytest.raises(Exception, match=r"non-finite values in training batch 5 .*rank 1: 1 in batch\.dense "
                                        r"\(feature 7, first at sample 3\), the loss is not finite") as error:
        t.fit(tiny_model(dm), dm)
    assert NonFiniteError.__name__ in str(error.value) or isinstance(error.value, NonFiniteError)
    # no update of that step reached any rank: tables, dense weights and optimizer state as before it
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [True, True]


class FinalState(L.Callback):
    def __init__(self, folder: Path):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        finite = all(bool(torch.isfinite(v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).all())
                     for v in strategy.model.state_dict().values()
                     if not hasattr(v, "local_shards") or v.local_shards())
        report = {"skipped": strategy.skipped_steps, "finite": finite, "executor": strategy.executor_in_use}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def _fit_and_report(dm: Any, tmp_path: Path, **strategy_kwargs: Any) -> list[dict]:
    L.seed_everything(0)
    t = trainer(2, SparseLiftStrategy(start_method="fork", **strategy_kwargs), limit_val_batches=0,
                callbacks=[FinalState(tmp_path)])
    t.fit(tiny_model(dm), dm)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("path", list(PATHS))
def test_non_finite_skip_skips_the_step_on_every_rank(path, tmp_path, data_cache):
    reports = _fit_and_report(_data(data_cache, _with_inf_dense), tmp_path, non_finite="skip",
                              embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05}, **PATHS[path])
    assert all(r["skipped"] == 1 and r["finite"] for r in reports), reports
    assert reports[0]["executor"] in (("torchrec",) if path == "torchrec" else LIFTED)


@pytest.mark.parametrize("executor", ["sparselift", "torchrec"])
def test_empty_batches_on_every_rank_are_skipped(executor, tmp_path, data_cache):
    reports = _fit_and_report(_data(data_cache, lambda b: _first_samples(b, 0), ranks=(0, 1)), tmp_path,
                              executor=executor)
    assert all(r["skipped"] == 1 and r["finite"] for r in reports), reports


@pytest.mark.parametrize("corrupt, sharding, match", [
    (lambda b: _first_samples(b, 0), None, r"0 samples and others not \(rank 0: 32, rank 1: 0\)"),
    (lambda b: _first_samples(b, 20), "row_wise", r"different batch sizes \(rank 0: 32, rank 1: 20\).*row-wise "
                                                  r"sharded tables \['t_cat_2'\].*sharding_types=\{'t_cat_2': 'table_wise'\}"),
    (_with_int32_ids, None, r"ids have different dtypes on different ranks \(rank 0: torch.int64, rank 1: torch.int32"),
    (_with_lengths_off_by_one, None, r"rank 1: the KeyedJaggedTensor's lengths add up to \d+ but it holds \d+ ids"),
], ids=["empty_on_one_rank", "row_wise_short_batch", "int32_on_one_rank", "lengths_values_disagree"])
@pytest.mark.parametrize("executor", ["sparselift", "torchrec"])
def test_batches_that_differ_across_ranks_raise_on_every_rank(corrupt, sharding, match, executor, data_cache):
    dm = _data(data_cache, corrupt)
    sharding_types = {"t_cat_2": sharding} if sharding else None
    with pytest.raises(Exception, match=match) as error:
        _fit(dm, executor=executor, sharding_types=sharding_types)
    assert SparseInputError.__name__ in str(error.value) or isinstance(error.value, SparseInputError)


class OneBatchLess:
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader) - 1

    def __iter__(self):
        for _, batch in zip(range(len(self)), self.loader):
            yield batch


def test_different_numbers_of_training_batches_raise(data_cache):
    class Shorter(CriteoDataModule):
        def train_dataloader(self):
            loader = super().train_dataloader()
            return OneBatchLess(loader) if self.trainer.global_rank == 1 else loader

    dm = Shorter(**tiny_data(data_cache).hparams)
    with pytest.raises(Exception, match=r"different numbers of fit batches \(\[\[8.0\], \[7.0\]\]\)"):
        _fit(dm)


TABLE_WISE = {f"t_cat_{i}": "table_wise" for i in range(6)}


@pytest.mark.parametrize("executor", ["sparselift", "torchrec"])
def test_per_rank_batch_sizes_are_an_input_error_for_the_lifted_executor(executor, data_cache):
    dm = _data(data_cache, lambda b: _first_samples(b, 28), at=None)  # rank 1: 28 samples a batch, rank 0: 32
    if executor == "torchrec":  # (TorchRec's path takes them on table-wise tables)
        _fit(dm, executor=executor, sharding_types=TABLE_WISE)
        return
    with pytest.raises(Exception, match=r"training step 4: the ranks passed different batch sizes, and not in the "
                                        r"epoch's last batch.*executor='torchrec'") as error:
        _fit(dm, executor=executor, sharding_types=TABLE_WISE)  # (steps 1-3 are captured on TorchRec's path)
    assert SparseInputError.__name__ in str(error.value) or isinstance(error.value, SparseInputError)


def test_a_short_last_batch_trains_on_torchrecs_path(data_cache):
    _fit(_data(data_cache, lambda b: _first_samples(b, 28), at=7), sharding_types=TABLE_WISE)  # (8 batches a rank)
