"""Four models written the way TorchRec's zoo and examples write them (not our DLRMModule): a DeepFM
(TorchRec's ``SimpleDeepFMNN``), a two-tower model with two EmbeddingBagCollections, a DCN
(TorchRec's ``DLRM_DCN``) over a weighted multi-hot EmbeddingBagCollection and an
EmbeddingCollection sequence model. Each trains ``--steps`` steps on 2 CPU processes with the
strategy's default options, ``executor="sparselift"`` against ``executor="torchrec"`` in
alternating fits (S T T S ...: drift cancels), and reports per model whether calibration
finished, the plan, and the ratio of the fits' training wall times (torchrec / sparselift: > 1
means SparseLift's run was faster over the whole run, calibration included). ``--identity`` adds
fits of the lifted identity plan (``optimizations=[]``: no priors, calibration or check), in the
same alternation: what lifting alone costs against TorchRec's path.

    python benchmarks/held_out_models.py [--steps 300] [--repeats 2] [--models deepfm,two_tower,dcn,sequence] [--identity]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn

from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.data import CriteoDataModule

DIM = 16


def _bags(names: list[str], rows: list[int], weighted: bool = False) -> Any:
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=n, feature_names=[f])
                for f, n in zip(names, rows)], is_weighted=weighted, device=torch.device("meta"))


class _Binary(L.LightningModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(self.logits(batch), batch.labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(self.parameters(), lr=0.01)


class DeepFM(_Binary):
    def __init__(self, names: list[str], rows: list[int]) -> None:
        super().__init__()
        from torchrec.models.deepfm import SimpleDeepFMNN

        self.model = SimpleDeepFMNN(13, _bags(names, rows), hidden_layer_size=64, deep_fm_dimension=16)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        return self.model(dense, kjt)

    def logits(self, batch: Any) -> torch.Tensor:
        return self(batch.dense, batch.sparse).squeeze(1)


class TwoTower(_Binary):
    """Users and items in EmbeddingBagCollections of their own, one tower each, their dot product."""

    def __init__(self, names: list[str], rows: list[int]) -> None:
        super().__init__()
        half = len(names) // 2
        self.user_names, self.item_names = names[:half], names[half:]
        self.users, self.items = _bags(self.user_names, rows[:half]), _bags(self.item_names, rows[half:])
        self.user_tower = nn.Sequential(nn.Linear(DIM * half + 13, 64), nn.ReLU(), nn.Linear(64, 32))
        self.item_tower = nn.Sequential(nn.Linear(DIM * (len(names) - half), 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, dense: torch.Tensor, user_kjt: Any, item_kjt: Any) -> torch.Tensor:
        users, items = self.users(user_kjt), self.items(item_kjt)
        user = self.user_tower(torch.cat([dense] + [users[f] for f in self.user_names], dim=1))
        item = self.item_tower(torch.cat([items[f] for f in self.item_names], dim=1))
        return (user * item).sum(dim=1)

    def logits(self, batch: Any) -> torch.Tensor:
        user_kjt, item_kjt = batch.sparse.split([len(self.user_names), len(self.item_names)])
        return self(batch.dense, user_kjt, item_kjt)


class WeightedDCN(_Binary):
    """TorchRec's DLRM_DCN over a weighted EmbeddingBagCollection (per-id weights the model derives
    from the ids, as a feature processor would)."""

    def __init__(self, names: list[str], rows: list[int]) -> None:
        super().__init__()
        from torchrec.models.dlrm import DLRM_DCN

        self.model = DLRM_DCN(_bags(names, rows, weighted=True), dense_in_features=13,
                              dense_arch_layer_sizes=[64, DIM], over_arch_layer_sizes=[64, 1], dcn_num_layers=2,
                              dcn_low_rank_dim=16)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        return self.model(dense, kjt)

    def logits(self, batch: Any) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = batch.sparse
        weights = (kjt.values() % 7 + 1).to(torch.float32) / 7
        weighted = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights, lengths=kjt.lengths())
        return self(batch.dense, weighted).squeeze(1)


class Sequence(_Binary):
    """The first four features as sequences through an EmbeddingCollection (rows averaged per
    sample), the others pooled by an EmbeddingBagCollection."""

    def __init__(self, names: list[str], rows: list[int]) -> None:
        super().__init__()
        from torchrec import EmbeddingCollection
        from torchrec.modules.embedding_configs import EmbeddingConfig

        self.sequence_names, self.pooled_names = names[:4], names[4:]
        self.sequences = EmbeddingCollection(
            tables=[EmbeddingConfig(name=f"s_{f}", embedding_dim=DIM, num_embeddings=n, feature_names=[f])
                    for f, n in zip(self.sequence_names, rows[:4])], device=torch.device("meta"))
        self.pooled = _bags(self.pooled_names, rows[4:])
        self.top = nn.Sequential(nn.Linear(DIM * len(names) + 13, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        sequence_kjt, pooled_kjt = kjt.split([len(self.sequence_names), len(self.pooled_names)])
        rows, pooled = self.sequences(sequence_kjt), self.pooled(pooled_kjt)
        history = []
        for f in self.sequence_names:
            lengths = rows[f].lengths()
            samples = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            summed = torch.zeros(lengths.numel(), DIM).index_add_(0, samples, rows[f].values())
            history.append(summed / lengths.clamp(min=1).unsqueeze(1))
        return self.top(torch.cat([dense] + history + [pooled[f] for f in self.pooled_names], dim=1)).squeeze(1)

    def logits(self, batch: Any) -> torch.Tensor:
        return self(batch.dense, batch.sparse)


# per model: (class, tables' rows, mean ids per sample and feature)
MODELS = {
    "deepfm": (DeepFM, [50_000] * 16, [1.0] * 16),
    "two_tower": (TwoTower, [50_000] * 16, [2.0] * 16),
    "dcn": (WeightedDCN, [50_000] * 12, [4.0] * 12),
    "sequence": (Sequence, [20_000] * 4 + [50_000] * 8, [8.0] * 4 + [1.0] * 8),
}


class _Report(L.Callback):
    """Rank 0 writes the fit's training wall time and what the compiler did."""

    def __init__(self, path: Path) -> None:
        self.path, self.start = path, 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        strategy, seconds = trainer.strategy, time.perf_counter() - self.start
        report = {"seconds": seconds, "steps": trainer.global_step, "executor": strategy.executor_in_use}
        session = strategy.session
        plan = None if session is None else session.loop.plan if session.loop is not None else session.plan
        if plan is not None:
            report.update(calibration_steps=plan.calibration_steps, finished=session.loop is None,
                          accepted=[d.candidate.split("@")[0] for d in plan.accepted],
                          undecided=[d.candidate.split("@")[0] for d in plan.decisions
                                     if d.feasible and d.reason.startswith("not calibrated")])
        self.path.write_text(json.dumps(report))


# the systems a fit can run: the strategy's options beside the defaults
SYSTEMS = {"sparselift": {}, "torchrec": {"executor": "torchrec"}, "identity": {"optimizations": []}}


def fit(name: str, system: str, steps: int, cache: Path, out: Path, callbacks: tuple = ()) -> dict:
    model_class, rows, pooling = MODELS[name]
    dm = CriteoDataModule(batch_size=512, num_train=512 * 2 * steps, num_val=512, num_test=512,
                          rows_per_feature=rows, pooling_factors=pooling, length_distribution="poisson",
                          cache_dir=str(cache), seed=0)
    L.seed_everything(0)
    model = model_class(dm.feature_names, dm.table_sizes)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        strategy=SparseLiftStrategy(start_method="fork", **SYSTEMS[system]),
                        callbacks=[_Report(out), *callbacks])
    trainer.fit(model, dm)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of fits per executor (S T T S ...)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--identity", action="store_true", help="also fit the lifted identity plan")
    parser.add_argument("--json", help="write every fit's report here")
    args = parser.parse_args()
    systems = ("sparselift", "torchrec") + (("identity",) if args.identity else ())
    results: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder)
        for name in args.models.split(","):
            runs = []
            for k in range(args.repeats):
                for system in (systems if k % 2 == 0 else systems[::-1]):
                    runs.append({"system": system, **fit(name, system, args.steps, cache, cache / "report.json")})
            results[name] = runs
            seconds = {e: [round(r["seconds"], 2) for r in runs if r["system"] == e] for e in systems}
            ratio = statistics.median(seconds["torchrec"]) / statistics.median(seconds["sparselift"])
            lifted = [r for r in runs if r["system"] == "sparselift"]
            identity = (f"; identity plan {seconds['identity']} s, torchrec / identity "
                        f"{statistics.median(seconds['torchrec']) / statistics.median(seconds['identity']):.3f}"
                        if args.identity else "")
            print(f"{name}: torchrec / sparselift wall time over {args.steps} steps {ratio:.3f} "
                  f"(sparselift {seconds['sparselift']} s, torchrec {seconds['torchrec']} s{identity}); calibration "
                  f"{[r.get('calibration_steps') for r in lifted]} steps, finished {[r.get('finished') for r in lifted]}; "
                  f"accepted {[r.get('accepted') for r in lifted]}; not calibrated {[r.get('undecided') for r in lifted]}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
