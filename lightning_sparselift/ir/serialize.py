"""The graph as JSON, and its fingerprint: a hash of its structure (modules, groups, layouts,
schedules; never measured statistics or prose), equal on every rank exactly when all ranks will
issue the same collectives in the same order with the same layouts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from lightning_sparselift.typed_json import decode

if TYPE_CHECKING:
    from lightning_sparselift.ir.graph import SparseGraph

# measured, probed on the machine or descriptive: not part of the structure
_NOT_STRUCTURE = ("ids_per_step", "length_percentiles", "next_batch_note", "consumer_note", "output_kernels",
                  "output_notes", "input_kernels", "input_notes")
_GROUP_NOT_STRUCTURE = ("lookup_kernels", "lookup_notes", "built_buckets")


def _structure(module: Any) -> dict[str, Any]:
    out = {k: v for k, v in asdict(module).items() if k not in _NOT_STRUCTURE}
    out["groups"] = [{k: v for k, v in g.items() if k not in _GROUP_NOT_STRUCTURE} for g in out["groups"]]
    return out


def graph_to_dict(graph: "SparseGraph") -> dict[str, Any]:
    return asdict(graph)


def graph_from_dict(data: Any) -> "SparseGraph":
    from lightning_sparselift.ir.graph import SparseGraph

    return decode(SparseGraph, data)


def graph_to_json(graph: "SparseGraph") -> str:
    return json.dumps(graph_to_dict(graph), indent=1, sort_keys=True)


def fingerprint(graph: "SparseGraph") -> str:
    structure = {
        "version": graph.version, "world_size": graph.world_size, "backend": graph.backend,
        "modules": [_structure(m) for m in graph.modules], "not_lifted": sorted(graph.not_lifted),
    }
    return hashlib.sha256(json.dumps(structure, sort_keys=True).encode()).hexdigest()[:16]
