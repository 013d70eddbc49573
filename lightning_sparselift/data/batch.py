"""The batch and the column stores that cut batches from a split: :class:`RecBatch` (dense, a
KJT, labels, weights), :class:`RecArrays` (the generated splits' layout, feature-major ids),
:class:`OneHotRecArrays` (the row-major npy layout ``torchrec.datasets.criteo`` writes) and
:class:`ConcatRecArrays` (several stores read as one).

Batches are assembled by slicing memory-mapped arrays (one dataset item is one whole batch), so
loading is a handful of ``np`` slices per step and never part of the measured model execution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass
class RecBatch(Pipelineable):
    """One batch: dense features, sparse features as a KJT, labels and per-sample weights.
    It is ``Pipelineable``, so TorchRec's train pipelines can move and prefetch it.

    ``weights`` is 1 for real samples and 0 for the padding that keeps every rank's number of
    evaluation batches equal (so metrics never count a sample twice).
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    weights: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "RecBatch":
        return RecBatch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            weights=self.weights.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)
        self.weights.record_stream(stream)

    def pin_memory(self) -> "RecBatch":
        return RecBatch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory(),
                        self.weights.pin_memory())

    def __len__(self) -> int:
        return int(self.labels.numel())


class RecArrays:
    """Column store of one split: dense [N, 13], labels [N], per feature (lengths [N], values).

    ``values`` holds all features' ids feature-major in one array; feature ``f``'s ids for
    samples ``[s, e)`` are the contiguous slice ``values[starts[f] + offsets[f, s] :
    starts[f] + offsets[f, e]]``, so a batch of consecutive samples costs one slice per feature.
    """

    def __init__(self, dense: np.ndarray, labels: np.ndarray, lengths: np.ndarray,
                 values: np.ndarray, feature_names: Sequence[str], id_modulus: Optional[Sequence[int]] = None):
        if lengths.shape != (len(feature_names), dense.shape[0]):
            raise ValueError(f"lengths must have shape (features, samples) = {(len(feature_names), dense.shape[0])}, "
                             f"got {lengths.shape}")
        self.dense = dense
        self.labels = labels
        self.lengths = lengths
        self.values = values
        self.feature_names = list(feature_names)
        self.id_modulus = None if id_modulus is None else torch.tensor(list(id_modulus), dtype=torch.int64)
        offsets = np.zeros((lengths.shape[0], lengths.shape[1] + 1), dtype=np.int64)
        np.cumsum(lengths, axis=1, out=offsets[:, 1:])
        self.offsets = offsets
        self.starts = np.concatenate([[0], np.cumsum(offsets[:, -1])[:-1]])
        if int(offsets[:, -1].sum()) != values.shape[0]:
            raise ValueError(f"lengths sum to {int(offsets[:, -1].sum())} ids but values holds {values.shape[0]}")

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def batch(self, start: int, end: int) -> RecBatch:
        pieces = [self.values[b + o[start]: b + o[end]] for b, o in zip(self.starts, self.offsets)]
        values = torch.from_numpy(np.concatenate(pieces).astype(np.int64, copy=False))
        lengths = torch.from_numpy(np.ascontiguousarray(self.lengths[:, start:end]).astype(np.int32).reshape(-1))
        if self.id_modulus is not None:
            values = values % self.id_modulus.repeat_interleave(
                torch.tensor([p.shape[0] for p in pieces], dtype=torch.int64))
        # np.array copies: the columns may be read-only memory maps, which a batch must not alias.
        return RecBatch(
            dense=torch.from_numpy(np.array(self.dense[start:end], dtype=np.float32)),
            sparse=KeyedJaggedTensor.from_lengths_sync(keys=self.feature_names, values=values, lengths=lengths),
            labels=torch.from_numpy(np.array(self.labels[start:end], dtype=np.float32)),
            weights=torch.ones(end - start, dtype=torch.float32),
        )



class OneHotRecArrays:
    """One id per feature, row-major as ``torchrec.datasets.criteo`` writes it: dense [N, 13],
    ids [N, F], labels [N] (or [N, 1]). A batch transposes only its own rows, so memory-mapped
    files are never loaded whole. With ``id_modulus`` the ids are taken modulo the table sizes
    the way TorchRec's ``InMemoryBinaryCriteoIterDataPipe(hashes=...)`` does (``sparse % hashes``).
    """

    def __init__(self, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray, feature_names: Sequence[str],
                 id_modulus: Optional[Sequence[int]] = None):
        labels = labels.reshape(-1)
        n = dense.shape[0]
        if sparse.ndim != 2 or sparse.shape != (n, len(feature_names)) or labels.shape[0] != n:
            raise ValueError(f"inconsistent Criteo npy shapes: dense {dense.shape}, sparse {sparse.shape}, "
                             f"labels {labels.shape}; expected sparse (N, {len(feature_names)})")
        if id_modulus is not None and len(id_modulus) != len(feature_names):
            raise ValueError(f"{len(id_modulus)} table sizes for {len(feature_names)} features")
        self.dense, self.sparse, self.labels = dense, sparse, labels
        self.feature_names = list(feature_names)
        self.id_modulus = None if id_modulus is None else np.asarray(id_modulus, dtype=np.int64).reshape(1, -1)

    def __len__(self) -> int:
        return int(self.dense.shape[0])

    def batch(self, start: int, end: int) -> RecBatch:
        ids = np.array(self.sparse[start:end], dtype=np.int64)  # a copy, never a view of the file
        if self.id_modulus is not None:
            ids %= self.id_modulus
        values = torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1))
        lengths = torch.ones(values.numel(), dtype=torch.int32)
        return RecBatch(
            dense=torch.from_numpy(np.array(self.dense[start:end], dtype=np.float32)),
            sparse=KeyedJaggedTensor.from_lengths_sync(keys=self.feature_names, values=values, lengths=lengths),
            labels=torch.from_numpy(np.array(self.labels[start:end], dtype=np.float32)),
            weights=torch.ones(end - start, dtype=torch.float32),
        )


class ConcatRecArrays:
    """Several column stores read as one (e.g. consecutive day files): a batch that crosses a
    boundary is the concatenation of the parts' batches, as TorchRec's in-memory Criteo reader
    fills a batch across files."""

    def __init__(self, parts: Sequence[Any]):
        self.parts = [p for p in parts if len(p) > 0]
        if not self.parts:
            raise ValueError("no rows in any part")
        self.feature_names = list(self.parts[0].feature_names)
        self.bounds = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def batch(self, start: int, end: int) -> RecBatch:
        pieces = []
        for part, lo, hi in zip(self.parts, self.bounds[:-1], self.bounds[1:]):
            s, e = max(start, int(lo)), min(end, int(hi))
            if s < e:
                pieces.append(part.batch(s - int(lo), e - int(lo)))
        return pieces[0] if len(pieces) == 1 else _cat_batches(pieces)


def _cat_batches(batches: Sequence[RecBatch]) -> RecBatch:
    keys = batches[0].sparse.keys()
    values, lengths = [], []
    for key in keys:
        for b in batches:
            jt = b.sparse[key]
            values.append(jt.values())
            lengths.append(jt.lengths())
    return RecBatch(
        dense=torch.cat([b.dense for b in batches]),
        sparse=KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)),
        labels=torch.cat([b.labels for b in batches]),
        weights=torch.cat([b.weights for b in batches]),
    )
