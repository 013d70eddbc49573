"""Multi-process CPU/gloo training through SparseLiftStrategy (fork launcher)."""

import lightning.pytorch as L
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from helpers import DumpLocalState, RecordWarnings, load_dumps, tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy

TABLES = ["t_cat_0", "t_cat_1", "t_cat_2", "t_cat_3", "t_cat_4", "t_cat_5"]


class RecordLoss(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _first_and_last(losses, n=6):
    return sum(losses[:n]) / n, sum(losses[-n:]) / n


@pytest.mark.parametrize("world_size, dense_optimizer, dense_lr", [(1, "sgd", 0.5), (2, "adam", 0.01),
                                                                    pytest.param(3, "adagrad", 0.05,
                                                                                 marks=pytest.mark.slow)])
def test_training_decreases_loss(world_size, dense_optimizer, dense_lr, tmp_path, data_cache):
    dm = tiny_data(data_cache, num_train=2400, batch_size=16)
    L.seed_everything(0)
    dump = tmp_path / "dump"

    class Losses(RecordLoss):
        def on_train_end(self, trainer, pl_module):
            torch.save(self.losses, dump.parent / f"losses{trainer.global_rank}.pt")

    t = trainer(world_size, SparseLiftStrategy(start_method="fork", embedding_optimizer={"name": "sgd", "lr": 0.5}),
                max_epochs=3, callbacks=[Losses()], limit_val_batches=0)
    t.fit(tiny_model(dm, dense_optimizer=dense_optimizer, dense_lr=dense_lr), dm)
    losses = torch.load(tmp_path / "losses0.pt")
    first, last = _first_and_last(losses)
    assert last < first - 0.02, f"loss did not decrease: {first:.4f} -> {last:.4f}"


# (each sharding type with the fused optimizers through Trainer.fit: the parity harness checks SGD and
# rowwise Adagrad bit for bit on every type, tests/ranks/test_lifting.py; this adds Adagrad)
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["table_wise", "column_wise", "table_column_wise", "row_wise", "data_parallel", "mixed"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_every_sharding_type_trains(kind, optimizer, tmp_path, data_cache):
    if kind == "mixed":
        sharding = dict(zip(TABLES, ["table_wise", "column_wise", "row_wise", "data_parallel", "row_wise",
                                     "table_wise"]))
    else:
        sharding = {t: kind for t in TABLES}
    dm = tiny_data(data_cache)
    strategy = SparseLiftStrategy(start_method="fork", sharding_types=sharding,
                                  embedding_optimizer={"name": optimizer, "lr": 0.05})
    dump = tmp_path / "dump"

    class Plan(L.Callback):
        def on_train_end(self, trainer, pl_module):
            plan = trainer.strategy.sharding_plan.plan["model.sparse_arch.embedding_bag_collection"]
            torch.save({t: ps.sharding_type for t, ps in plan.items()}, tmp_path / "plan.pt")

    t = trainer(2, strategy, callbacks=[DumpLocalState(tmp_path / "init", at="start"), DumpLocalState(dump), Plan()],
                limit_val_batches=0, max_steps=4)
    t.fit(tiny_model(dm), dm)
    assert torch.load(tmp_path / "plan.pt") == sharding
    # Every table changed from its initial value on the rank(s) that hold it.
    after, before = load_dumps(dump, 2), load_dumps(tmp_path / "init", 2)
    for table in TABLES:
        keys = [(r, k) for r in range(2) for k in after[r] if f"embedding_bags.{table}.weight" in k]
        assert keys, f"{table} missing"
        assert any(not torch.equal(after[r][k], before[r][k]) for r, k in keys), f"{table} was not updated"
    # data-parallel replicas stay identical across ranks
    for table in [t for t, k in sharding.items() if k == "data_parallel"]:
        key = f"model.sparse_arch.embedding_bag_collection.embedding_bags.{table}.weight"
        assert torch.equal(after[0][key], after[1][key])


def test_metrics_match_auc_of_gathered_predictions(tmp_path, data_cache):
    # 300 validation samples in batches of 32 on 2 ranks: 10 batches, the last one short, and
    # the ranks' counts evened out with zero-weight padding.
    dm = tiny_data(data_cache, num_val=300)
    L.seed_everything(0)
    model = tiny_model(dm)
    t = trainer(2)
    metrics = t.validate(model, dm, verbose=False)[0]

    L.seed_everything(0)
    model = tiny_model(dm)

    class Gather(L.Callback):
        def __init__(self):
            self.p, self.y = [], []

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            keep = batch.weights > 0
            with torch.no_grad():
                self.p.append(torch.sigmoid(pl_module(batch))[keep])
            self.y.append(batch.labels[keep])

        def on_validation_end(self, trainer, pl_module):
            p, y = torch.cat(self.p), torch.cat(self.y)
            sizes = [torch.zeros(1, dtype=torch.long) for _ in range(trainer.world_size)]
            torch.distributed.all_gather(sizes, torch.tensor([p.numel()]))
            biggest = int(max(sizes))
            gp = [torch.zeros(biggest) for _ in sizes]
            gy = [torch.zeros(biggest) for _ in sizes]
            torch.distributed.all_gather(gp, torch.nn.functional.pad(p, (0, biggest - p.numel())))
            torch.distributed.all_gather(gy, torch.nn.functional.pad(y, (0, biggest - y.numel())))
            p = torch.cat([g[: int(s)] for g, s in zip(gp, sizes)])
            y = torch.cat([g[: int(s)] for g, s in zip(gy, sizes)])
            torch.save({"p": p, "y": y}, tmp_path / "gathered.pt")

    t = trainer(2, callbacks=[Gather()])
    again = t.validate(model, dm, verbose=False)[0]
    gathered = torch.load(tmp_path / "gathered.pt")
    assert gathered["p"].numel() == 300, "every validation sample must be counted exactly once"
    auc = float(binary_auroc(gathered["p"], gathered["y"].long()))
    logloss = float(torch.nn.functional.binary_cross_entropy(gathered["p"].double(), gathered["y"].double()))
    assert again["val/auc"] == pytest.approx(auc, abs=1e-6)
    assert again["val/logloss"] == pytest.approx(logloss, abs=1e-6)
    assert metrics["val/auc"] == pytest.approx(again["val/auc"], abs=1e-6)


def test_uneven_last_batch_does_not_hang(tmp_path, data_cache):
    # 330 training samples in batches of 32: 10 full batches + 1 short one, 3 ranks.
    dm = tiny_data(data_cache, num_train=330, num_val=97, num_test=65)
    L.seed_everything(0)
    t = trainer(3, max_epochs=1)
    t.fit(tiny_model(dm), dm)
    assert "val/auc" in t.callback_metrics
    t = trainer(3)
    out = t.test(tiny_model(dm), dm, verbose=False)
    assert "test/logloss" in out[0]
    preds = trainer(3).predict(tiny_model(dm), dm)
    assert preds is None or isinstance(preds, list)


def test_accumulate_grad_batches_is_refused(data_cache):
    dm = tiny_data(data_cache)
    t = trainer(1, accumulate_grad_batches=2)
    with pytest.raises(Exception, match="cannot accumulate gradients"):
        t.fit(tiny_model(dm), dm)


def test_an_accumulation_set_later_is_refused_where_it_takes_effect(tmp_path, data_cache):
    """Lightning's scheduler is refused at setup; a factor any callback sets when an epoch starts,
    before that epoch's first step (the fused tables would update every micro-batch)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    dm = tiny_data(data_cache)
    with pytest.raises(Exception, match=r"cannot accumulate gradients \(GradientAccumulationScheduler\(\{0: 1, 1: 2\}\)\)"):
        trainer(1, callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})], max_epochs=2).fit(tiny_model(dm), dm)

    class AccumulateFromEpoch1(L.Callback):  # (the rank process writes what it saw: fork launcher)
        def on_train_epoch_start(self, trainer, pl_module):
            trainer.accumulate_grad_batches = 1 if trainer.current_epoch == 0 else 2

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            (tmp_path / f"step{trainer.global_step}-accumulating{trainer.accumulate_grad_batches}").touch()

    t = trainer(1, callbacks=[AccumulateFromEpoch1()], max_epochs=2, limit_train_batches=3)
    with pytest.raises(Exception, match=r"cannot accumulate gradients \(accumulate_grad_batches=2\)"):
        t.fit(tiny_model(dm), dm)
    # epoch 0's three steps ran, none of epoch 1's
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step{i}-accumulating1" for i in (1, 2, 3)]


def test_manual_optimization_is_refused(data_cache):
    dm = tiny_data(data_cache)
    model = tiny_model(dm)
    model.automatic_optimization = False
    with pytest.raises(Exception, match=r"does not support manual optimization \(automatic_optimization=False\)"):
        trainer(1).fit(model, dm)


def test_embedding_lr_follows_dense_schedule(tmp_path, data_cache):
    dm = tiny_data(data_cache)

    class LRs(L.Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = trainer.strategy.optimizers[0]
            emb, dense = dict(opt.optimizers)["embedding"], dict(opt.optimizers)["dense"]
            self.rows.append((emb.param_groups[0]["lr"], dense.param_groups[0]["lr"]))

        def on_train_end(self, trainer, pl_module):
            torch.save(self.rows, tmp_path / f"lrs{trainer.global_rank}.pt")

    for schedule in ("constant", "follow_dense"):
        L.seed_everything(0)
        t = trainer(2, SparseLiftStrategy(start_method="fork", embedding_lr_schedule=schedule,
                                          embedding_optimizer={"name": "sgd", "lr": 0.2}),
                    callbacks=[LRs()], limit_val_batches=0, max_steps=6)
        t.fit(tiny_model(dm, lr_scheduler="cosine", dense_lr=0.01), dm)
        rows = torch.load(tmp_path / "lrs1.pt")
        dense = [d for _, d in rows]
        assert dense[-1] < dense[0]
        if schedule == "constant":
            assert all(e == pytest.approx(0.2, rel=1e-6) for e, _ in rows), rows
        else:
            # at batch end the dense scheduler has already stepped; the embedding LR of step i
            # follows the dense LR that step i used
            assert rows[0][0] == pytest.approx(0.2, rel=1e-6)
            for (e, _), (_, d_prev) in zip(rows[1:], rows[:-1]):
                assert e == pytest.approx(0.2 * d_prev / 0.01, rel=1e-6), rows
            assert rows[-1][0] < 0.1


def test_uneven_user_dataloaders_raise_instead_of_hanging(data_cache):
    from torch.utils.data import DataLoader

    from lightning_sparselift.data.loading import BatchedRecDataset

    class Uneven(type(tiny_data(data_cache))):
        def val_dataloader(self):
            # rank 0 gets 3 batches, rank 1 gets 2: a plain per-rank split without padding
            dataset = BatchedRecDataset(self.split("val"), 32)
            keep = list(range(3 - self.trainer.global_rank))
            return DataLoader(torch.utils.data.Subset(dataset, keep), batch_size=None, collate_fn=lambda b: b)

    dm = tiny_data(data_cache)
    dm.__class__ = Uneven
    t = trainer(2, use_distributed_sampler=False, limit_train_batches=2)
    with pytest.raises(Exception, match="different numbers of validate batches"):
        t.fit(tiny_model(dm), dm)


def test_barebones_makes_the_strategy_log_nothing(tmp_path, data_cache):
    """Under Trainer(barebones=True) Lightning warns at every self.log; a model that never logs gets no
    such warning from the strategy's own metrics (calibration progress, the round's decisions)."""
    from lightning_sparselift.models import DLRMModule

    class Quiet(DLRMModule):
        def training_step(self, batch, batch_idx):
            return self._loss(self(batch), batch)

    dm = tiny_data(data_cache, num_train=384)
    model = tiny_model(dm)
    model.__class__ = Quiet
    strategy = SparseLiftStrategy(start_method="fork", optimizations=["aggregation"], calibrate=False)
    trainer(1, strategy, callbacks=[RecordWarnings(tmp_path)], barebones=True, enable_progress_bar=None,
            enable_model_summary=None, limit_val_batches=0).fit(model, dm)
    caught = torch.load(tmp_path / "rank0.pt")["warnings"]
    assert not [w for w in caught if "self.log()" in w], caught
