"""docs/architecture.md's tables stay true: every file they name exists, and every
``pipeline/`` module and every package of the tree is named there (the pattern of
test_docs_gates.py: the doc is checked against the code, not trusted)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "async_processor"
DOC = (ROOT / "docs" / "architecture.md").read_text()
# The stages section: the stage, family, vocabulary and wing listings.
MAP = DOC[DOC.index("## Stages, in data-flow order") : DOC.index("## One message, hop by hop")]
NAMED = set(re.findall(r"`([a-z_/]+(?:\.py|/))`", MAP))


def _resolve(name: str) -> Path | None:
    """A named path, whole (``pipeline/poller.py``) or under the family it sits in
    (``random_robin.py`` in the merge row): the first folder that holds it."""
    for base in (PACKAGE, ROOT, ROOT.parent):  # package paths, repo paths, the package itself
        if (base / name).exists():
            return base / name
    matches = sorted(PACKAGE.rglob(name.rstrip("/")))
    return matches[0] if matches else None


def test_every_named_file_exists() -> None:
    missing = sorted(name for name in NAMED if _resolve(name) is None)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_pipeline_module_has_its_row() -> None:
    modules = {
        f"pipeline/{p.name}" for p in (PACKAGE / "pipeline").glob("*.py") if p.name != "__init__.py"
    }
    rows = set(re.findall(r"^\| [^|]+ \| `(pipeline/[a-z_]+\.py)` \|", MAP, re.MULTILINE))
    assert rows == modules


def test_every_package_and_vocabulary_module_is_named() -> None:
    folders = {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    top = {p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert not folders - NAMED, folders - NAMED
    assert not top - NAMED, top - NAMED


def test_the_pipeline_face_lists_its_stages_in_the_documented_order() -> None:
    import async_processor.pipeline as pipeline

    listed = re.findall(r"^- ``([a-z_]+)``", pipeline.__doc__ or "", re.MULTILINE)
    rows = re.findall(r"^\| [^|]+ \| `pipeline/([a-z_]+)\.py` \|", MAP, re.MULTILINE)
    assert sorted(listed) == sorted(rows)
