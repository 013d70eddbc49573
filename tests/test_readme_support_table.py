"""The README's table of supported TorchRec modules and sharding types is the one the tests give."""

from pathlib import Path

from support_table import BEGIN, END, markdown


def test_readme_support_table():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    assert BEGIN in text and END in text, "README has no support table (python tests/support_table.py)"
    ours = text[text.index(BEGIN):text.index(END) + len(END)]
    assert ours == markdown(), "README's support table is stale: paste `python tests/support_table.py`"
