"""``python -m lightning_sparselift.data FILE... [--cache-dir DIR]``: converts raw Criteo TSV
files into the npy cache :class:`~lightning_sparselift.data.CriteoDataModule` reads, ahead of
training (:mod:`lightning_sparselift.data.criteo`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from lightning_sparselift.data.criteo import CriteoFormatError, convert_tsv_files


def main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lightning_sparselift.data",
                                     description="Convert Criteo TSV files into the npy cache CriteoDataModule reads.")
    parser.add_argument("files", nargs="+")
    parser.add_argument("--cache-dir", default=None,
                        help="default: $SPARSELIFT_CACHE or ~/.cache/lightning_sparselift (as CriteoDataModule)")
    args = parser.parse_args(argv)
    cache = args.cache_dir or os.environ.get("SPARSELIFT_CACHE") or Path.home() / ".cache" / "lightning_sparselift"
    try:
        results = convert_tsv_files(args.files, cache)
    except (FileNotFoundError, CriteoFormatError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    for result in results:
        state = "converted" if result.converted else "cached"
        print(f"{result.source}: {result.rows} rows, {state} -> {result.prefix}_{{dense,sparse,labels}}.npy")


if __name__ == "__main__":
    main()
