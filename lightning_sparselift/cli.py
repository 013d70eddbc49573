"""``sparselift``: the command line, built on LightningCLI.

    sparselift fit --config configs/dlrm_synthetic.yaml
    sparselift validate --config configs/tiny.yaml --ckpt_path path/to/checkpoint.ckpt
    sparselift bench --scenario dlrm --world-size 2 --json out.json
"""

from __future__ import annotations

import sys
from typing import Optional

from lightning.pytorch.cli import LightningCLI

import lightning_sparselift  # noqa: F401  (registers the strategy names)
from lightning_sparselift.data import CriteoDataModule
from lightning_sparselift.model import DLRMModule


class SparseLiftCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The model's tables follow the data: sizes and feature names come from the datamodule.
        parser.link_arguments("data.table_sizes", "model.num_embeddings_per_feature", apply_on="instantiate")
        parser.link_arguments("data.feature_names", "model.feature_names", apply_on="instantiate")
        parser.link_arguments("data.num_dense", "model.dense_in_features", apply_on="instantiate")


def main(args: Optional[list[str]] = None) -> None:
    args = list(args if args is not None else sys.argv[1:])
    if args[:1] == ["bench"]:
        from lightning_sparselift.bench.cli import main as bench

        return bench(args[1:])
    SparseLiftCLI(DLRMModule, CriteoDataModule, args=args,
                  save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
