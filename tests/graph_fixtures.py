"""The JSON graph fixtures of the process-free pass and planner tests, and the reasons the
passes give on them."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_sparselift.ir import SparseGraph

FIXTURES = Path(__file__).parent / "fixtures" / "graphs"
EBC = "model.sparse_arch.embedding_bag_collection"
USER, ITEM = "model.user_ebc", "model.item_ebc"

NOTHING_TO_MERGE = ("{} output all-to-all bucket(s): nothing to merge (row-wise reduce-scatters and data-parallel "
                    "groups have no all-to-all)")
COMPUTED_INPUT = ("the module's input was not among the root forward's arguments in the captured steps (the model "
                  "computes it), so it cannot start before the model reaches the module")
NOT_IN_BATCH = "the module's input was not found in the training step's batch on every rank (the model builds it)"


def load(name: str) -> SparseGraph:
    return SparseGraph.from_dict(json.loads((FIXTURES / f"{name}.json").read_text()))
