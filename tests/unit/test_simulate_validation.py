"""The simulator's error tables on this machine, kept on recorded measurements (the tables:
``benchmarks/simulate_validation.py``, results/2026-12-05/simulate/validation.md) and the shipped
profile of this machine. The dense step is timed here when the test runs, so the bounds are loose:
on the recorded bench runs the median error measured 17-34% over three invocations (the same
setup's recorded runs are themselves 46-57% apart: dlrm 139 vs 89 ms, sparse-heavy 193 vs 282; the
machine is shared); on the measured grid 24-28%, its worst the small steps of tiny and sequence
(50-75%: per-step costs the model does not price, see docs/simulate.md)."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_sparselift.bench.model_error import RecordedRun
from lightning_sparselift.simulate.profile import HardwareProfile
from lightning_sparselift.simulate.validation import markdown, median_error, validate

FIXTURES = Path(__file__).parents[1] / "fixtures" / "step_model"
MEDIAN_ERROR = 0.45


def test_the_simulated_steps_of_the_recorded_runs():
    runs = [(p.name, RecordedRun.from_dict(json.loads(p.read_text()))) for p in sorted(FIXTURES.glob("*.json"))]
    profile = HardwareProfile.load("cpu-2core-measured")
    rows = validate(runs, profile)
    assert len(rows) == len(runs) and sum(r.fitted_on for r in rows) == 1
    assert all(r.predicted_plan_ms <= r.predicted_identity_ms for r in rows)
    text = markdown(rows, profile)
    assert median_error(rows) <= MEDIAN_ERROR, text


GRID = Path(__file__).parents[1] / "fixtures" / "simulate" / "grid.json"
GRID_MEDIAN_ERROR = 0.4


def test_the_simulated_identity_step_on_the_measured_grid():
    """TorchRec's step measured per scenario, world size (1, 2: the bench refuses 3 ranks on 2 cores)
    and batch (``benchmarks/simulate_validation.py --measure``), beside the simulator's identity plan."""
    from lightning_sparselift.simulate.validation import GridPoint, grid_markdown, predict_grid

    points = [GridPoint(**{**x, "predicted_ms": None}) for x in json.loads(GRID.read_text())]
    assert {p.world for p in points} == {1, 2} and len({p.scenario for p in points}) == 5
    profile = HardwareProfile.load("cpu-2core-measured")
    points = predict_grid(points, profile)
    errors = sorted(p.error for p in points)
    assert errors[len(errors) // 2] <= GRID_MEDIAN_ERROR, grid_markdown(points, profile)
