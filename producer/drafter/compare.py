"""The drafter report: a run's speculative-decoding acceptance by category, side by side with
another run's, from their records alone.

Each run's records are reduced to its items (RunAnswers): an item counts once, by its key, with
the answers of its first result record in the shards' name order (delivery is at least once: a
record shipped twice counts once); an item with only error records is failed. Compared, the
two runs are restricted to the items both answered, so each figure is of the same prompts;
the items only one of them answered are counted, not compared. A baseline without any figures
(served without speculation) has none: its columns say so. Categories are common.acceptance's
(source, variant, turn, length), so an answer is in the category status and export put it in.

Pure: records come in as read, the report (its --json) and its lines go out.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from genqueue.common.acceptance import (
    PER_REQUEST_SPEC_FLAG,
    SPEC_MIN_ANSWERS,
    AcceptanceTable,
    Answer,
    Facet,
    Figures,
    Tally,
    answers_of,
    category_order,
    figures,
    weakest_line,
)

#: What a run's drafter column says when its records name no drafter (no `--drafter`).
UNDECLARED = "none declared"
#: What a baseline's figures say when it has none at all (served without speculation).
NONE = "none"


@dataclass(slots=True)
class RunAnswers:
    """A run as its records tell it: each answered item's answers with figures, by key; the
    items with only error records; the run names and drafter labels the records carry."""

    answered: dict[str, tuple[Answer, ...]] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    runs: collections.Counter[str] = field(default_factory=collections.Counter)
    drafters: collections.Counter[str] = field(default_factory=collections.Counter)  # "" : none declared
    records: int = 0
    bad: int = 0  # lines that are no record (counted by the reader) or records without a key

    def add(self, rec: Mapping[str, Any]) -> None:
        """Count one shard record (the first result of an item is its answer)."""
        key = rec.get("key")
        if not isinstance(key, str) or not key:
            self.bad += 1
            return
        self.records += 1
        run = rec.get("run")
        self.runs[run if isinstance(run, str) else ""] += 1
        if "error" in rec:
            if key not in self.answered:
                self.failed.add(key)
            return
        if key in self.answered:
            return
        self.failed.discard(key)
        self.answered[key] = tuple(answers_of(rec))
        drafter = rec.get("drafter")
        self.drafters[drafter if isinstance(drafter, str) else ""] += 1

    def table(self, keys: Iterable[str]) -> AcceptanceTable:
        """The acceptance table of the answers of the items KEYS (answered ones)."""
        t = AcceptanceTable()
        for k in keys:
            for a in self.answered[k]:
                t.add(a)
        return t

    @property
    def run(self) -> str:
        """The run the records belong to (several, most records first, should a directory mix them)."""
        return ", ".join(name or "?" for name, _ in _ranked(self.runs)) or "?"

    @property
    def drafter(self) -> str:
        """The drafter the records name (several when the run's label changed: most answers first)."""
        names = _ranked(self.drafters)
        if len(names) == 1:
            return names[0][0] or UNDECLARED
        return ", ".join(f"{name or UNDECLARED} ({n:,})" for name, n in names) or UNDECLARED


def collect(records: Iterable[Mapping[str, Any]]) -> RunAnswers:
    out = RunAnswers()
    for rec in records:
        out.add(rec)
    return out


def _ranked(counts: collections.Counter[str]) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


class Row(TypedDict):
    """A category side by side: the candidate's figures, the baseline's (None: no answer there,
    or no baseline, or a baseline without speculation), and candidate minus baseline."""

    category: str
    candidate: Figures | None
    baseline: Figures | None
    rate_diff: float | None
    mean_length_diff: float | None


class RunSide(TypedDict):
    run: str  # as the records name it
    drafter: str  # as the records name it (UNDECLARED: none)
    records: int
    bad_lines: int
    items_answered: int  # every item with a result record
    items_failed: int  # items with only error records
    speculates: bool  # some answer of the compared items has figures


class Weakest(TypedDict):
    facet: str
    category: str
    answers: int
    rate: float
    overall_rate: float
    line: str  # "drafter weakest on source weak.jsonl: 35% vs 70% overall"


class DrafterReport(TypedDict):
    """`producer drafter-report`'s --json: the candidate run's acceptance table by category,
    side by side with the baseline's when there is one (over the items both answered)."""

    candidate: RunSide
    baseline: RunSide | None
    items_compared: int  # the items the table is over: both runs answered them (all the candidate's alone)
    only_candidate: int  # answered by the candidate only (left out of the table)
    only_baseline: int  # answered by the baseline only (left out of the table)
    overall: Row
    by: dict[str, list[Row]]  # facet -> its categories
    weakest: Weakest | None  # the candidate's weakest category, over the compared items


def _figures(t: Tally | None) -> Figures | None:
    return None if t is None or not t.answers else figures(t)


def _diff(a: float | None, b: float | None, digits: int) -> float | None:
    return None if a is None or b is None else round(a - b, digits)


def _row(label: str, cand: Tally | None, base: Tally | None) -> Row:
    c, b = _figures(cand), _figures(base)
    return {"category": label, "candidate": c, "baseline": b,
            "rate_diff": _diff(c["rate"], b["rate"], 4) if c is not None and b is not None else None,
            "mean_length_diff": (_diff(c["mean_length"], b["mean_length"], 3)
                                 if c is not None and b is not None else None)}


def _side(r: RunAnswers, table: AcceptanceTable) -> RunSide:
    return {"run": r.run, "drafter": r.drafter, "records": r.records, "bad_lines": r.bad,
            "items_answered": len(r.answered), "items_failed": len(r.failed),
            "speculates": table.overall.answers > 0}


def _what_it_has(r: RunAnswers) -> str:
    """A run in a few words: its items answered and its acceptance over all of them."""
    t = r.table(r.answered)
    rate = t.overall.rate
    acc = f"acceptance {rate:.1%} over {t.overall.answers:,} answers" if rate is not None else "no acceptance figures"
    return f"{r.run} answered {len(r.answered):,} items ({acc})"


def nothing_in_common(candidate: RunAnswers, baseline: RunAnswers) -> str | None:
    """Why CANDIDATE and BASELINE cannot be compared (no item answered by both), with what each
    has; None when some item is in both. A table over no item would read as two runs without
    speculation."""
    if candidate.answered.keys() & baseline.answered.keys():
        return None
    return (f"no items in common: {_what_it_has(candidate)}; {_what_it_has(baseline)}. The table is over the "
            "items both answered: serve the same input to both runs (drop --against to report the candidate alone)")


def report(candidate: RunAnswers, baseline: RunAnswers | None = None,
           min_answers: int = SPEC_MIN_ANSWERS) -> DrafterReport:
    """The CANDIDATE run's acceptance by category, beside BASELINE's over the items both
    answered (all the candidate's items without a baseline). A category of fewer than
    MIN_ANSWERS answers is never named the weakest."""
    if baseline is None:
        keys = sorted(candidate.answered)
        only_c = only_b = 0
    else:
        both = candidate.answered.keys() & baseline.answered.keys()
        keys = sorted(both)
        only_c, only_b = len(candidate.answered.keys() - both), len(baseline.answered.keys() - both)
    cand = candidate.table(keys)
    base = baseline.table(keys) if baseline is not None else None
    shown_base = base if base is not None and base.overall.answers else None  # a baseline without figures: none
    by = {facet.value: [_row(label, cand.by[facet].get(label),
                             shown_base.by[facet].get(label) if shown_base is not None else None)
                        for label in category_order(facet, set(cand.by[facet]) | (set(shown_base.by[facet]) if shown_base is not None else set()), cand, shown_base)]
          for facet in Facet}
    weakest: Weakest | None = None
    found, line, overall = cand.weakest(min_answers), weakest_line(cand, min_answers), cand.overall.rate
    if found is not None and line is not None and overall is not None:
        facet, label, t = found
        weakest = {"facet": facet.value, "category": label, "answers": t.answers, "rate": round(t.rate or 0.0, 4),
                   "overall_rate": round(overall, 4), "line": line}
    return {"candidate": _side(candidate, cand),
            "baseline": None if baseline is None or base is None else _side(baseline, base),
            "items_compared": len(keys), "only_candidate": only_c, "only_baseline": only_b,
            "overall": _row("all", cand.overall, shown_base.overall if shown_base is not None else None),
            "by": by, "weakest": weakest}


# -- the text ------------------------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _len(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _cells(f: Figures | None, none: bool) -> list[str]:
    if none:
        return [NONE] * 3
    if f is None:
        return ["-"] * 3
    return [f"{f['answers']:,}", _pct(f["rate"]), _len(f["mean_length"])]


def _diff_cells(row: Row) -> list[str]:
    r, m = row["rate_diff"], row["mean_length_diff"]
    return ["-" if r is None else f"{100 * r:+.1f} pt", "-" if m is None else f"{m:+.2f}"]


def report_lines(r: DrafterReport) -> list[str]:
    """The report as text: who is compared with whom over which items, the candidate's weakest
    category, and the table (a row per category of each facet)."""
    c, b = r["candidate"], r["baseline"]
    out = [f"candidate  {c['run']}  (drafter {c['drafter']}): {c['items_answered']:,} items answered, "
           + f"{c['items_failed']:,} failed"]
    if b is not None:
        out.append(f"baseline   {b['run']}  (drafter {b['drafter']}): {b['items_answered']:,} items answered, "
                   f"{b['items_failed']:,} failed" + ("" if b["speculates"] else "; no speculation (none)"))
        out.append(f"compared   {r['items_compared']:,} items both answered; {r['only_candidate']:,} only in "
                   f"{c['run']}, {r['only_baseline']:,} only in {b['run']} (left out)")
    else:
        out.append(f"items      {r['items_compared']:,} (no baseline: --against names one)")
    if not c["speculates"]:
        out.append("the candidate's records carry no speculative-decoding figures (served without speculation, or "
                   f"without the engine's {PER_REQUEST_SPEC_FLAG})")
    if r["weakest"] is not None:
        out.append(r["weakest"]["line"])
    rows: list[tuple[str, Row]] = [("overall", r["overall"])]
    for facet, cats in r["by"].items():
        rows += [(facet if i == 0 else "", row) for i, row in enumerate(cats)]
    none = b is not None and not b["speculates"]
    head = ["by", "category", "answers", "rate", "mean len"]
    groups = [("", 2), (c["run"], 3)]
    if b is not None:
        head += ["answers", "rate", "mean len", "rate", "mean len"]
        groups += [(b["run"], 3), ("difference", 2)]
    table = [head] + [[facet, row["category"], *_cells(row["candidate"], False),
                       *([*_cells(row["baseline"], none), *_diff_cells(row)] if b is not None else [])]
                      for facet, row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    sep = "  "
    spans, col = [], 0
    for name, n in groups:  # a group's name over its columns, right-aligned
        width = sum(widths[col:col + n]) + len(sep) * (n - 1)
        spans.append(name[-width:].rjust(width) if name else " " * width)
        col += n
    out.append("")
    out.append(sep.join(spans).rstrip())
    for line in table:
        out.append(sep.join(cell.ljust(w) if i < 2 else cell.rjust(w)
                            for i, (cell, w) in enumerate(zip(line, widths, strict=True))).rstrip())
    return out
