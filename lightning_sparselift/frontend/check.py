"""The cross-check of a lifted graph against what TorchRec built inside each sharded module (its
private attributes, initialised by the first forward): the lift is derived from public
structure, and this catches a TorchRec version that lays its data out differently."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_sparselift.frontend.lift import LiftError
from lightning_sparselift.ir.graph import SparseGraph
from lightning_sparselift.ir.vocab import POOLED_ALL_TO_ALL, ROW_SHARDED


def check_against_runtime(graph: SparseGraph, model: nn.Module) -> None:
    """Compare the lifted layout with what TorchRec built inside each sharded module (its
    private attributes, initialised by the first forward). Raises :class:`LiftError` on any
    difference."""
    for m in graph.modules:
        sharded = model.get_submodule(m.path)

        def expect(what: str, ours: Any, theirs: Any) -> None:
            if ours != theirs:
                raise LiftError(f"{m.path}: lifted {what} {ours} differs from TorchRec's {theirs}")

        if sharded._has_uninitialized_input_dist or getattr(sharded, "_has_uninitialized_output_dist", False):
            raise LiftError(f"{m.path}: TorchRec's input/output dists are not initialised (no forward ran yet)")
        expect("sharding types", [g.sharding_type for g in m.groups], list(sharded._sharding_types))
        expect("feature splits", [len(g.features) for g in m.groups], list(sharded._feature_splits))
        if m.pooled:
            expect("feature order", m.feature_order,
                   list(sharded._features_order) if sharded._has_features_permute else [])
            expect("embedding names", m.embedding_names, list(sharded._embedding_names))
            expect("embedding dims", m.embedding_dims, list(sharded._embedding_dims))
            expect("mean pooling after the reduce-scatter", m.mean_after_reduce, sharded._has_mean_pooling_callback)
            expect("row-wise sum features", m.reduce_sum_features,
                   list(sharded._pooling_type_to_rs_features.get("SUM", [])))
            if m.mean_after_reduce:
                expect("dims per output key", m.embedding_dims, [int(d) for d in sharded._dim_per_key.tolist()])
        else:
            expect("feature order", m.feature_order, list(sharded._features_order))
            expect("embedding names per group", [g.embedding_names for g in m.groups],
                   [list(n) for n in sharded._embedding_names_per_sharding])
            expect("column shard order", m.column_shard_order, dict(sharded._features_to_permute_indices))
            for g in m.groups:
                if g.dim_sum_per_rank:
                    expect(f"group {g.index} row width", g.dim_sum_per_rank[0],
                           sharded._embedding_dim_for_sharding_type(g.sharding_type))
        for g, input_dist, output_dist in zip(m.groups, sharded._input_dists, sharded._output_dists):
            kind = g.kind  # (None: TorchRec's modules run the group, whatever their layout)
            if kind in POOLED_ALL_TO_ALL and not m.pooled:
                expect(f"group {g.index} features per rank", g.features_per_rank, list(input_dist._dist._splits))
            elif kind in POOLED_ALL_TO_ALL:
                expect(f"group {g.index} features per rank", g.features_per_rank, list(input_dist._dist._splits))
                expect(f"group {g.index} output dims per rank", g.dim_sum_per_rank, list(output_dist._dim_sum_per_rank))
                callbacks = list(getattr(output_dist, "_callbacks", None) or [])
                width = sum(g.dim_sum_per_rank)
                probe = torch.arange(width, dtype=torch.float32).view(1, width)
                for callback in callbacks:
                    probe = callback(probe)
                theirs = [int(c) for c in probe.view(-1).tolist()]
                ours = g.column_order or list(range(width))
                expect(f"group {g.index} output column order", ours, theirs)
            elif kind in ROW_SHARDED:
                expect(f"group {g.index} row block sizes", g.block_sizes,
                       [int(b) for b in input_dist._feature_block_sizes_tensor.tolist()])
                if (getattr(input_dist, "_has_multiple_blocks_per_shard", False)
                        or getattr(input_dist, "zch_bucketize_row_pos", False)):
                    raise LiftError(f"{m.path}: row-wise group {g.index} uses multi-block bucketization")
                if input_dist._has_feature_processor:
                    raise LiftError(f"{m.path}: row-wise group {g.index} bucketizes positions (feature processor)")
                if kind == "table_row_wise":
                    # one host: the staggered shuffle after bucketization keeps the bucket-major order
                    buckets = len(g.block_sizes) * graph.world_size
                    expect(f"group {g.index} order after bucketization", list(range(buckets)),
                           list(input_dist._sf_staggered_shuffle))
                    expect(f"group {g.index} all-to-all stagger", 1, input_dist._dist._stagger)
                    expect(f"group {g.index} ranks of the cross-host all-to-all", 1, output_dist._cross_pg.size())
                else:
                    expect(f"group {g.index} returning rows in id order", not m.pooled, input_dist._is_sequence)
