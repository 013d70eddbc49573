"""The example scripts run as a user would run them (default launcher: one process per rank)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_dlrm_example(tmp_path, data_cache):
    out = subprocess.run([sys.executable, str(ROOT / "examples/train_dlrm.py"), "--devices", "2", "--steps", "12",
                          "--batch-size", "256", "--row-wise", "t_cat_2", "--ckpt-dir", str(tmp_path / "ckpt")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "SPARSELIFT_CACHE": str(data_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "throughput:" in out.stderr + out.stdout
    assert (tmp_path / "ckpt" / "sparselift.meta.json").exists()
