"""What a generated kernel bakes in: one table-batched embedding module's tables, features,
pooling, id check and optimizer, read from fbgemm's module (the storage it keeps owning).

The learning rate is not baked: TorchRec's fused optimizer (and LR schedulers) change it on the
module between steps, so the kernel reads it per call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# fbgemm's optimizers a generated kernel applies (OptimType values)
OPTIMIZERS = {"exact_sgd": "sgd", "exact_adagrad": "adagrad", "exact_row_wise_adagrad": "rowwise_adagrad",
              "adam": "adam"}
# fbgemm's PoolingMode values (none: a row per id, as an EmbeddingCollection's lookups return)
POOLING = {0: "sum", 1: "mean", 2: "none"}


class Unsupported(ValueError):
    """A module configuration no generated kernel exists for (the reason is the message)."""


@dataclass(frozen=True)
class TableSpec:
    rows: int
    dim: int
    weights_offset: int  # first element of the table in the module's flat weights
    state_offset: int  # first element of its optimizer state (momentum1); 0 without state
    first_feature: int
    end_feature: int  # features [first_feature, end_feature) read this table, in KJT order
    state2_offset: int = 0  # first element of its second state (Adam's momentum2)


@dataclass(frozen=True)
class KernelSpec:
    tables: tuple[TableSpec, ...]
    total_dim: int  # output columns: the features' dims in feature order (none: the rows' one width)
    pooling: str  # sum | mean | none
    weighted: bool
    optimizer: str  # sgd | adagrad | rowwise_adagrad | adam
    eps: float
    check_ids: bool  # no input check runs before the kernel: it rejects out-of-range ids itself
    device: str = "cpu"  # where the tables are: cpu (C++ kernel) | cuda (Triton kernel)
    beta1: float = 0.0  # Adam's, rounded to float32
    beta2: float = 0.0
    # tables of each bucket: buckets are independent (disjoint tables, features and output
    # columns) and may run concurrently; one bucket of every table by default
    buckets: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.buckets:
            object.__setattr__(self, "buckets", (tuple(range(len(self.tables))),))
        flat = sorted(t for b in self.buckets for t in b)
        if flat != list(range(len(self.tables))) or not all(self.buckets):
            raise ValueError(f"buckets {self.buckets} do not hold each of the {len(self.tables)} tables exactly once")

    @property
    def features(self) -> list[tuple[int, int, int]]:
        """Per feature in KJT order: (table, dim, first output column; 0 for rows per id)."""
        out, column = [], 0
        for t, table in enumerate(self.tables):
            for _ in range(table.first_feature, table.end_feature):
                out.append((t, table.dim, column))
                column += table.dim if self.pooling != "none" else 0
        return out


def spec_of(tbe: Any, weighted: bool, check_ids: bool) -> KernelSpec:
    """The spec of fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` ``tbe``; :class:`Unsupported`
    names the first thing no generated kernel handles."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    if not isinstance(tbe, SplitTableBatchedEmbeddingBagsCodegen):
        raise Unsupported(f"{type(tbe).__name__} is not fbgemm's fused table-batched embedding (data-parallel and "
                          f"dense kernels update through the dense optimizer)")
    optimizer = OPTIMIZERS.get(tbe.optimizer.value)
    if optimizer is None:
        raise Unsupported(f"optimizer {tbe.optimizer.value}: generated kernels reproduce {sorted(OPTIMIZERS.values())}")
    if str(tbe.weights_precision).lower() not in ("fp32", "sparsetype.fp32"):
        raise Unsupported(f"weights in {tbe.weights_precision}: generated kernels handle fp32 tables")
    placements = set(tbe.weights_placements.tolist())
    if placements == {EmbeddingLocation.HOST.value} and tbe.weights_host.numel():
        device = "cpu"
    elif placements == {EmbeddingLocation.DEVICE.value} and tbe.weights_dev.is_cuda:
        device = "cuda"
    else:
        raise Unsupported("tables placed in managed or cached memory, or mixed: generated kernels read host tables "
                          "(C++) or device tables (Triton)")
    if device == "cpu" and optimizer == "adam" and tbe.momentum2_host.numel() != tbe.weights_host.numel():
        raise Unsupported("Adam on host tables without Adam's second moment (fbgemm's CPU module refuses Adam; "
                          "HostAdamTableBatch keeps its state)")
    pooling = POOLING.get(int(tbe.pooling_mode))
    if pooling is None:
        raise Unsupported(f"pooling mode {tbe.pooling_mode}: generated kernels pool by sum or mean, or return rows")
    args = tbe.optimizer_args
    if args.weight_decay != 0 or args.gradient_clipping or args.max_norm != 0:
        raise Unsupported("weight decay, gradient clipping or max-norm in the fused optimizer")
    table_of = list(tbe.feature_table_map)
    if table_of != sorted(table_of):
        raise Unsupported("features do not read their tables in table order")
    weights_offsets = tbe.weights_offsets.tolist()
    dims = (tbe.D_offsets[1:] - tbe.D_offsets[:-1]).tolist()
    rows = tbe.rows_per_table.tolist()
    state = tbe.momentum1_offsets.tolist() if optimizer != "sgd" else [0] * len(table_of)
    state2 = tbe.momentum2_offsets.tolist() if optimizer == "adam" else [0] * len(table_of)
    tables = []
    for t in range(max(table_of) + 1):
        features = [f for f, x in enumerate(table_of) if x == t]
        first = features[0]
        tables.append(TableSpec(rows=int(rows[first]), dim=int(dims[first]), weights_offset=int(weights_offsets[first]),
                                state_offset=int(state[first]), first_feature=first, end_feature=features[-1] + 1,
                                state2_offset=int(state2[first])))
    total_dim = int(tbe.D_offsets[-1])
    if pooling == "none":
        widths = sorted({t.dim for t in tables})
        if len(widths) != 1 or weighted:
            raise Unsupported(f"rows per id of widths {widths}{' with per-sample weights' if weighted else ''}: "
                              f"generated kernels return rows of one width, unweighted")
        total_dim = widths[0]
    return KernelSpec(tables=tuple(tables), total_dim=total_dim, pooling=pooling, weighted=weighted,
                      optimizer=optimizer, eps=float(args.eps), check_ids=check_ids, device=device,
                      beta1=_float32(args.beta1) if optimizer == "adam" else 0.0,
                      beta2=_float32(args.beta2) if optimizer == "adam" else 0.0)


def _float32(value: float) -> float:
    """``value`` rounded to float32, as fbgemm passes its optimizer's hyper-parameters to its
    kernels (``1 - beta`` is then computed from the rounded beta, as fbgemm's template does)."""
    import numpy as np

    return float(np.float32(value))
