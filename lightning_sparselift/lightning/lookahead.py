"""The training dataloader read one batch ahead, so the strategy knows the batch that follows the
one a step trains on (latency hiding's ``next_batch`` schedule distributes it during that step)."""

from __future__ import annotations

import copy
from typing import Any, Optional

_END = object()


class LookaheadLoader:
    """The training dataloader, read one batch ahead: while a step trains on batch k, batch k+1
    has been fetched, so the strategy can announce it to the lifted executor (the ``next_batch``
    schedule distributes its sparse input during step k). Length, sampler, dataset and every
    other attribute are the wrapped loader's; the batches and their order are unchanged.

    A stateful wrapped loader (``state_dict`` / ``load_state_dict``: Lightning saves its state in
    checkpoints and restores it on resume) is one batch ahead of the training loop, so its state
    is reported as it was before the batch ahead was fetched: the position of the batch last
    yielded, and a resume continues with the batch after it."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._recent: list[Any] = []  # the last batches yielded and the one fetched ahead
        self._consumer_state: Optional[dict] = None  # the wrapped loader's state before the batch ahead was fetched

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        attribute = getattr(self.loader, name)
        # only here, not as methods, so that they exist exactly when the wrapped loader has them
        # (Lightning saves the state of loaders that have them, and warns about the others)
        if name == "state_dict":
            return self._state_dict
        if name == "load_state_dict":
            return self._load_state_dict
        return attribute

    def __iter__(self) -> Any:
        iterator = iter(self.loader)
        ahead = self._fetch(iterator)
        self._recent = []
        while ahead is not _END:
            current, ahead = ahead, self._fetch(iterator)
            self._recent = self._recent[-2:-1] + [current] + ([ahead] if ahead is not _END else [])
            yield current
        self._recent = []
        self._consumer_state = None  # nothing is fetched ahead any more

    def _fetch(self, iterator: Any) -> Any:
        if hasattr(self.loader, "state_dict"):
            # copied: the loader may go on changing the object it returned
            self._consumer_state = copy.deepcopy(self.loader.state_dict())
        return next(iterator, _END)

    def _state_dict(self) -> dict:
        return self.loader.state_dict() if self._consumer_state is None else self._consumer_state

    def _load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._consumer_state = None

    def after(self, batch: Any) -> Any:
        """The batch that follows ``batch`` (an object this loader yielded), if fetched; else None."""
        for i, item in enumerate(self._recent[:-1]):
            if item is batch:
                return self._recent[i + 1]
        return None
