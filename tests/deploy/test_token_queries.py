"""Every PromQL over ``tokens_total`` we ship (dashboard, alert rules, docs) selects its
kinds: ``kind="total"`` is the sum of ``prompt`` and ``completion``, so a query taking all
three counts every token twice."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "llm_d_async_async_tokens_total"
KINDS = ("prompt", "completion", "total")
SELECTOR = re.compile(NAME + r"(\{[^}]*\})?")
KIND_MATCHER = re.compile(r'\bkind\s*(=~|=|!=|!~)\s*"([^"]*)"')
# Upstream's label: the kinds each direction holds ("total" has none).
DIRECTION_MATCHER = re.compile(r'\bdirection\s*(=~|=|!=|!~)\s*"([^"]*)"')
DIRECTIONS = {"prompt": "input", "completion": "output", "total": ""}


def queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for each query naming the series."""
    for path in sorted((ROOT / "charts").rglob("*")):
        if path.suffix == ".json":
            yield from _exprs(path, json.loads(path.read_text()))
        elif path.suffix in (".yaml", ".yml", ".tpl"):
            for line in path.read_text().splitlines():
                if NAME in line:
                    yield str(path), line
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for span in re.findall(r"`([^`]+)`", path.read_text()):
            if NAME in span and "(" in span:  # a query, not the name or its label list
                yield str(path), span


def _exprs(path: Path, node: object) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str) and NAME in value:
                yield str(path), value
            else:
                yield from _exprs(path, value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(path, item)


def kinds_selected(selector: str) -> set[str]:
    chosen = set(KINDS)
    for matcher, name in ((KIND_MATCHER, lambda k: k), (DIRECTION_MATCHER, DIRECTIONS.get)):
        for op, value in matcher.findall(selector):
            match = {k for k in KINDS if re.fullmatch(value, name(k)) if op in ("=~", "!~")}
            equal = {k for k in KINDS if name(k) == value}
            every = set(KINDS)
            chosen &= {"=": equal, "=~": match, "!=": every - equal, "!~": every - match}[op]
    return chosen


def test_kinds_selected_reads_the_matchers() -> None:
    assert kinds_selected("") == set(KINDS)
    assert kinds_selected('{kind="total"}') == {"total"}
    assert kinds_selected('{tenant="a", kind=~"prompt|completion"}') == {"prompt", "completion"}
    assert kinds_selected('{kind!="total"}') == {"prompt", "completion"}
    assert kinds_selected('{direction=~"input|output"}') == {"prompt", "completion"}
    assert kinds_selected('{direction!=""}') == {"prompt", "completion"}
    assert kinds_selected('{direction="input"}') == {"prompt"}


def test_no_shipped_query_adds_total_to_its_parts() -> None:
    found = list(queries())
    for where, query in found:
        for selector in SELECTOR.findall(query):
            kinds = kinds_selected(selector)
            assert kinds and not ("total" in kinds and len(kinds) > 1), (where, query)
    assert len(found) >= 4  # the two dashboard panels and the docs' bills: all were read
