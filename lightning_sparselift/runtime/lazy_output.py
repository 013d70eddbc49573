"""A lifted module's output handed to the model as TorchRec's sharded modules hand theirs: an
awaitable that the model's first read waits for (TorchRec's ``LazyAwaitable``). The output
exchange stays in flight until then and overlaps what the model does meanwhile, e.g. its next
sparse module's input distribution and lookups; reading one key (``output[key]``) defers the wait
to that key's first use, as TorchRec's ``EmbeddingBagCollectionAwaitable`` does."""

from __future__ import annotations

from typing import Any, Callable

from torchrec.distributed.types import LazyAwaitable, LazyGetItemMixin


class LazyOutput(LazyGetItemMixin[str, Any], LazyAwaitable[Any]):
    def __init__(self, finish: Callable[[], Any]) -> None:
        super().__init__()
        self._finish = finish

    def _wait_impl(self) -> Any:
        return self._finish()


def settle(output: LazyOutput) -> None:
    """Wait for ``output`` unless the model already read it."""
    LazyAwaitable._wait_async(output)
