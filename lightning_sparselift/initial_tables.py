"""Tables a model built with values (on CPU or a GPU, not on meta): TorchRec's sharded modules
create their shards afresh and initialize them from the table configs, dropping the values the
model gave its tables; here they are copied into the shards, so training starts from the model's
own tables as on one process, and the cost (every rank held every full table) is said once."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn


def built_tables(model: nn.Module, tables: list[nn.Parameter]) -> dict[str, torch.Tensor]:
    """The values of ``tables`` (parameters of ``model``) not on the meta device, by their name in
    ``model``'s state dict; a warning names them and the memory they took on every rank."""
    wanted = {id(p) for p in tables if p.device.type != "meta"}
    values = {name: p.detach() for name, p in model.named_parameters() if id(p) in wanted}
    if values:
        megabytes = sum(t.numel() * t.element_size() for t in values.values()) / 2**20
        rank_zero_warn(f"SparseLift: {len(values)} table(s) were built on {next(iter(values.values())).device} "
                      f"instead of the meta device ({', '.join(sorted(values))[:200]}): every rank allocated every "
                      f"full table ({megabytes:.1f} MB) before sharding. Their values are copied into the shards; "
                      f"build the collections with device=torch.device('meta') (and the initial values in the table "
                      f"configs' init_fn) so that each rank allocates only its shards.", category=RuntimeWarning)
    return values


def shard_regions(sharded: Any) -> list[tuple[torch.Tensor, tuple[slice, slice]]]:
    """A ShardedTensor's local shards, each with the region of the whole table it holds."""
    out = []
    for shard in sharded.local_shards():
        rows, cols = shard.metadata.shard_offsets
        height, width = shard.metadata.shard_sizes
        out.append((shard.tensor, (slice(rows, rows + height), slice(cols, cols + width))))
    return out


def copy_into_shards(dmp: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Each rank's shards of the tables in ``values`` (full tables, by state-dict name) set to the
    slices of them they hold; data-parallel tables set whole."""
    if not values:
        return
    state = dmp.state_dict()
    missing = sorted(set(values) - set(state))
    if missing:
        raise RuntimeError(f"the sharded model has no state named {missing}: the tables' initial values could not be "
                           f"copied into their shards")
    with torch.no_grad():
        for name, full in values.items():
            target: Any = state[name]
            if hasattr(target, "local_shards"):
                for tensor, region in shard_regions(target):
                    tensor.copy_(full[region])
            else:
                target.copy_(full)
    dmp.load_state_dict(state)
