"""Sharded checkpoints, saved atomically and read without running code (see ``io.py``)."""

from lightning_sparselift.checkpoint.io import CheckpointError

__all__ = ["CheckpointError"]
