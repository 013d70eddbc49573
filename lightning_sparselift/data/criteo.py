"""Criteo's files: the datasets' shape (Kaggle cardinalities, DLRMv2 pooling factors), the npy
triple ``torchrec.datasets.criteo`` writes (:func:`read_criteo_npy`), and raw Criteo TSV files
(Kaggle ``train.txt``, Terabyte ``day_N``) converted once, with TorchRec's own
``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys``, into that npy triple, cached by the
file's path, size and modification time.

A line is ``label \\t 13 integers \\t 26 categorical hex ids`` (40 tab-separated fields, any
field may be empty). What the conversion does is TorchRec's, unchanged:

- an empty integer or categorical field becomes 0 (so a missing id is id 0, the same row as
  ``00000000``); an empty label becomes 0;
- categorical ids are the hex values as int64 (``int(field, 16)``), not hashed yet: the reader
  takes them modulo the table sizes, as TorchRec's ``InMemoryBinaryCriteoIterDataPipe(hashes=...)``
  does;
- dense features become ``log(x - m + 2)`` (float32), where ``m`` is the smallest integer in the
  *whole file* (all 13 columns, missing values counted as 0). Not ``log(x + 1)``, and the shift
  is per file: two day files with different minima are shifted differently.

Before converting, the file is checked with numpy (fast, byte-level): every line has exactly 40
fields and only hex digits, ``-`` and tabs (CRLF line ends are accepted). Anything TorchRec's
parser then rejects (e.g. ``1.5`` or a hex digit in an integer column, an integer beyond int32)
is located and reported by file, line and column; so are labels other than 0/1 and dense values
that TorchRec's shift overflows. A file that fails is never marked as converted.

``python -m lightning_sparselift.data FILE... [--cache-dir DIR]`` converts ahead of training.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from lightning_sparselift.data.batch import OneHotRecArrays

# Criteo Kaggle (Display Advertising Challenge) cardinalities of the 26 categorical features.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
# Per-feature pooling factors of MLPerf DLRMv2 (multi-hot Criteo 1TB).
DLRMV2_POOLING_FACTORS: tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)
NUM_DENSE = 13
FEATURE_NAMES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(len(CRITEO_KAGGLE_CARDINALITIES)))

# The TSV layout: a label, the integer columns (the dense features), the categorical ones.
NUM_INT = NUM_DENSE
NUM_CAT = 26
NUM_COLUMNS = 1 + NUM_INT + NUM_CAT
_CACHE_FORMAT = 1
_CHUNK = 1 << 22  # bytes per numpy scan chunk
_ALLOWED = np.zeros(256, dtype=bool)
_ALLOWED[np.frombuffer(b"0123456789abcdefABCDEF-\t\n\r", dtype=np.uint8)] = True


class CriteoFormatError(ValueError):
    """A Criteo TSV file that is not in the expected format; names the file and the line."""

    def __init__(self, path: str | Path, line: Optional[int], message: str):
        self.path, self.line, self.message = str(path), line, message
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # picklable (e.g. from a rank process to the launcher)
        return type(self), (self.path, self.line, self.message)


def _column_name(index: int) -> str:
    if index == 0:
        return "column 1 (label)"
    if index <= NUM_INT:
        return f"column {index + 1} (integer feature {index - 1})"
    return f"column {index + 1} (categorical feature {index - 1 - NUM_INT})"


def scan_tsv(path: str | Path) -> int:
    """Check the layout of a Criteo TSV file with numpy and return its number of rows.

    Raises :class:`CriteoFormatError` (file:line) for a line without exactly 40 tab-separated
    fields (blank lines included), a character other than hex digits, ``-``, tab and line ends,
    or a carriage return not followed by a newline.
    """
    path = Path(path)
    line = 1  # line number of the current chunk's first byte
    tabs_carry = 0  # tabs of the line that continues into the current chunk
    pending = 0  # bytes of that line
    cr_before = False  # the previous chunk ended with '\r'
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            b = np.frombuffer(chunk, dtype=np.uint8)
            newline = b == 10
            prev_cr = cr_before
            if cr_before and not newline[0]:
                raise CriteoFormatError(path, line, "carriage return not followed by a newline")
            bad = ~_ALLOWED[b]
            if bad.any():
                pos = int(np.argmax(bad))
                at = line + int(np.count_nonzero(newline[:pos]))
                raise CriteoFormatError(path, at, f"unexpected character {chunk[pos:pos + 1]!r} "
                                                  "(Criteo fields are decimal integers and hex ids)")
            cr = np.flatnonzero(b[:-1] == 13)
            lone = cr[b[cr + 1] != 10]
            if lone.size:
                at = line + int(np.count_nonzero(newline[: lone[0]]))
                raise CriteoFormatError(path, at, "carriage return not followed by a newline")
            cr_before = bool(b[-1] == 13)
            ends = np.flatnonzero(newline)
            tab_at = np.flatnonzero(b == 9)
            if ends.size:
                before = np.searchsorted(tab_at, ends)  # tabs in the chunk before each newline
                per_line = np.diff(before, prepend=0)
                per_line[0] += tabs_carry
                wrong = np.flatnonzero(per_line != NUM_COLUMNS - 1)
                if wrong.size:
                    i = int(wrong[0])
                    end = int(ends[i])
                    start = 0 if i == 0 else int(ends[i - 1]) + 1
                    crlf = bool(b[end - 1] == 13) if end > 0 else prev_cr
                    length = end - start + (pending if i == 0 else 0) - int(crlf)
                    _raise_columns(path, line + i, int(per_line[i]) + 1, empty=length == 0)
                tabs_carry = int(tab_at.size - before[-1])
                pending = b.size - 1 - int(ends[-1])
                line += ends.size
            else:
                tabs_carry += int(tab_at.size)
                pending += b.size
    if cr_before:
        raise CriteoFormatError(path, line, "carriage return not followed by a newline")
    if pending:  # a last line without a final newline
        if tabs_carry != NUM_COLUMNS - 1:
            _raise_columns(path, line, tabs_carry + 1)
        return line
    if line == 1:
        raise CriteoFormatError(path, None, "the file is empty (no Criteo rows)")
    return line - 1


def _raise_columns(path: Path, line: int, columns: int, empty: bool = False) -> None:
    if empty:
        raise CriteoFormatError(path, line, "empty line (expected 40 tab-separated fields)")
    hint = ""
    if columns == NUM_COLUMNS - 1 and line == 1:
        hint = " (an unlabeled file such as Kaggle's test.txt cannot be trained on)"
    raise CriteoFormatError(path, line, f"{columns} tab-separated fields, expected {NUM_COLUMNS} "
                                        f"(label, {NUM_INT} integer, {NUM_CAT} categorical){hint}")


def _locate_parse_error(path: Path) -> Optional[CriteoFormatError]:
    """Find the first field TorchRec's row mapper cannot take (run only after it failed):
    ``int(field or "0")`` for the label and integer columns (int32, as TorchRec stores them),
    ``int(field or "0", 16)`` for the categorical ones."""
    with open(path, "r", newline=None) as f:
        for number, text in enumerate(f, start=1):
            fields = text.rstrip("\n").split("\t")
            for index, field in enumerate(fields):
                try:
                    value = int(field or "0", 16 if index > NUM_INT else 10)
                except ValueError:
                    kind = "a hex id" if index > NUM_INT else "a decimal integer"
                    return CriteoFormatError(path, number, f"{_column_name(index)} is {field!r}, not {kind}")
                if 0 < index <= NUM_INT and not -2**31 <= value < 2**31:
                    return CriteoFormatError(path, number, f"{_column_name(index)} is {value}, "
                                                           "outside int32 (TorchRec stores integer features as int32)")
    return None


@dataclass(frozen=True)
class ConvertedTsv:
    """A converted file: ``prefix + "_dense.npy"`` / ``"_sparse.npy"`` / ``"_labels.npy"``."""

    source: Path
    prefix: Path
    rows: int
    converted: bool  # False when the cache already held it


def cache_key(path: str | Path) -> str:
    """The cache key of a TSV file: its resolved path, size and modification time (ns), the
    torchrec version (its conversion defines the arrays) and this cache's format version."""
    import torchrec

    path = Path(path)
    st = path.stat()
    blob = json.dumps({"v": _CACHE_FORMAT, "path": os.path.realpath(path), "size": st.st_size,
                       "mtime_ns": st.st_mtime_ns, "torchrec": getattr(torchrec, "__version__", "?")},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cached_prefix(path: str | Path, cache_dir: str | Path) -> Path:
    """Where ``path``'s npy triple lives (or will) under ``cache_dir``."""
    path = Path(path)
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", path.name)[:64] or "criteo"
    return Path(cache_dir) / "criteo_tsv" / f"{stem}-{cache_key(path)}" / "criteo"


def convert_tsv(path: str | Path, cache_dir: str | Path) -> ConvertedTsv:
    """Convert one Criteo TSV file into TorchRec's npy triple under ``cache_dir/criteo_tsv/``
    unless the cache holds it already (same resolved path, size and mtime).

    The conversion is ``BinaryCriteoUtils.tsv_to_npys(..., dataset_name="criteo_1tb")`` (the
    labeled layout; TorchRec's ``"criteo_kaggle"`` mode drops the label column whenever the path
    contains ``test`` anywhere). Files are written under temporary names and renamed; the
    ``source.json`` record is written last and marks the folder complete, so concurrent or
    interrupted conversions never leave a folder that is taken as done.
    """
    from torchrec.datasets.criteo import BinaryCriteoUtils

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Criteo TSV file not found: {path}")
    prefix = cached_prefix(path, cache_dir)
    folder = prefix.parent
    done = folder / "source.json"
    if done.exists():
        return ConvertedTsv(path, prefix, int(json.loads(done.read_text())["rows"]), converted=False)
    rows = scan_tsv(path)
    folder.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}"
    tmp = {k: folder / f".{prefix.name}_{k}.{tag}.npy" for k in ("dense", "sparse", "labels")}
    try:
        try:
            with warnings.catch_warnings():  # its row mapper is a local function; datapipes warn about pickling
                warnings.filterwarnings("ignore", message="Local function is not supported by pickle")
                BinaryCriteoUtils.tsv_to_npys(str(path), str(tmp["dense"]), str(tmp["sparse"]), str(tmp["labels"]),
                                              dataset_name="criteo_1tb")
        except Exception as exc:
            located = _locate_parse_error(path)
            if located is not None:
                raise located from exc
            raise CriteoFormatError(path, None, f"TorchRec's tsv_to_npys failed: {exc!r}") from exc
        _check_converted(path, tmp, rows)
        for k, p in tmp.items():
            os.replace(p, folder / f"{prefix.name}_{k}.npy")
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    record = {"source": os.path.realpath(path), "rows": rows, "key": folder.name,
              "converter": "torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys"}
    tmp_done = folder / f".source.{tag}.json"
    tmp_done.write_text(json.dumps(record, indent=1))
    os.replace(tmp_done, done)
    return ConvertedTsv(path, prefix, rows, converted=True)


def _check_converted(path: Path, files: dict[str, Path], rows: int) -> None:
    """Labels must be 0/1 and dense features finite after TorchRec's ``log(x - min + 2)``."""
    labels = np.load(files["labels"], mmap_mode="r")
    dense = np.load(files["dense"], mmap_mode="r")
    if labels.shape[0] != rows or dense.shape != (rows, NUM_INT):
        raise CriteoFormatError(path, None, f"TorchRec's conversion gave {labels.shape[0]} labels and dense "
                                            f"{dense.shape} for {rows} lines")
    bad = np.flatnonzero((labels[:, 0] != 0) & (labels[:, 0] != 1))
    if bad.size:
        raise CriteoFormatError(path, int(bad[0]) + 1, f"label {int(labels[bad[0], 0])}, expected 0 or 1")
    finite = np.isfinite(dense).all(axis=1)
    if not finite.all():
        row = int(np.argmin(finite))
        raise CriteoFormatError(path, row + 1, "an integer feature overflows TorchRec's int32 shift "
                                               "x - min(file) + 2 (the file's integer range is too wide)")


def convert_tsv_files(paths: Sequence[str | Path], cache_dir: str | Path) -> list[ConvertedTsv]:
    """:func:`convert_tsv` for each file (missing files are reported before any conversion)."""
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"Criteo TSV files not found: {missing}")
    return [convert_tsv(p, cache_dir) for p in paths]


def split_rows(rows: int, held_out_fraction: float = 1 / 7) -> tuple[int, int]:
    """For a single file: ``(train_end, val_end)``, the last ``held_out_fraction`` of the rows
    held out and split in halves (val first, rounded up), as the DLRM reference splits Kaggle's
    seven days."""
    held = max(2, int(round(rows * held_out_fraction))) if rows >= 3 else 0
    train_end = rows - held
    return train_end, train_end + math.ceil(held / 2)


def table_sizes(cardinalities: Sequence[int], max_rows: Optional[int]) -> list[int]:
    """Rows per table: the raw cardinality, capped at ``max_rows`` (ids are taken modulo it)."""
    return [int(c) if max_rows is None else int(min(c, max_rows)) for c in cardinalities]


def read_criteo_npy(prefix: str | Path, num_embeddings_per_feature: Sequence[int],
                    feature_names: Sequence[str] = FEATURE_NAMES,
                    rows: Optional[tuple[int, int]] = None) -> OneHotRecArrays:
    """Read the ``<prefix>_dense.npy`` / ``_sparse.npy`` / ``_labels.npy`` triple that
    ``torchrec.datasets.criteo.BinaryCriteoUtils`` writes (dense already log-transformed,
    one id per feature), memory-mapped. Ids are taken modulo the table sizes, as TorchRec's
    reader does. ``rows=(start, end)`` reads only those rows (TorchRec's ``load_npy_range``)."""
    prefix = str(prefix)
    paths = {k: Path(f"{prefix}_{k}.npy") for k in ("dense", "sparse", "labels")}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(f"Criteo npy files not found: {missing}")
    if len(num_embeddings_per_feature) != len(feature_names):
        raise ValueError(f"{len(num_embeddings_per_feature)} table sizes for {len(feature_names)} features")
    if rows is None:
        arrays = {k: np.load(p, mmap_mode="r") for k, p in paths.items()}
    else:
        from torchrec.datasets.criteo import BinaryCriteoUtils

        start, end = rows
        arrays = {k: BinaryCriteoUtils.load_npy_range(str(p), start, end - start, mmap_mode=True)
                  for k, p in paths.items()}
    return OneHotRecArrays(arrays["dense"], arrays["sparse"], arrays["labels"], feature_names,
                           id_modulus=num_embeddings_per_feature)

