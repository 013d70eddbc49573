"""``sparselift-lightning``: SparseLift through a real ``Trainer.fit``. The runner drives it (the
other systems' rounds run from a callback between its blocks); this is what it needs outside."""

from __future__ import annotations

import os

LIGHTNING_SYSTEM = "sparselift-lightning"


def lightning_env(rank: int, world_size: int) -> None:
    """Environment that makes Lightning treat the benchmark's processes as externally launched
    (TorchElastic-style), so ``Trainer.fit`` runs inside them without starting new ones."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_RUN_ID="sparselift-bench")
