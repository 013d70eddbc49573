"""The example scripts run as a user would run them (default launcher: one process per rank)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FULL, assert_calibration_finished

ROOT = Path(__file__).resolve().parents[2]


def test_train_dlrm_example(tmp_path, data_cache):
    out = subprocess.run([sys.executable, str(ROOT / "examples/train_dlrm.py"), "--devices", "2", "--steps", "12",
                          "--batch-size", "256", "--row-wise", "t_cat_2", "--ckpt-dir", str(tmp_path / "ckpt")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "SPARSELIFT_CACHE": str(data_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "throughput:" in out.stderr + out.stdout
    assert (tmp_path / "ckpt" / "sparselift.meta.json").exists()


@pytest.mark.parametrize("steps", [pytest.param(FULL, marks=pytest.mark.slow, id="full"),
                                   pytest.param(120, id="short")])
def test_own_model_example(steps, tmp_path):
    # a user's own LightningModule, EBC, dataset and collate (no lightning_sparselift model or data),
    # Trainer(strategy="sparselift") with default options on 2 processes; at full length its default
    # calibration finishes (the step count that takes: ranks/test_user_models.py)
    out = subprocess.run([sys.executable, str(ROOT / "examples/own_model.py"), "--result-dir", str(tmp_path / "res"),
                          "--steps", str(steps)], cwd=tmp_path, capture_output=True, text=True, timeout=1800,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"executor: sparselift on 2 process(es), {steps} steps" in out.stdout, \
        out.stdout[-3000:] + out.stderr[-3000:]
    results = [json.loads((tmp_path / "res" / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["executor"] == "sparselift" and result["steps"] == steps and result["world_size"] == 2
        assert any(d["feasible"] for d in result["decisions"])
        if steps == FULL:
            assert_calibration_finished(result["decisions"])
    if steps == FULL:
        assert "latency_hiding:early_start@embeddings" in out.stdout  # the plan explained
    assert results[0]["decisions"] == results[1]["decisions"]
    assert results[0]["dense_checksum"] == results[1]["dense_checksum"]  # data-parallel dense part
