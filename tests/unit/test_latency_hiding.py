"""The next-batch schedule's moving parts in one process (its calibration's settle steps:
test_design.py): the training loader read one batch ahead, capture's check that the announced batch is what the model
gets, the optimizations' names. Through the strategy: tests/ranks/test_next_batch_fit.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_sparselift import SparseLiftStrategy
from lightning_sparselift.frontend.capture import SparseCapture
from lightning_sparselift.frontend.lift import _next_batch_source
from lightning_sparselift.lightning.lookahead import LookaheadLoader


def test_lookahead_loader_yields_the_same_batches_and_knows_the_next():
    sampler = DistributedSampler(list(range(10)), num_replicas=1, rank=0, shuffle=True, seed=1)
    loader = LookaheadLoader(DataLoader(list(range(10)), batch_size=3, sampler=sampler))
    assert len(loader) == 4 and loader.sampler is sampler  # Lightning sets the epoch through it
    plain = [b.tolist() for b in DataLoader(list(range(10)), batch_size=3, sampler=sampler)]
    seen, following = [], []
    for batch in loader:
        seen.append(batch.tolist())
        nxt = loader.after(batch)
        following.append(nxt.tolist() if nxt is not None else None)
    assert seen == plain
    assert following == plain[1:] + [None]
    assert loader.after(torch.zeros(1)) is None  # not a batch it yielded


class _Batch:
    def __init__(self, sparse):
        self.sparse = sparse


class _Root(nn.Module):
    def __init__(self):
        super().__init__()
        from torchrec import EmbeddingBagCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                                     feature_names=["f"])])

    def forward(self, batch):
        return self.ebc(batch.sparse)


def _batch(seed: int) -> _Batch:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(seed)
    return _Batch(KeyedJaggedTensor(keys=["f"], values=torch.randint(0, 10, (4,), generator=gen),
                                    lengths=torch.ones(4, dtype=torch.int32)))


def _capture(steps):
    """Capture steps of (batch trained on, batch announced as next, change before the step)."""
    root = _Root()
    capture = SparseCapture(root, ["ebc"], 0, 1)
    for batch, announced, change in steps:
        if change is not None:
            change(batch)
        with capture.step(batch, announced):
            root(batch)
    return capture.result().modules["ebc"]


def test_capture_checks_the_announced_batch_against_what_the_model_gets():
    b = [_batch(i) for i in range(4)]
    good = _capture([(b[0], b[1], None), (b[1], b[2], None), (b[2], None, None)])
    assert good.batch_input == [["arg", 0], ["attr", "sparse"]]
    assert good.announced_exact == [None, True, True]
    assert _next_batch_source([good, good]) == (good.batch_input, "")

    wrong = _capture([(b[0], b[2], None), (b[1], None, None)])  # the loop announced another batch
    assert wrong.announced_exact == [None, False]

    def in_place(batch):
        batch.sparse.values().add_(1).remainder_(10)

    changed = _capture([(b[0], b[1], None), (b[1], None, in_place)])  # changed after the announcement
    assert changed.announced_exact == [None, False]
    for captured in (wrong, changed):
        path, why = _next_batch_source([good, captured])
        assert path is None and "differed from the features the module received" in why
    silent = _capture([(b[0], None, None), (b[1], None, None)])
    assert _next_batch_source([silent])[1].startswith("the training loop announced no next batch")


def test_optimizations_select_passes_or_one_role_of_a_pass():
    from lightning_sparselift.passes import select_passes

    chosen = {p.name: p.only for p in select_passes(["aggregation", "latency_hiding:early_start"])}
    assert chosen == {"aggregation": None, "latency_hiding": {"early_start"}}
    assert {p.name: p.only for p in select_passes(["latency_hiding:next_batch", "latency_hiding"])} == \
        {"latency_hiding": None}
    with pytest.raises(ValueError, match="latency_hiding proposes"):
        SparseLiftStrategy(optimizations=["latency_hiding:prefetch"])
    with pytest.raises(ValueError, match="unknown optimization"):
        SparseLiftStrategy(optimizations=["fusion"])
