"""``embedding_optimizer="adam"`` on CPU, which fbgemm's CPU module (and so TorchRec) refuses: the
tables keep Adam's state in fbgemm's module (HostAdamTableBatch) and the generated kernel runs
the lookups and the fused lazy-Adam update, on TorchRec's path and the lifted executor alike."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as L
import torch

from helpers import DumpLocalState, ExecutorReport, LIFTED, assert_same_dumps, load_dumps, tiny_data, trainer
from lightning_sparselift import SparseLiftStrategy
from user_models import PositionalKJT

ADAM = {"name": "adam", "lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6}


class SaveBatches(L.Callback):
    """Each rank's training batches, as the model received them."""

    def __init__(self, folder: Path):
        self.folder, self.batches = Path(folder), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kjt = batch.sparse
        self.batches.append({"dense": batch.dense.clone(), "labels": batch.labels.clone(), "keys": kjt.keys(),
                             "values": kjt.values().clone(), "lengths": kjt.lengths().clone()})

    def on_train_end(self, trainer, pl_module):
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.batches, self.folder / f"batches{trainer.global_rank}.pt")


def _fit(dm, folder: Path, devices: int, **strategy_kwargs) -> None:
    L.seed_everything(0)
    strategy = SparseLiftStrategy(start_method="fork", embedding_optimizer=ADAM, **strategy_kwargs)
    t = trainer(devices, strategy, limit_val_batches=0,
                callbacks=[DumpLocalState(folder / "start", at="start"), DumpLocalState(folder / "end"),
                           SaveBatches(folder), ExecutorReport(folder)])
    t.fit(PositionalKJT(dm.table_sizes, dm.feature_names), dm)


def test_adam_on_cpu_tables_is_lazy_adam_on_the_rows_each_step_touches(tmp_path, data_cache):
    """One rank, the default options otherwise: every fused table and its two moments after the
    run against the same model trained in plain torch with torch.optim.Adam applied to the rows
    each batch touches, from the same initial weights and batches (the data-parallel table is a
    dense parameter: the model's own Adam updates it, every row)."""
    from torchrec import EmbeddingBagCollection, KeyedJaggedTensor

    dm = tiny_data(data_cache, num_train=640)
    *fused, replicated = [f"table_{f}" for f in dm.feature_names]
    _fit(dm, tmp_path, 1, sharding_types={**{t: "table_wise" for t in fused}, replicated: "data_parallel"})
    start, end = load_dumps(tmp_path / "start", 1)[0], load_dumps(tmp_path / "end", 1)[0]
    batches = torch.load(tmp_path / "batches0.pt", weights_only=False)

    reference = PositionalKJT(dm.table_sizes, dm.feature_names)
    reference.embeddings = EmbeddingBagCollection(tables=reference.embeddings.embedding_bag_configs(),
                                                  device=torch.device("cpu"))
    tables = {name: table.weight for name, table in reference.embeddings.embedding_bags.items() if name in fused}

    def saved(key: str) -> torch.Tensor:
        (found,) = [k for k in start if k.split("#")[0].endswith(key)]
        return start[found]

    with torch.no_grad():
        for name, weight in reference.named_parameters():
            weight.copy_(saved(name))
    dense = [p for p in reference.parameters() if all(p is not w for w in tables.values())]
    dense_adam = torch.optim.Adam(dense, lr=0.01)  # the model's configure_optimizers, less the fused tables
    moments = {name: (torch.zeros_like(w), torch.zeros_like(w)) for name, w in tables.items()}
    feature_table = {f: f"table_{f}" for f in dm.feature_names}
    for step, b in enumerate(batches, start=1):
        kjt = KeyedJaggedTensor(keys=b["keys"], values=b["values"], lengths=b["lengths"])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(reference(b["dense"], kjt), b["labels"])
        dense_adam.zero_grad()
        for w in tables.values():
            w.grad = None
        loss.backward()
        dense_adam.step()
        for feature, ids in kjt.to_dict().items():
            name = feature_table[feature]
            if name not in tables:
                continue
            weight, (m1, m2) = tables[name], moments[name]
            touched = torch.unique(ids.values())
            row = torch.nn.Parameter(weight.detach()[touched].clone())
            row.grad = weight.grad[touched]
            adam = torch.optim.Adam([row], lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"], foreach=False)
            adam.state[row] = {"step": torch.tensor(float(step - 1)), "exp_avg": m1[touched].clone(),
                               "exp_avg_sq": m2[touched].clone()}
            adam.step()
            with torch.no_grad():
                weight[touched] = row.detach()
            m1[touched], m2[touched] = adam.state[row]["exp_avg"], adam.state[row]["exp_avg_sq"]
    assert len(batches) == 640 // 32
    (key,) = [k for k in end if f".{replicated}." in k]
    torch.testing.assert_close(end[key], reference.embeddings.embedding_bags[replicated].weight.detach(), rtol=1e-4,
                               atol=1e-5)
    for name, weight in tables.items():
        (key,) = [k for k in end if k.startswith("embeddings.") and f".{name}." in k and not k.startswith("optim/")]
        torch.testing.assert_close(end[key], weight.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        m1, m2 = moments[name]
        (exp_avg,) = [k for k in end if k.startswith("optim/") and f"{name}.momentum1" in k]
        (exp_avg_sq,) = [k for k in end if k.startswith("optim/") and f"{name}.exp_avg_sq" in k]
        torch.testing.assert_close(end[exp_avg].view_as(m1), m1, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name} exp_avg: {m}")
        torch.testing.assert_close(end[exp_avg_sq].view_as(m2), m2, rtol=1e-4, atol=1e-8, msg=lambda m, name=name: f"{name} exp_avg_sq: {m}")
        assert not torch.equal(end[key], start[key]), f"{name} did not train"


def test_adam_on_cpu_tables_is_bit_identical_on_torchrecs_path_and_the_lifted_executor(tmp_path, data_cache):
    """Two ranks, table-, row-, column- and table-row-wise tables, every pass forced on: the
    lifted executor's generated lookups and TorchRec's sharded modules (whose fbgemm module runs
    the same kernel) end with the same tables and Adam state, bit for bit."""
    dm = tiny_data(data_cache, num_train=640)
    types = {f"table_{f}": kind for f, kind in zip(dm.feature_names, ["table_wise", "row_wise", "column_wise",
                                                                      "table_row_wise"])}
    _fit(dm, tmp_path / "torchrec", 2, sharding_types=types, executor="torchrec")
    _fit(dm, tmp_path / "lifted", 2, sharding_types=types, calibrate=False)
    for rank in range(2):
        report = json.loads((tmp_path / "lifted" / f"report{rank}.json").read_text())
        assert report["executor"] in LIFTED, report["fallback"]
        assert ["codegen:lookup@embeddings", True, False] in report["decisions"]  # accepted, not measured
    states = assert_same_dumps(tmp_path / "torchrec" / "end", tmp_path / "lifted" / "end")
    second_moments = [k for state in states for k in state if k.startswith("optim/") and ".exp_avg_sq" in k]
    assert len({k.split("/")[1] for k in second_moments}) == len(dm.feature_names)
