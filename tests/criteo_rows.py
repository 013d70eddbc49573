"""Rows of raw Criteo TSV files for the tests (tests/unit/test_criteo_files.py converts and reads
them, tests/ranks/test_criteo_fit.py trains on them)."""

import numpy as np

# small tables, so the modulo folds ids; one of them 1 row (every id -> 0)
SIZES = [7, 13, 1000, 1, 97, 24, 50, 3, 3, 101, 60, 5000, 31, 27, 150, 400, 10, 56, 21, 4, 700, 18, 15, 286, 105, 142]


def make_rows(n, seed, missing=0.15):
    """Rows in Criteo's layout: label, 13 integers (I2 may be negative, down to -3), 26 8-hex-digit
    ids; None marks a missing (empty) field."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = int(rng.random() < 0.3)
        ints = [int(rng.integers(-3, 50)) if j == 1 else int(rng.geometric(0.02)) - 1 for j in range(13)]
        cats = [f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)]
        ints = [None if rng.random() < missing else v for v in ints]
        cats = [None if rng.random() < missing else v for v in cats]
        rows.append((label, ints, cats))
    rows[0][1][1] = -3  # the file's minimum integer: TorchRec shifts by it
    return rows


def write_tsv(path, rows, newline="\n", final_newline=True):
    lines = ["\t".join([str(label)] + ["" if v is None else str(v) for v in ints]
                       + ["" if c is None else c for c in cats]) for label, ints, cats in rows]
    path.write_bytes((newline.join(lines) + (newline if final_newline else "")).encode())
    return path
