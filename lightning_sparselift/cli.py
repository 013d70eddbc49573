"""``sparselift``: the command line, built on LightningCLI.

    sparselift fit --config configs/dlrm_synthetic.yaml
    sparselift fit --config configs/sequence_synthetic.yaml
    sparselift validate --config configs/tiny.yaml --ckpt_path path/to/checkpoint.ckpt
    sparselift bench --scenario dlrm --world-size 2 --json out.json
    sparselift export path/to/checkpoint.ckpt model.pt
    sparselift plan explain PLAN.json
    sparselift plan diff A.json B.json
    sparselift simulate --config configs/dlrm_synthetic.yaml --ranks 8,64,512
"""

from __future__ import annotations

import sys
from typing import Optional

import lightning_sparselift  # noqa: F401  (registers the strategy names)
from lightning_sparselift.lightning.cli import SparseLiftCLI


def main(args: Optional[list[str]] = None) -> Optional[int]:
    """The ``sparselift`` command; returns the exit status of ``sparselift plan`` and ``sparselift
    export`` (the console script exits with it)."""
    argv = list(args if args is not None else sys.argv[1:])
    if argv[:1] == ["bench"]:
        from lightning_sparselift.bench.cli import main as bench

        return bench(argv[1:])
    if argv[:1] == ["export"]:
        from lightning_sparselift.checkpoint.export import main as export

        return export(argv[1:])
    if argv[:1] == ["simulate"]:
        from lightning_sparselift.simulate.cli import main as simulate

        return simulate(argv[1:])
    if argv[:1] == ["plan"]:
        from lightning_sparselift.plan.cli import main as plan

        return plan(argv[1:])
    # From the command line (args None) LightningCLI reads sys.argv itself: handing it sys.argv[1:]
    # as ``args`` too makes it warn that both were given.
    SparseLiftCLI(args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    sys.exit(main())
