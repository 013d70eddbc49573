"""TorchRec's mean pooling for row-wise tables, on the lifted executor's output.

fbgemm cannot mean-pool a row-wise shard (a bag's ids are spread over the ranks), so TorchRec's
row-wise lookups sum and, once the reduce-scatter has added the ranks' partial sums, its
ShardedEmbeddingBagCollection divides the module's whole output by a divisor built from the
batch's bag lengths (``_create_mean_pooling_divisor`` / ``_apply_mean_pooling``): per sample and
output key, the feature's bag length, or 1 for a row-wise feature with sum pooling, plus 1e-6.
Features of other sharding types keep their bag length there too: that is TorchRec's rule, and
the lifted executor follows it to stay bit-identical. The divisor is built here from the same
integers with the same ops, so it is the same float tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_sparselift.ir import LiftedModule

_EPS = 1e-6  # TorchRec's guard against a division by 0


class MeanAfterReduce:
    def __init__(self, spec: LiftedModule, device: torch.device) -> None:
        names = [f for g in spec.groups for f in g.features]  # the keys of TorchRec's permuted KJT
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            first.setdefault(name, i)
        self.num_keys = len(spec.keys)
        self.order = torch.tensor(spec.feature_order or list(range(len(names))), dtype=torch.long, device=device)
        self.unit = [first[f] for f in spec.reduce_sum_features]
        self.key_ordering = (None if len(spec.embedding_names) == len(names) else
                             torch.tensor([first[n.split("@")[0]] for n in spec.embedding_names], device=device))
        self.dims = torch.tensor(spec.embedding_dims, device=device)
        self.width = sum(spec.embedding_dims)

    def divisor(self, features: Any) -> Tensor:
        batch = features.stride()
        weights = features.weights_or_none()
        # (weighted bags: TorchRec's length is the sum of the bag's weights)
        lengths = (features.lengths() if weights is None
                   else torch.ops.fbgemm.segment_sum_csr(1, features.offsets().int(), weights))
        lengths = lengths.view(self.num_keys, batch).index_select(0, self.order).reshape(-1)
        for i in self.unit:
            lengths[i * batch:(i + 1) * batch] = 1
        if self.key_ordering is not None:
            lengths = torch.index_select(lengths.reshape(-1, batch), 0, self.key_ordering).reshape(-1)
        per_key = lengths.reshape(-1, batch).T  # [batch, output keys]
        divisor = torch.repeat_interleave(input=per_key, repeats=self.dims, dim=1, output_size=self.width)
        return (divisor + _EPS).detach()

    def apply(self, output: Any, features: Any) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        return KeyedTensor(keys=output.keys(), values=output.values() / self.divisor(features),
                           length_per_key=output.length_per_key(), key_dim=1)
