"""Checks on the sparse input of every sharded EmbeddingBagCollection, before any collective.

fbgemm's CPU lookup kernels do not bounds-check ids by default (an id past a table's end reads
or updates memory that belongs to another table), and a KJT with missing or extra keys fails
deep inside the input all-to-all. These checks turn both into clear errors naming the feature.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class SparseInputError(ValueError):
    pass


def check_kjt(module_path: str, kjt: Any, rows_per_feature: dict[str, int]) -> None:
    keys = list(kjt.keys())
    if set(keys) != set(rows_per_feature) or len(keys) != len(rows_per_feature):
        missing = sorted(set(rows_per_feature) - set(keys))
        extra = sorted(set(keys) - set(rows_per_feature))
        raise SparseInputError(f"{module_path}: the batch's KeyedJaggedTensor keys do not match the model's features "
                               f"(missing {missing}, unexpected {extra}, duplicated "
                               f"{sorted({k for k in keys if keys.count(k) > 1})})")
    values = kjt.values()
    if values.numel() == 0:
        return
    bounds = torch.tensor([rows_per_feature[k] for k in keys], dtype=values.dtype, device=values.device)
    per_key = torch.tensor(kjt.length_per_key(), device=values.device)
    limit = torch.repeat_interleave(bounds, per_key)
    bad = (values < 0) | (values >= limit)
    if bool(bad.any()):
        owner = torch.repeat_interleave(torch.arange(len(keys), device=values.device), per_key)
        first = int(bad.nonzero()[0])
        key = keys[int(owner[first])]
        raise SparseInputError(f"{module_path}: id {int(values[first])} of feature {key!r} is outside its table's "
                               f"range [0, {rows_per_feature[key]}) ({int(bad.sum())} bad id(s) in this batch)")


def install_input_checks(model: nn.Module, module_paths: list[str], tables: dict[str, Any]) -> None:
    """Register a forward pre-hook on each (sharded) embedding module at ``module_paths``."""
    for path in module_paths:
        rows = {f: t.num_embeddings for t in tables.values() if t.module_path == path for f in t.feature_names}

        def hook(_module: nn.Module, args: tuple, kwargs: dict, path: str = path, rows: dict = rows) -> None:
            kjt = args[0] if args else kwargs.get("features")
            check_kjt(path, kjt, rows)

        model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True)
