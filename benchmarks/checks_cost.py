"""What the per-step safety checks cost in Trainer.fit: the sparse inputs compared across ranks
(``validate_inputs``) and the non-finite check of the batch and loss (``non_finite``).

Trains the dlrm benchmark shape (2 CPU ranks, batch 1024 per rank, fork launcher, the plan
applied without calibration) three ways, interleaved round by round (order reversed every other
round): all checks, without the non-finite check (switched off by patching it out: it has no
option to disable it), without any check. Prints each fit's median steady-state step time and,
per variant, the median over rounds of its per-round ratio to "all checks".

    .venv/bin/python benchmarks/checks_cost.py --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as L

from lightning_sparselift import CriteoDataModule, DLRMModule, SparseLiftStrategy
from lightning_sparselift.lightning import step_check

VARIANTS = {"all checks": (True, True), "no non-finite check": (True, False), "no checks": (False, False)}


class StepTimes(L.Callback):
    """Rank 0 writes the median step time (ms) after ``skip`` steps to ``out``."""

    def __init__(self, steps: int, skip: int, out: Path) -> None:
        self.steps, self.skip, self.out, self.ends = steps, skip, out, []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.ends.append(time.perf_counter())
        if len(self.ends) == self.steps and trainer.global_rank == 0:
            gaps = [b - a for a, b in zip(self.ends[self.skip:], self.ends[self.skip + 1:])]
            self.out.write_text(json.dumps(statistics.median(gaps) * 1e3))


def fit(dm: CriteoDataModule, validate: bool, non_finite_check: bool, steps: int, skip: int, out: Path) -> float:
    checks = step_check.StepCheck
    inspect, verdict, before_update = checks.inspect, checks.verdict, checks.before_update
    if not non_finite_check:
        checks.inspect = lambda self, batch: None
        checks.verdict = lambda self, output, *args: output
        checks.before_update = lambda self: None
    try:
        L.seed_everything(0)
        model = DLRMModule(dm.table_sizes, embedding_dim=64, dense_arch_layer_sizes=[512, 256, 64],
                           over_arch_layer_sizes=[512, 256, 1], interaction="dot", dense_optimizer="adagrad",
                           dense_lr=0.02)
        strategy = SparseLiftStrategy(start_method="fork", calibrate=False, validate_inputs=validate,
                                      embedding_optimizer={"name": "rowwise_adagrad", "lr": 0.05})
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, callbacks=[StepTimes(steps, skip, out)])
        trainer.fit(model, dm)
    finally:
        checks.inspect, checks.verdict, checks.before_update = inspect, verdict, before_update
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--skip", type=int, default=30, help="steps left out (capture, warmup)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dm = CriteoDataModule(batch_size=1024, num_train=2 * 1024 * (args.steps + 2), num_val=2048, num_test=2048,
                              max_rows=100000, zipf_exponent=1.05, cache_dir=tmp)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for r in range(args.rounds):
            order = list(VARIANTS.items()) if r % 2 == 0 else list(reversed(VARIANTS.items()))
            for name, (validate, non_finite_check) in order:
                times[name].append(fit(dm, validate, non_finite_check, args.steps, args.skip, Path(tmp) / "ms"))
                print(f"round {r}: {name}: {times[name][-1]:.2f} ms", flush=True)
    for name, ms in times.items():
        ratios = [t / base for t, base in zip(ms, times["all checks"])]
        print(f"{name:20s} median step {statistics.median(ms):7.2f} ms; per-round ratio to all checks: median "
              f"{statistics.median(ratios):.3f} [min {min(ratios):.3f}, max {max(ratios):.3f}]")


if __name__ == "__main__":
    main()
