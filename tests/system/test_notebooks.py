"""The notebooks run top to bottom."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
# what each notebook prints once it ran to its end (its own asserts check the rest)
LAST_WORDS = {
    "01_quickstart.ipynb": "val/auc",
    "02_inside_the_compiler.ipynb": "parity: identical",
    "03_reading_a_bench_result.ipynb": "read: sparselift-bench/1 result",
}


# the full-length tier: the compiler walkthrough (an epoch of calibration) and the bench reader (a
# bench run of its own); `make test` runs the quickstart
SLOW = ("02_inside_the_compiler.ipynb", "03_reading_a_bench_result.ipynb")


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name, marks=pytest.mark.slow if p.name in SLOW else ())
                                  for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, data_cache, monkeypatch):
    monkeypatch.setenv("SPARSELIFT_CACHE", str(data_cache))
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert path.name in LAST_WORDS, f"add what {path.name} prints at its end to LAST_WORDS"
    assert LAST_WORDS[path.name] in outputs
