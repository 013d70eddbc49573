"""Train DLRM on synthetic Criteo-like data with SparseLiftStrategy, from plain Python.

    python examples/train_dlrm.py --devices 2 --steps 200

Run it as a script: the default launcher re-runs this file once per rank.
"""

import argparse

import lightning.pytorch as L

from lightning_sparselift import CriteoDataModule, DLRMModule, SparseLiftStrategy
from lightning_sparselift.lightning.callbacks import RunReport


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1024, help="per process")
    parser.add_argument("--row-wise", nargs="*", default=[], help="tables to shard row-wise, e.g. t_cat_2")
    parser.add_argument("--ckpt-dir", default=None, help="save a sharded checkpoint at the end")
    args = parser.parse_args()

    L.seed_everything(0)
    dm = CriteoDataModule(batch_size=args.batch_size, num_train=args.steps * args.devices * args.batch_size,
                          num_val=16 * args.batch_size, num_test=16 * args.batch_size, max_rows=100_000)
    model = DLRMModule(dm.table_sizes, embedding_dim=64, dense_arch_layer_sizes=[512, 256, 64],
                       over_arch_layer_sizes=[512, 256, 1], dense_optimizer="adagrad", dense_lr=0.02)
    strategy = SparseLiftStrategy(sharding_types={t: "row_wise" for t in args.row_wise},
                                  embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_epochs=1,
                        callbacks=[RunReport(warmup_steps=10)], enable_checkpointing=False, logger=False)
    trainer.fit(model, dm)
    if args.ckpt_dir:
        trainer.save_checkpoint(args.ckpt_dir)


if __name__ == "__main__":
    main()
