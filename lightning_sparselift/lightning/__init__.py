"""The Lightning glue: the strategy and what it delegates to (the lookahead loader, the launcher,
checkpoints and their JSON state, the SIGTERM handler, the per-step checks) and the callbacks."""
