"""The step-time model's error table, kept on recorded runs (``tests/fixtures/step_model``, written
by ``benchmarks/step_model_error.py``: each a ``sparselift bench`` run of sparselift-identity
beside sparselift, with the model's inputs, the identity and plan graphs and what the run
measured). The predictions are made here, from the recorded inputs, by today's model."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_sparselift.bench.model_error import RecordedRun, error_rows, markdown, median_error

FIXTURES = Path(__file__).parents[1] / "fixtures" / "step_model"
# the median absolute error against the steady-state checks of the recorded runs, as measured when
# they were recorded (24%, 2026-12-07 on an AVX2 host, with the output layout decided on its copies'
# clock and so in every dlrm plan; the table: benchmarks/step_model_error.py --table
# tests/fixtures/step_model). Not the 15% the time-to-benefit issue asks: the checks themselves carry
# +-25-100% intervals (dlrm's plan measured -15.4 [-20.8, -11.7] ms; dlrm-multihot's, 1-3% of an 830 ms
# step, -26.2 [-59.4, +17.6], its worst row at 89%), and the sequence model's EmbeddingCollection
# lookups are predicted ~0.5x what they measure
MEDIAN_ERROR = 0.25
# the predictions inside the check's 95% interval, as recorded: all but sequence's second run (its
# EmbeddingCollection lookups, -4.42 predicted against [-17.50, -10.63])
INSIDE_THE_CHECK = 7


def _runs() -> list[RecordedRun]:
    return [RecordedRun.from_dict(json.loads(p.read_text())) for p in sorted(FIXTURES.glob("*.json"))]


def test_the_recorded_runs_cover_the_four_scenarios():
    assert sorted({r.scenario for r in _runs()}) == ["dlrm", "dlrm-multihot", "sequence", "sparse-heavy"]


def test_the_model_predicts_the_chosen_plans_step_change_from_the_recorded_inputs():
    rows = error_rows(_runs())
    print(markdown(rows))
    assert median_error(rows) <= MEDIAN_ERROR
    assert sum(bool(row.inside) for row in rows) >= INSIDE_THE_CHECK
    for row in rows:
        if not row.accepted:  # the identity plan: nothing changes
            assert row.predicted_ms == 0.0 and row.verified_ms is None
        else:  # every chosen plan is predicted faster, as it measured
            assert row.predicted_ms < 0 and row.verified_ms < 0
