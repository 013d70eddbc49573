"""Sharded checkpoints, saved atomically and read without running code: the checkpoint's I/O,
apart from the strategy (as Lightning's ``CheckpointIO`` plugins are).

A checkpoint is a folder (``layout.py`` names its files). ``io.py`` saves and loads it, the steps
``SparseLiftStrategy`` calls; ``folder.py`` commits it (atomic rename, checksums) and refuses torn
or corrupt ones; ``rank_state.py`` holds what each rank adds to DCP's shards (generators,
optimizer hyper-parameters, iteration counters); ``compatibility.py`` decides whether it loads
into this model and plan; ``state_json.py`` stores Lightning's state as JSON; ``safe_load.py``
reads the pickles in it (ours and DCP's) as plain data only; ``export.py`` gives its model to
one process without the strategy.
"""

from lightning_sparselift.checkpoint.folder import CheckpointError

__all__ = ["CheckpointError"]
