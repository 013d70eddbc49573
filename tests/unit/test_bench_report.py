"""The bench's JSON: compact by default (raw observations condensed), whole with ``raw``."""

import json

from lightning_sparselift.bench.report import compact, write_json

PAIRS = "             increments T1-T0 (ms) rank 0: -1.00, -2.00; rank 1: -1.50, -2.50"
EXPLAIN = "\n".join(["ExecutionPlan (sparselift-plan/3) for graph g",
                     "  ACCEPT     latency_hiding:early_start@m: predicted -1.000 ms, measured -1.750 ms; faster",
                     PAIRS,
                     "calibration: 4 training steps, 0.40 s; planning 0.010 s"])


def _summary() -> dict:
    decision = {"candidate": "latency_hiding:early_start@m", "feasible": True, "accepted": True, "measured_ms": -1.75,
                "interval_ms": [-2.5, -1.0], "pairs": 2, "outliers": 0,
                "observations_ms": [[[10.0, 9.0], [10.0, 8.0]], [[10.0, 8.5], [10.0, 7.5]]]}
    sparselift = {"status": "ok", "step_ms": {"median": 9.0, "p25": 8.0, "p75": 10.0}, "round_median_ms": [9.0, 9.5],
                  "step_times_ms": [8.0, 9.0, 9.5, 10.0], "warmup_ms": [100.0, 200.0, 300.0],
                  "plan_decisions": [decision], "plan_explain": EXPLAIN,
                  "verification": {"pairs": 2, "measured_ms": -1.5, "observations_ms": [[9.0, 10.0], [8.5, 10.0]]}}
    failed = {"status": "failed", "error": "setup failed"}
    return {"schema": "sparselift-bench/1", "config": {"rounds": 2}, "ratios": {"a / b": {"median": 1.1}},
            "systems": {"sparselift": sparselift, "torchrec": failed}}


def test_compact_keeps_the_summary_and_drops_the_raw_observations():
    raw = _summary()
    out = compact(raw)
    sl = out["systems"]["sparselift"]
    assert "step_times_ms" not in sl and "warmup_ms" not in sl
    assert sl["warmup"] == {"steps": 3, "total_s": 0.6}
    assert "observations_ms" not in sl["plan_decisions"][0] and "observations_ms" not in sl["verification"]
    assert sl["plan_explain"] == EXPLAIN.replace(PAIRS + "\n", "")
    # every other number stays as it was
    assert sl["plan_decisions"][0] == {k: v for k, v in raw["systems"]["sparselift"]["plan_decisions"][0].items()
                                       if k != "observations_ms"}
    assert sl["round_median_ms"] == [9.0, 9.5] and sl["step_ms"] == raw["systems"]["sparselift"]["step_ms"]
    assert sl["verification"] == {"pairs": 2, "measured_ms": -1.5}
    assert {k: out[k] for k in ("schema", "config", "ratios")} == {k: raw[k] for k in ("schema", "config", "ratios")}
    assert out["systems"]["torchrec"] == raw["systems"]["torchrec"]
    assert raw == _summary()  # the summary itself is left whole
    assert compact(out) == out


def test_write_json_is_compact_unless_raw(tmp_path):
    write_json(_summary(), tmp_path / "compact.json")
    write_json(_summary(), tmp_path / "raw.json", raw=True)
    assert json.loads((tmp_path / "compact.json").read_text()) == compact(_summary())
    assert json.loads((tmp_path / "raw.json").read_text()) == _summary()


def test_a_parity_summary_is_written_as_it_is(tmp_path):
    parity = {"schema": "sparselift-parity/1", "loss_curves": {"torchrec": [0.7, 0.69]}, "identical": True}
    assert compact(parity) == parity
