"""The LightningCLI of ``sparselift fit | validate | test | predict`` (the command itself:
``lightning_sparselift/cli.py``): any model family with any data module, the model's tables
following the data."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

from lightning_sparselift.models import RecModule


class SparseLiftCLI(LightningCLI):
    """Any model family (a :class:`RecModule`) with any data module that exposes ``table_sizes``,
    ``feature_names`` and ``num_dense``; a config without ``class_path`` means
    :class:`~lightning_sparselift.models.DLRMModule` and
    :class:`~lightning_sparselift.data.CriteoDataModule`."""

    def __init__(self, **kwargs) -> None:
        super().__init__(RecModule, pl.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"model": {"class_path": "lightning_sparselift.models.DLRMModule", "init_args": {}},
                             "data": {"class_path": "lightning_sparselift.data.CriteoDataModule", "init_args": {}}})
        # The model's tables follow the data: sizes and feature names come from the datamodule.
        parser.link_arguments("data.table_sizes", "model.init_args.num_embeddings_per_feature",
                              apply_on="instantiate")
        parser.link_arguments("data.feature_names", "model.init_args.feature_names", apply_on="instantiate")
        parser.link_arguments("data.num_dense", "model.init_args.dense_in_features", apply_on="instantiate")
