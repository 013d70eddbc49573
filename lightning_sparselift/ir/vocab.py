"""The words the graph, the passes and the runtime share: sharding types, collective roles, the
points of a training step where work is issued and waited for, region names, and dtype sizes.
Every list of kinds the code tests against is defined here once.

Glossary: one word, one thing (a second sense always carries its qualifier).

- **capture step**: a training step run on TorchRec's path while capture records what the sparse
  modules receive (``capture_steps``, formerly ``warmup_batches``).
- **warmup**: steps or pairs run but not measured before a measurement (a calibration's
  ``warmup_pairs``, the bench's ``--warmup-steps``, a steady-state check's warmup pair).
- **settle step**: an unmeasured step after a plan switch, when the schedule distributes the next
  batch a step ahead.
- **process group**: a ``torch.distributed`` group (``process_group`` fields; ``check_group``:
  the one for per-step checks). **sharding group**: the tables of one module that TorchRec looks
  up together (``ShardingGroup``, its ``index``). The negative ``*_KERNEL_GROUP`` ids of
  ``ir/schedule.py`` name a module's consumer-layout and input kernels where a sharding group's
  index would stand.
- **bucket**: a subset of a module's sharding groups whose lookups and exchanges run together
  (subgraph parallelism, pipelined buckets). DDP's gradient buckets are "DDP buckets"; a byte
  buffer's per-destination piece is a "chunk"; ``bucketize`` (TorchRec's and fbgemm's word) splits a
  row-sharded feature's ids by row block.
- **kernel**: a compute function a region runs: TorchRec's or fbgemm's (``REFERENCE_KERNELS``) or
  a generated one (``generated``, ``consumer``); a generated kernel's compiled module is its
  "build".
- **collective role**: what a collective carries (``CollectiveRole``). **candidate role**: the
  kind of change a pass proposes (``Candidate.role``; ``pass:role`` in ``optimizations``).
- **check**: a test that raises or reports. The **step check** (non-finite values, every step),
  the **input check** (``validate_inputs``: a batch's KJTs), the **steady-state check** (the plan
  against the identity plan), the **drift check** (the workload, every ``drift_check_every``
  steps), ``check_schedule`` / ``check_against_runtime`` (a graph's consistency), a pass's
  ``check`` (a candidate's feasibility).
- **plan**: an ``ExecutionPlan`` (the decisions and the graph they give); TorchRec's placement of
  tables is its **sharding plan**.
- **identity plan**: the lifted graph before any pass; the **incumbent**: the graph a planning
  round measures a candidate against.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

# TorchRec's sharding types the lifted executor runs
LiftedShardingType = Literal["table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise",
                             "data_parallel"]
LIFTED_SHARDING_TYPES: tuple[str, ...] = get_args(LiftedShardingType)
# every sharding type the strategy accepts
SHARDING_TYPES: tuple[str, ...] = LIFTED_SHARDING_TYPES
# kinds whose features travel to their owners through an input all-to-all
INPUT_ALL_TO_ALL: tuple[str, ...] = ("table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")
# kinds whose pooled outputs go back to the samples' ranks through an all-to-all
POOLED_ALL_TO_ALL: tuple[str, ...] = ("table_wise", "column_wise", "table_column_wise")
# a table's columns split into shards (table-column-wise: TorchRec's column-wise with all of a
# table's shards on the ranks of one host; the same exchanges and output column permutation)
COLUMN_SHARDED: tuple[str, ...] = ("column_wise", "table_column_wise")
# a table's rows split into blocks, every feature bucketized by row block (table-row-wise: the
# blocks on the ranks of one host; lifted when that host is the whole world, where its exchanges
# are row-wise's)
ROW_SHARDED: tuple[str, ...] = ("row_wise", "table_row_wise")
# kinds whose partial sums are reduce-scattered by sample block
REDUCE_SCATTER: tuple[str, ...] = ROW_SHARDED


def output_collective(kind: str | None, pooled: bool) -> str | None:
    """How a group's lookup outputs go back to the ranks that own the samples: pooled blocks of
    table/column-wise groups by all-to-all and row-wise partial sums by reduce-scatter; an
    EmbeddingCollection's rows (one per id, not pooled) of every exchanged kind by all-to-all, each
    row to the rank its id came from; data-parallel outputs stay where they are (None)."""
    if kind in POOLED_ALL_TO_ALL or (not pooled and kind in INPUT_ALL_TO_ALL):
        return "all_to_all_single"
    return "reduce_scatter" if kind in REDUCE_SCATTER else None

CollectiveRole = Literal[
    "input_splits",  # per destination: lengths, values, (weights,) batch size each group sends
    "input_lengths", "input_values", "input_weights",  # TorchRec's payload: one all-to-all per tensor
    "input_payload",  # every tensor of a bucket's groups in one byte-packed all-to-all
    "output_pooled", "grad_pooled",  # pooled embeddings and their gradients (table/column-wise)
    "output_sequence", "grad_sequence",  # an EmbeddingCollection's rows (one per id) and their gradients
    "output_partial_sums", "grad_all_gather",  # row-wise: reduce-scatter, then all-gather in backward
    "dp_table_grad", "dense_grad",  # gradients all-reduced by DDP (not issued by the executor)
]
COLLECTIVE_ROLES: tuple[str, ...] = get_args(CollectiveRole)

# where a collective is issued or waited for, in a training step's order
Point = Literal[
    "previous_step",  # after the previous training step's call of the module
    "root_forward",  # when the root module's forward begins
    # the sparse module's own call (an exchange waited here: when the model first reads the
    # call's output, as TorchRec's lazy outputs are waited)
    "module_call",
    "module_call_backward",  # in backward, where the module call's output receives its gradient
    "lookup_backward",  # in backward, just before the lookups' fused update
    "ddp_backward",  # DDP's gradient buckets (outside the executor)
]
POINTS: tuple[str, ...] = get_args(Point)
# in backward, autograd replays forward's points in reverse
BACKWARD_OF: dict[str, str] = {"module_call": "module_call_backward", "root_forward": "lookup_backward"}

RegionName = Literal["permute", "bucketize", "recat", "lookup", "output"]
REGION_NAMES: tuple[str, ...] = get_args(RegionName)

Packing = Literal["per_tensor", "bytes"]  # one collective per tensor (TorchRec's), or all in one byte buffer

# the dtypes a graph names (uint8: byte-packed payloads), and their element sizes
Dtype = Literal["int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "uint8", "bool"]
DTYPE_BYTES: dict[str, int] = {name: getattr(torch, name).itemsize for name in get_args(Dtype)}
# TorchRec's quantized communication formats the lifted executor applies: their dtype on the wire
# and bytes per value (INT8: rows of 32 codes with a float32 scale and bias)
WireFormat = Literal["fp16", "bf16", "int8"]
WIRE_FORMATS: dict[str, tuple[str, float]] = {"fp16": ("float16", 2.0), "bf16": ("bfloat16", 2.0),
                                              "int8": ("uint8", 40 / 32)}
# TorchRec's quantized comm ops (its codec registry's keys) and the output collectives' roles
# (ir/steps) each covers, forward and backward
POOLED_ALL_TO_ALL_OP, REDUCE_SCATTER_OP = "POOLED_EMBEDDINGS_ALL_TO_ALL", "POOLED_EMBEDDINGS_REDUCE_SCATTER"
SEQUENCE_ALL_TO_ALL_OP = "SEQUENCE_EMBEDDINGS_ALL_TO_ALL"
WIRE_ROLES: dict[str, tuple[str, str]] = {POOLED_ALL_TO_ALL_OP: ("output_pooled", "grad_pooled"),
                                          REDUCE_SCATTER_OP: ("output_partial_sums", "grad_all_gather"),
                                          SEQUENCE_ALL_TO_ALL_OP: ("output_sequence", "grad_sequence")}
# the output collectives the communication-precision pass may narrow (the all-to-alls, whose values
# are only moved; a reduce-scatter would sum them in the narrower format)
CAST_OPS = (POOLED_ALL_TO_ALL_OP, SEQUENCE_ALL_TO_ALL_OP)
CAST_ROLES = tuple(role for op in CAST_OPS for role in WIRE_ROLES[op])
# the format it casts float32 values to, value by value (in the layouts' packing copies): BF16 only
# (FP16 would overflow silently without a saturation check: passes/communication_precision.py)
CAST_FORMATS: dict[str, torch.dtype] = {"bf16": torch.bfloat16}
# each destination's chunk of a byte-packed buffer is padded to this many bytes
PACK_ALIGNMENT = 8


def dtype_name(dtype: object) -> str:
    """``torch.int64`` -> ``"int64"``."""
    return str(dtype).removeprefix("torch.")


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the packing alignment."""
    return -(-nbytes // PACK_ALIGNMENT) * PACK_ALIGNMENT
