"""A sharding group the lifted executor leaves to TorchRec (``ShardingGroup.not_lifted``): its own
input dist, lookup and output dist modules, called in the executor's step as TorchRec's
``ShardedEmbeddingBagCollection`` calls them (same context, same awaitables), so that group
moves and computes exactly what TorchRec's path does while the module's other groups run
lifted. Its gradients take TorchRec's autograd functions back, the fused update included."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn


class TorchRecGroup:
    def __init__(self, sharded: nn.Module, index: int) -> None:
        # (its lookup is the group's lookup module, which the executor runs with the others)
        self.input_dist = sharded._input_dists[index]
        self.output_dist = sharded._output_dists[index]

    @torch.no_grad()
    def start(self, features: Any) -> Callable[[], tuple[Any, Any]]:
        """Issue the group's input distribution of ``features`` (its part of the module's
        permuted KJT); the function returned waits for it and gives the KJT the lookup reads and
        the context the output distribution needs."""
        from torchrec.distributed.embedding_sharding import EmbeddingShardingContext, KJTListSplitsAwaitable
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext

        context = EmbeddingBagCollectionContext(sharding_contexts=[EmbeddingShardingContext(
            batch_size_per_feature_pre_a2a=features.stride_per_key(),
            variable_batch_per_feature=features.variable_stride_per_key())])
        # (TorchRec's awaitable of the module's groups, here of one: it fills the context as TorchRec's does)
        splits = KJTListSplitsAwaitable([self.input_dist(features)], context)

        def complete() -> tuple[Any, Any]:
            with torch.no_grad():
                return splits.wait().wait()[0], context.sharding_contexts[0]

        return complete

    def issue_output(self, local: Tensor, context: Any) -> Any:
        """The output distribution of the group's lookup output, in flight (``.wait()`` gives
        this rank's samples' pooled embeddings)."""
        return self.output_dist(local, context)
