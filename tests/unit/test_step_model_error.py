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
# they were recorded (34%, 2026-12-07 on an AVX2 host, with TorchRec's input kernels timed by the
# input probe; the table: benchmarks/step_model_error.py --table tests/fixtures/step_model). Not the
# 15% the time-to-benefit issue asks: the checks themselves carry +-30-50% intervals (dlrm's plan
# measured -9.0 [-13.6, -6.1] and -8.7 [-11.3, -6.3] ms), dlrm's early start is predicted 1.3x what
# it measures, and the sequence model's EmbeddingCollection lookups 0.5x
MEDIAN_ERROR = 0.35


def _runs() -> list[RecordedRun]:
    return [RecordedRun.from_dict(json.loads(p.read_text())) for p in sorted(FIXTURES.glob("*.json"))]


def test_the_recorded_runs_cover_the_four_scenarios():
    assert sorted({r.scenario for r in _runs()}) == ["dlrm", "dlrm-multihot", "sequence", "sparse-heavy"]


def test_the_model_predicts_the_chosen_plans_step_change_from_the_recorded_inputs():
    rows = error_rows(_runs())
    print(markdown(rows))
    assert median_error(rows) <= MEDIAN_ERROR
    for row in rows:
        if not row.accepted:  # the identity plan: nothing changes
            assert row.predicted_ms == 0.0 and row.verified_ms is None
        else:  # every chosen plan is predicted faster, as it measured
            assert row.predicted_ms < 0 and row.verified_ms < 0
