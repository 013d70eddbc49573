"""The kernels that run a module's compute regions, by (region, kernel name) as schedules name
them. Today every region has TorchRec's / fbgemm's reference kernel; a generated kernel is one
more entry. Each region's kernels share one signature."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn


def permute_torchrec(features: Any, order: list[int], order_tensor: Tensor) -> Any:
    """The input keys into group order (KeyedJaggedTensor.permute: fbgemm's permute_2D_sparse_data)."""
    return features.permute(order, order_tensor)


def bucketize_fbgemm(kjt: Any, block_sizes: Tensor, world: int) -> Any:
    """Row-wise: each key's ids split into the ranks' row blocks (keys repeated once per rank)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths, values, weights, _, _ = torch.ops.fbgemm.block_bucketize_sparse_features(
        kjt.lengths().view(-1), kjt.values(), bucketize_pos=False, sequence=False,
        block_sizes=block_sizes.to(kjt.values().dtype), my_size=world, weights=kjt.weights_or_none())
    return KeyedJaggedTensor(keys=list(kjt.keys()) * world, values=values, weights=weights, lengths=lengths.view(-1),
                             stride=kjt.stride())


def recat_fbgemm(keys: list[str], recat: Optional[Tensor], lengths: Tensor, values: Tensor,
                 weights: Optional[Tensor], batch: int, world: int) -> Any:
    """What arrived ([src][key][sample]) as the KJT the lookup reads ([key][src][sample])."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if recat is not None:
        lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
            recat, lengths.view(-1, batch), values, weights, values.numel())
        lengths = lengths.view(-1)
    return KeyedJaggedTensor(keys=keys, values=values, weights=weights, lengths=lengths, stride=batch * world).sync()


def lookup_torchrec(lookup: nn.Module, kjt: Any) -> Tensor:
    """TorchRec's grouped lookup (fbgemm's table-batched embedding, its optimizer fused into backward)."""
    return lookup(kjt)


def output_torchrec(names: list[str], dims: list[int], outs: list[Tensor]) -> Any:
    """The groups' pooled outputs as the KeyedTensor the module returns."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    values = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return KeyedTensor(keys=names, length_per_key=dims, values=values, key_dim=1)


KERNELS: dict[tuple[str, str], Callable[..., Any]] = {
    ("permute", "torchrec"): permute_torchrec,
    ("bucketize", "fbgemm"): bucketize_fbgemm,
    ("recat", "fbgemm"): recat_fbgemm,
    ("lookup", "torchrec"): lookup_torchrec,
    ("output", "torchrec"): output_torchrec,
}


def kernel(region: str, name: str) -> Callable[..., Any]:
    try:
        return KERNELS[(region, name)]
    except KeyError:
        known = sorted(k for r, k in KERNELS if r == region)
        raise LookupError(f"no kernel {name!r} for region {region!r} (available: {known})") from None
