"""``make bench`` writes its tables into docs/performance.md between the markers: the
text around them stays as it was, the markers stay, every table keeps its shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import common, docs

ROOT = Path(__file__).resolve().parents[2]
RUN = docs.Run("abc1234", "2026-12-06", 2, "0.5, 0.4, 0.3")
TABLES = [
    ("(b) overhead vs a minimal loop", [("daemon", "5,676 msg/s"), ("baseline", "3,466 msg/s")]),
    ("odd | title", [("a|b", "line one\nline two"), ("machine", "2 CPUs, load now 1.0")]),
]
DOC = f"# Performance\n\ncurated | table\n\n{docs.BEGIN}\nold figures\n{docs.END}\n\nafter\n"


def table_rows(section: str) -> list[list[str]]:
    """Each table line's cells (escaped pipes kept inside their cell)."""
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            cells = line.replace("\\|", "\0").strip("|").split("|")
            rows.append([c.strip().replace("\0", "|") for c in cells])
    return rows


def test_the_section_is_replaced_and_the_rest_kept() -> None:
    once = docs.replace_section(DOC, docs.render(RUN, TABLES))
    twice = docs.replace_section(once, docs.render(RUN, TABLES[:1]))
    for text in (once, twice):
        assert text.count(docs.BEGIN) == text.count(docs.END) == 1
        assert text.startswith("# Performance\n\ncurated | table\n\n" + docs.BEGIN + "\n")
        assert text.endswith(docs.END + "\n\nafter\n")
        assert "old figures" not in text
    assert "odd" not in twice  # the second run's tables only, not appended


def test_every_table_has_its_header_and_two_cells_a_row() -> None:
    section = docs.render(RUN, TABLES)
    assert "`abc1234`" in section and "load average 0.5, 0.4, 0.3" in section
    assert section.count("### ") == len(TABLES)
    assert "### odd \\| title" in section
    rows = table_rows(section)
    assert rows.count(["figure", "value"]) == len(TABLES)
    assert rows.count(["---", "---"]) == len(TABLES)
    assert all(len(row) == 2 for row in rows), rows
    assert ["a|b", "line one line two"] in rows  # a pipe or newline cannot break a row


@pytest.mark.parametrize(
    "document",
    ["no markers\n", f"{docs.BEGIN}\n{docs.BEGIN}\n{docs.END}\n", f"{docs.END}\nx\n{docs.BEGIN}\n"],
    ids=["none", "two-begins", "reversed"],
)
def test_a_document_without_one_ordered_pair_of_markers_is_refused(document: str) -> None:
    with pytest.raises(ValueError, match="marker"):
        docs.replace_section(document, "x")


def test_docs_performance_has_the_markers_and_the_tables_of_a_run(tmp_path: Path) -> None:
    """The real page takes a run: what `make bench` writes lands between its markers."""
    page = tmp_path / "performance.md"
    original = (ROOT / "docs/performance.md").read_text()
    page.write_text(original)
    common.TABLES.clear()
    common.table("(x) a benchmark", [("figure", "1.0")])
    try:
        docs.write(page, RUN, common.TABLES)
    finally:
        common.TABLES.clear()
    written = page.read_text()
    head = original.split(docs.BEGIN)[0]
    assert written.startswith(head)  # the curated tables untouched
    section = written.split(docs.BEGIN)[1].split(docs.END)[0]
    assert "### (x) a benchmark" in section
    assert table_rows(section)[-1][:2] != ["machine", "2 CPUs"]  # load recorded per table
    assert table_rows(section)[-1][0] == "machine"  # each table says the load after it
