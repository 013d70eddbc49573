"""The compiler session is re-enterable: a planning round asked for after the first plan was
installed calibrates again, on the following training steps, and installs its own plan."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch

from helpers import LIFTED, ONE_LOOK, tiny_data, tiny_model, trainer
from lightning_sparselift import SparseLiftStrategy


class PlanAgain(L.Callback):
    """Asks for a second planning round right after the first plan is installed; saves, per rank,
    every plan installed (the step after which it was) and the metrics at the end."""

    def __init__(self, folder):
        self.folder = folder
        self.plans: list[tuple[int, object]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plan = trainer.strategy.execution_plan
        if plan is not None and (not self.plans or self.plans[-1][1] is not plan):
            self.plans.append((batch_idx, plan))
            if len(self.plans) == 1:
                trainer.strategy.session.plan_again("the test asks for it")
                with pytest.raises(RuntimeError, match="still in its plan phase"):
                    trainer.strategy.session.plan_again("twice")

    def on_train_end(self, trainer, pl_module):
        torch.save({"plans": [(step, plan.calibration_steps, len(plan.decisions)) for step, plan in self.plans],
                    "executor": trainer.strategy.executor_in_use,
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}},
                   self.folder / f"rank{trainer.global_rank}.pt")


def test_planning_again_calibrates_and_installs_a_new_plan(tmp_path, data_cache):
    dm = tiny_data(data_cache, num_train=1920)  # 30 steps: 3 captured, 12 calibrating, 12 calibrating again, 3
    L.seed_everything(0)
    # every candidate decided at one look, no steady-state check
    strategy = SparseLiftStrategy(start_method="fork", optimizations=["aggregation"], verify_steps=0, **ONE_LOOK)
    t = trainer(2, strategy, callbacks=[PlanAgain(tmp_path)], limit_val_batches=0)
    t.fit(tiny_model(dm), dm)
    for rank in range(2):
        info = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert info["executor"] in LIFTED
        # aggregation: one feasible candidate (1 + 5 pairs), one infeasible; the second round proposes
        # from the identity graph again
        assert info["plans"] == [(14, 12, 2), (26, 12, 2)]
        assert info["metrics"]["sparselift/calibration_steps"] == 12 and info["metrics"]["sparselift/plan_reused"] == 0
