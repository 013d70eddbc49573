"""Bring your own model: a LightningModule with its own TorchRec EmbeddingBagCollection, its own
dense part and its own data, trained with ``Trainer(strategy="sparselift")``.

    python examples/own_model.py                      # 2 CPU processes, 3,700 steps, default options
    python examples/own_model.py --devices 1 --steps 20

Nothing here comes from lightning_sparselift except the strategy name: the model, the dataset and
the collate function that builds the ``KeyedJaggedTensor`` are plain PyTorch / TorchRec /
Lightning. What the strategy needs from the model:

* the sparse features go through ``torchrec.EmbeddingBagCollection``s (every one of them is
  sharded; table names unique across them); build them on the meta device, the strategy
  creates each rank's shards;
* the batch holds the ``KeyedJaggedTensor`` (here ``batch["sparse"]``) and ``training_step``
  passes it to ``forward`` (``self(dense, kjt)``), which calls the EBC with it: the lifted
  executor then starts the sparse path as the forward begins and distributes the next batch's
  ids during the current step;
* ``configure_optimizers`` returns exactly one optimizer, for the dense part
  (``self.parameters()`` is fine: the strategy takes the tables out of it); the tables' optimizer
  is fused into backward and set on the strategy (``embedding_optimizer``, default ``sgd``);
* every rank gets the same number of equally sized batches (Lightning's DistributedSampler
  does that here: 2 * steps * batch_size samples).

Run it as a script: the default launcher re-runs this file once per rank (hence the
``__main__`` guard). Under ``torchrun`` (``--num-nodes``/``--devices`` as torchrun's
``--nnodes``/``--nproc-per-node``) or SLURM's ``srun`` the processes exist already and are used.
``--result-dir`` writes what each rank ran (executor, plan decisions, a checksum of the dense
weights) to ``rank<N>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

import lightning_sparselift  # noqa: F401  (registers the strategy names "sparselift", "sparselift_fork", ...)
from lightning_sparselift.lightning.callbacks import RunReport

# feature -> rows of its table; "category" is multi-hot (0..4 ids per sample), the others one-hot
FEATURES = {"user": 2_000, "item": 5_000, "category": 100}
NUM_DENSE = 4


class ClickDataset(Dataset):
    """Synthetic clicks: per sample 4 dense features, a user, an item, 0-4 categories and a label
    from a planted logistic model (so the loss goes down)."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dense = torch.randn(num_samples, NUM_DENSE, generator=g)
        self.user = torch.randint(FEATURES["user"], (num_samples,), generator=g)
        self.item = torch.randint(FEATURES["item"], (num_samples,), generator=g)
        self.num_categories = torch.randint(0, 5, (num_samples,), generator=g)
        self.categories = torch.randint(FEATURES["category"], (num_samples, 4), generator=g)
        user_effect = torch.randn(FEATURES["user"], generator=g)
        item_effect = torch.randn(FEATURES["item"], generator=g)
        logit = self.dense @ torch.tensor([1.0, -0.5, 0.25, 0.0]) + user_effect[self.user] + item_effect[self.item]
        self.label = torch.bernoulli(torch.sigmoid(logit), generator=g)

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"dense": self.dense[i], "user": [int(self.user[i])], "item": [int(self.item[i])],
                "category": self.categories[i, : int(self.num_categories[i])].tolist(), "label": self.label[i]}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples -> one batch: dense features, a KeyedJaggedTensor of the sparse ids, labels."""
    keys = list(FEATURES)
    # a KJT is key-major: the lengths of every sample for the first key, then for the next key, ...
    lengths = [len(s[key]) for key in keys for s in samples]
    values = [i for key in keys for s in samples for i in s[key]]
    sparse = KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                               lengths=torch.tensor(lengths, dtype=torch.int32))
    return {"dense": torch.stack([s["dense"] for s in samples]), "sparse": sparse,
            "label": torch.stack([s["label"] for s in samples])}


class ClickModel(L.LightningModule):
    """Embeddings of the sparse features (TorchRec EBC, sum pooling), a dense tower, an MLP over both."""

    def __init__(self, embedding_dim: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embeddings = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{feature}", embedding_dim=embedding_dim, num_embeddings=rows,
                                       feature_names=[feature]) for feature, rows in FEATURES.items()],
            device=torch.device("meta"))  # no memory for the full tables on each rank: the strategy shards them
        self.dense_tower = nn.Sequential(nn.Linear(NUM_DENSE, 32), nn.ReLU(), nn.Linear(32, embedding_dim))
        self.over_arch = nn.Sequential(nn.Linear(embedding_dim * (len(FEATURES) + 1), 32), nn.ReLU(),
                                       nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embeddings(sparse)  # a KeyedTensor: one pooled embedding per feature and sample
        tower = self.dense_tower(dense)   # dense work the sparse path's all-to-alls can overlap
        features = torch.cat([tower] + [pooled[feature] for feature in FEATURES], dim=1)
        return self.over_arch(features).squeeze(1)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        logits = self(batch["dense"], batch["sparse"])  # the KJT goes into forward as an argument
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # one optimizer, for the dense part: the strategy removes the (fused) tables from it
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def dense_checksum(model: ClickModel) -> str:
    """sha256 of the dense weights (data-parallel: the same on every rank)."""
    digest = hashlib.sha256()
    for module in (model.dense_tower, model.over_arch):
        for _, tensor in sorted(module.state_dict().items()):
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3700,
                        help="training steps (the calibration takes at most 240 and the steady-state check ~40; "
                             "the rest leaves room for a cold cache's kernel builds, which calibration waits for)")
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--result-dir", default=None, help="write rank<N>.json with what each rank ran")
    args = parser.parse_args()

    L.seed_everything(0)
    world_size = args.devices * args.num_nodes
    loader = DataLoader(ClickDataset(args.steps * world_size * args.batch_size), batch_size=args.batch_size,
                        shuffle=True, collate_fn=collate)  # Lightning adds a DistributedSampler per rank
    trainer = L.Trainer(strategy="sparselift", accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[RunReport(warmup_steps=10)])  # prints the throughput
    model = ClickModel()
    trainer.fit(model, train_dataloaders=loader)

    strategy = trainer.strategy
    plan = strategy.execution_plan  # None when TorchRec's path was kept (strategy.executor_fallback_reason)
    if trainer.is_global_zero:
        print(f"executor: {strategy.executor_in_use} on {trainer.world_size} process(es), "
              f"{trainer.global_step} steps, last loss {float(trainer.callback_metrics['train_loss']):.4f}")
        print("sharding plan:", {table: placement.sharding_type
                                 for module_plan in strategy.sharding_plan.plan.values()
                                 for table, placement in module_plan.items()})
        # the plan (or, read before training ended, the calibration so far), or why TorchRec's path was kept
        print(strategy.session.explain() if strategy.session is not None else "executor='torchrec'")
    if args.result_dir:
        result = {"rank": trainer.global_rank, "node_rank": trainer.node_rank, "world_size": trainer.world_size,
                  "steps": trainer.global_step, "executor": strategy.executor_in_use,
                  "cluster_environment": type(strategy.cluster_environment).__name__,
                  "decisions": [{"candidate": d.candidate, "feasible": d.feasible, "accepted": d.accepted,
                                 "decided": d.decided, "reason": d.reason} for d in plan.decisions] if plan else None,
                  "dense_checksum": dense_checksum(model)}
        Path(args.result_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.result_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
