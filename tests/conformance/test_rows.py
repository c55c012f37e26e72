"""The conformance suite's bookkeeping: every test says which rows of
shared/reference/upstream-v0.10.md it covers, every row a producer or result reader
sees has a test, and docs/migrating-from-go.md's table lists every test."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

HERE = Path(__file__).parent
DOC = (HERE.parents[1] / "docs" / "migrating-from-go.md").read_text()
# §1 steps 1, 3, 4 and 5 (unusable, expired, cancelled, gated dequeues), §2-§6, and the §14
# checklist rows (row 1's claims are the claims tests'; its "publish with request_token"
# is here).
REQUIRED = {
    "§1.1",
    "§1.3",
    "§1.4",
    "§1.5",
    "§2",
    "§3",
    "§4",
    "§5",
    "§6",
    "§14.1",
    "§14.2",
    "§14.3",
    "§14.4",
}


def suite() -> dict[str, set[str]]:
    """Test name -> the rows its ``upstream`` mark names."""
    tests: dict[str, set[str]] = {}
    for path in sorted(HERE.glob("test_go_*.py")):
        module = importlib.import_module(f"tests.conformance.{path.stem}")
        for name, func in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("test_") and func.__module__ == module.__name__:
                marks = [m for m in getattr(func, "pytestmark", []) if m.name == "upstream"]
                tests[name] = {row for mark in marks for row in mark.args}
    return tests


def test_every_test_names_its_rows_and_every_row_has_a_test() -> None:
    tests = suite()
    assert len(tests) >= 20
    unmarked = sorted(name for name, rows in tests.items() if not rows)
    assert not unmarked, unmarked
    covered = set().union(*tests.values())
    assert covered >= REQUIRED, REQUIRED - covered


def test_the_migration_guide_lists_every_test() -> None:
    start = DOC.index("### The conformance suite")
    ends = [i for i in (DOC.find("\n## ", start), DOC.find("\n### ", start + 4)) if i > 0]
    section = DOC[start : min(ends, default=len(DOC))]
    missing = sorted(name for name in suite() if f"`{name}`" not in section)
    assert not missing, missing
