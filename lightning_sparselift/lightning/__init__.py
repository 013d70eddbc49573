"""The Lightning glue: the strategy and what it delegates to (the lookahead loader, the launcher,
the SIGTERM handler, the per-step checks) and the callbacks. Checkpoints are
:mod:`lightning_sparselift.checkpoint`."""
