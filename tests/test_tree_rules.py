"""The tree's rules for product code (common/, consumer/, producer/), read from the source:

- no module over MAX_LINES lines (a module past it does several jobs: a split waiting);
- no module docstring over MAX_DOC_LINES lines (it states the current contract; measurements
  go to BENCHMARKS.md, reasons to docs/decisions.md, reads of old layouts to docs/upgrade.md);
- no issue number ("issue 46", "#46") and no date ("2026-12-06") anywhere in a module: how the
  code came to be is git's to tell.

SPLIT_IN_PROGRESS names today's offenders, each with its reason and the rules it may break; a
module breaking a rule its entry does not name fails, and so does an entry naming a rule its
module keeps now (that part of the entry goes).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "consumer", "producer")
MAX_LINES = 500
MAX_DOC_LINES = 20

#: "issue 34", "Issues #32", "(#46)"; not "issues a command", an HTML entity (&#013;) or a
#: colour ("#123456"): a bare #N counts only after a space or a bracket.
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+\b|(?<![^\s(\[,])#\d+\b", re.IGNORECASE)
_MONTH = r"(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?"
#: "2026-12-06", "2026/12/06", "December 6, 2026", "6 Dec 2026"; not a version (2026.1) or 2026-13-45.
DATE = re.compile(rf"\b20\d\d[-/](?:0[1-9]|1[0-2])[-/](?:0[1-9]|[12]\d|3[01])\b"
                  rf"|\b{_MONTH} \d{{1,2}},? 20\d\d\b|\b\d{{1,2}} {_MONTH} 20\d\d\b", re.IGNORECASE)

#: Today's offenders, module -> why it is let through, ending in the rules it may break
#: ("lines", "docstring", "history"): the helpers of "Rooms, round three" are rewriting these.
#: Empty it as each one lands.
SPLIT_IN_PROGRESS: dict[str, str] = {
}


def product_modules() -> dict[str, str]:
    """Every module of the three packages, by its path from the root, with its text."""
    return {p.relative_to(ROOT).as_posix(): p.read_text() for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def docstring_lines(text: str) -> int:
    """The module docstring's length in lines, as written (0: none)."""
    doc = ast.get_docstring(ast.parse(text), clean=False)
    return len(doc.splitlines()) if doc else 0


def history_lines(text: str) -> list[str]:
    """TEXT's lines that name an issue or a date, each as `<line>: <text>`."""
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if ISSUE.search(line) or DATE.search(line)]


RULES = ("lines", "docstring", "history")


def broken_rules(text: str) -> dict[str, str]:
    """The rules TEXT breaks, each with what breaks it (none: {})."""
    out = {}
    if (n := len(text.splitlines())) > MAX_LINES:
        out["lines"] = f"{n} lines"
    if (d := docstring_lines(text)) > MAX_DOC_LINES:
        out["docstring"] = f"docstring {d} lines"
    if hist := history_lines(text):
        out["history"] = f"history on {len(hist)} lines: " + "; ".join(hist)
    return out


def let_through(path: str) -> set[str]:
    """The rules SPLIT_IN_PROGRESS lets PATH break."""
    reason = SPLIT_IN_PROGRESS.get(path)
    return set() if reason is None else {r.strip() for r in reason.rsplit(": ", 1)[-1].split(",")}


def offenders(rule: str) -> list[str]:
    """Every module breaking RULE that SPLIT_IN_PROGRESS does not let through, with what breaks it."""
    return [f"{path}: {why[rule]}" for path, text in product_modules().items()
            if rule in (why := broken_rules(text)) and rule not in let_through(path)]


def test_no_module_is_over_500_lines() -> None:
    assert offenders("lines") == []


def test_no_module_docstring_is_over_20_lines() -> None:
    assert offenders("docstring") == []


def test_no_issue_number_or_date_in_product_code() -> None:
    assert offenders("history") == []


@pytest.mark.parametrize("path", sorted(SPLIT_IN_PROGRESS))
def test_an_allowlisted_module_still_needs_its_allowance(path: str) -> None:
    """An entry for a module gone, or a rule it keeps now, is taken out of SPLIT_IN_PROGRESS."""
    modules = product_modules()
    assert path in modules, f"{path} is no module any more: take it out of SPLIT_IN_PROGRESS"
    assert let_through(path) and let_through(path) <= set(RULES), f"{path}: name the rules it may break"
    kept = let_through(path) - broken_rules(modules[path]).keys()
    assert not kept, f"{path} keeps {', '.join(sorted(kept))} now: take that out of its SPLIT_IN_PROGRESS entry"


def test_the_rules_read_every_product_module() -> None:
    modules = product_modules()
    assert {"common/settings.py", "consumer/cli.py", "producer/cli.py", "common/features/codec.py"} <= modules.keys()
    assert len(modules) > 150


PLANTED_HISTORY = [
    "# the sets were three until issue 34",
    '"""Acceptance (Issue 33): a line ...',
    "x = 1  # see issues 32 and 33",
    "# fixed in #46",
    "#46 again",
    "(see #7)",
    "# consumers before 2026-12-06 added to one field",
    "# written on 2026/12/07",
    "# measured December 6, 2026",
    "# measured 7 Dec 2026",
]
EVERYDAY = [
    "every module of common/ that issues a Redis command lives here",
    'out = "HTTP 429 or 503: retried"',
    "# rq 3.0.x, vLLM 0.9.5, Python 3.11; a version 2026.1 is no date",
    'title="Job ID: &#013;&#010;Description"',
    'color = "#123456"',
    "# 2026-13-45 is no date, nor is 20261206",
    "# a list of 4096 entries #   one comment",
]


@pytest.mark.parametrize("line", PLANTED_HISTORY)
def test_the_history_finder_finds_planted_ones(line: str) -> None:
    assert history_lines(line) != []


@pytest.mark.parametrize("line", EVERYDAY)
def test_the_history_finder_leaves_everyday_text_alone(line: str) -> None:
    assert history_lines(line) == []


def test_the_other_rules_find_planted_offenders() -> None:
    long_doc = '"""' + "\n".join(f"line {i}" for i in range(MAX_DOC_LINES + 1)) + '"""\n'
    assert broken_rules(long_doc) == {"docstring": f"docstring {MAX_DOC_LINES + 1} lines"}
    assert broken_rules('"""' + "\n".join(["x"] * MAX_DOC_LINES) + '"""\n') == {}
    long_module = '"""A module."""\n' + "x = 1\n" * MAX_LINES
    assert broken_rules(long_module) == {"lines": f"{MAX_LINES + 1} lines"}


def test_an_allowance_names_its_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "SPLIT_IN_PROGRESS",
                        {"a.py": "split in progress (x): lines, docstring, history", "b.py": "split (y): lines"})
    assert let_through("a.py") == {"lines", "docstring", "history"}
    assert let_through("b.py") == {"lines"}
    assert let_through("common/settings.py") == set()
