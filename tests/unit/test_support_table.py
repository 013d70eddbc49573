"""The table of supported TorchRec modules and sharding types in docs/models.md is the one the tests give."""

from pathlib import Path

from support_table import BEGIN, END, markdown


def test_the_support_table_in_the_docs_is_current():
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    assert BEGIN in text and END in text, "docs/models.md has no support table (python tests/support_table.py)"
    ours = text[text.index(BEGIN):text.index(END) + len(END)]
    assert ours == markdown(), "docs/models.md's support table is stale: paste `python tests/support_table.py`"
