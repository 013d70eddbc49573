"""The systems the benchmark compares (``base``: all of them, split by family next)."""
