"""The latest ``make bench`` run's tables, written into docs/performance.md between markers.

Input: the tables ``common.table`` printed during the run (title and rows), and what the
run was (commit, date, CPUs, load before). Output: a Markdown section replacing everything
between ``BEGIN`` and ``END`` in the document; the text around them (the curated history
tables, with their ranges over many runs) is left exactly as it was. A document without
exactly one pair of markers is refused, never appended to.
"""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BEGIN = "<!-- bench:begin: written by `make bench` (bench/docs.py); edit outside the markers -->"
END = "<!-- bench:end -->"

Rows = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Run:
    """What the figures were measured on."""

    commit: str
    date: str
    cpus: int
    load: str  # the load average before the benchmarks
    quick: bool = False
    only: tuple[str, ...] = ()  # the benchmarks run, when not all


def render(run: Run, tables: Sequence[tuple[str, Rows]]) -> str:
    """The generated section: a heading, what it ran on, then one table per benchmark."""
    kind = "`make bench` with `--quick` (smaller runs)" if run.quick else "`make bench`"
    about = (
        f"{kind} at `{run.commit}` on {run.date}, {run.cpus} CPUs, load average {run.load}"
        " before the benchmarks (each table ends with the load after it)."
        + (f" Only: {', '.join(run.only)}." if run.only else "")
        + " Under a load above the CPU count the rates are the machine's: compare the daemon"
        " with the baseline of the same table, not with the curated figures above."
    )
    lines = ["## The latest run", "", textwrap.fill(about, width=90)]
    for title, rows in tables:
        lines += ["", f"### {_cell(title)}", "", "| figure | value |", "|---|---|"]
        lines += [f"| {_cell(name)} | {_cell(value)} |" for name, value in rows]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """One table cell: a pipe would split it, a newline would end the row."""
    return " ".join(text.split()).replace("|", "\\|")


def replace_section(document: str, section: str) -> str:
    """``document`` with the text between the markers replaced by ``section``."""
    if document.count(BEGIN) != 1 or document.count(END) != 1:
        raise ValueError(f"the document needs one {BEGIN!r} and one {END!r} line")
    if document.index(END) < document.index(BEGIN):
        raise ValueError("the end marker comes before the begin marker")
    head, rest = document.split(BEGIN)
    tail = rest.split(END)[1]
    return f"{head}{BEGIN}\n{section}\n{END}{tail}"


def write(path: Path, run: Run, tables: Sequence[tuple[str, Rows]]) -> None:
    path.write_text(replace_section(path.read_text(), render(run, tables)))


def commit() -> str:
    """The checkout's short commit (``-dirty`` with uncommitted changes), or "unknown"."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True, text=True, check=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"
