"""The kernels that run a module's compute regions, by (region, kernel name) as schedules name
them. Today every region has TorchRec's / fbgemm's reference kernel; a generated kernel is one
more entry. Each region's kernels share one signature."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_sparselift.ir import LiftedModule


def permute_torchrec(features: Any, order: list[int], order_tensor: Tensor) -> Any:
    """The input keys into group order (KeyedJaggedTensor.permute: fbgemm's permute_2D_sparse_data)."""
    return features.permute(order, order_tensor)


def bucketize_fbgemm(kjt: Any, block_sizes: Tensor, world: int, sequence: bool) -> tuple[Any, Optional[Tensor]]:
    """Row-wise: each key's ids split into the ranks' row blocks (keys repeated once per rank);
    with ``sequence`` (an EmbeddingCollection) also where each id lands, to put its row back."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths, values, weights, _, unbucketize = torch.ops.fbgemm.block_bucketize_sparse_features(
        kjt.lengths().view(-1), kjt.values(), bucketize_pos=False, sequence=sequence,
        block_sizes=block_sizes.to(kjt.values().dtype), my_size=world, weights=kjt.weights_or_none())
    return KeyedJaggedTensor(keys=list(kjt.keys()) * world, values=values, weights=weights, lengths=lengths.view(-1),
                             stride=kjt.stride()), unbucketize


def recat_order(keys: int, world: int, device: Optional[torch.device] = None) -> Tensor:
    """The permutation :func:`recat_fbgemm` takes: what arrived, [src][key], into [key][src]."""
    return torch.tensor([k + src * keys for k in range(keys) for src in range(world)], dtype=torch.int32,
                        device=device)


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


def output_torchrec(module: LiftedModule, outs: list[Tensor], features: list[Any]) -> Any:
    """What the module returns: the groups' pooled outputs as one KeyedTensor, or (an
    EmbeddingCollection) a JaggedTensor per feature, built by TorchRec's own function from each
    group's rows and its ``features`` before distribution."""
    if module.pooled:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        values = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return KeyedTensor(keys=module.embedding_names, length_per_key=module.embedding_dims, values=values, key_dim=1)
    from torchrec.modules.utils import construct_jagged_tensors

    out: dict[str, Any] = {}
    for group, rows, kjt in zip(module.groups, outs, features):
        out.update(construct_jagged_tensors(rows, kjt, group.embedding_names,
                                            features_to_permute_indices=module.column_shard_order))
    return out


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
