"""The quality bound of a parity run (``bench/parity.py``), fixed before measuring: over seeds,
|mean delta AUC| <= 0.001 and mean relative delta logloss <= 0.2% against TorchRec's path; a
setting past either fails, and only systems a parity run trains compare, TorchRec's path first."""

from __future__ import annotations

import pytest

from lightning_sparselift.bench.parity import bound, bound_table, check_systems


def _summary(seed: int, **deltas: tuple[float, float]) -> dict:
    return {"scenario": "dlrm", "seed": seed,
            "against_reference": {name: {"delta_auc": auc, "relative_delta_logloss": logloss, "loss_mae": 1e-5,
                                         "loss_rmse": 2e-5, "identical": False}
                                  for name, (auc, logloss) in deltas.items()}}


def test_the_mean_over_seeds_meets_the_bound_or_fails_it():
    runs = [_summary(1, fast=(0.0012, 0.001), worse=(-0.0015, 0.001), lossy=(0.0, 0.0030)),
            _summary(2, fast=(-0.0006, 0.003), worse=(-0.0009, 0.001), lossy=(0.0, 0.0011))]
    verdict = bound(runs)
    # one seed past the AUC bound, the mean within: within; the mean past either: not
    assert verdict["fast"]["within"] and verdict["fast"]["mean_delta_auc"] == pytest.approx(0.0003)
    assert not verdict["worse"]["within"] and verdict["worse"]["mean_delta_auc"] == pytest.approx(-0.0012)
    assert not verdict["lossy"]["within"] and verdict["lossy"]["mean_relative_delta_logloss"] == pytest.approx(0.00205)
    table = bound_table(runs)
    assert "| dlrm | fast | 1,2 |" in table and table.count("**no**") == 2


@pytest.mark.parametrize("systems, message", [(["sparselift", "torchrec"], "compares with 'torchrec', its first"),
                                              (["torchrec", "dense-only"], "do not run in a parity run")])
def test_a_parity_run_compares_parity_systems_with_torchrec(systems, message):
    with pytest.raises(ValueError, match=message):
        check_systems(systems)
