"""Speculative-decoding acceptance by category: where the drafter is strong and where it fails.

Every answer whose record carries the engine's figures (`spec`, common/records.py SpecFigures)
counts in one category of each facet: the source file it came from, the request variant it was
sent with, its user turn (1-based; turns from SPEC_TURN_CAP on are one), and its length bucket
(completion tokens, SPEC_LENGTH_BUCKETS). A regenerated conversation counts each of its turns on
its own (each turn's figures, turn index and length); a single-answer record counts its one
answer. Records without figures count nowhere, and error records never count.

The same table is built by status (from the tallies the consumers keep), by export's dataset
card and selection, and by the drafter report (from the records alone), so one answer is in one
category wherever it is counted. Pure: no Redis, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import pairwise
from typing import Any, TypedDict

from genqueue.common.records import SpecFigures

#: Answer-length buckets (completion tokens, each from its bound), a factor 4 apart: a drafter's acceptance falls
#: with distance from the prompt, and these split a reasoning dataset's answers into groups of comparable size.
SPEC_LENGTH_BUCKETS = (0, 256, 1024, 4096)
#: Turns from this one on (1-based user turns) are one category: few conversations go deeper.
SPEC_TURN_CAP = 4
#: Answers a category needs before it is named the weakest: below that one unlucky conversation decides.
SPEC_MIN_ANSWERS = 25
#: How far below the overall rate the weakest category must be: a drafter's real weak spots sit 10+ points below.
SPEC_WEAKEST_MIN_GAP = 0.05
#: The vLLM server flag that makes each answer carry its speculative-decoding figures (the records' `spec`).
PER_REQUEST_SPEC_FLAG = "--per-request-spec-decode-metrics"


class Facet(StrEnum):
    """A way of splitting answers into categories."""

    SOURCE = "source"
    VARIANT = "variant"
    TURN = "turn"
    LENGTH = "length"


#: The category of an answer that has none on a facet (no source recorded, no variant mix).
NONE_LABEL = "-"


def length_bucket(completion_tokens: int) -> str:
    """The answer-length bucket of an answer of COMPLETION_TOKENS: `<256`, `256-1k`, `1k-4k`, `4k+`
    with the default bounds."""
    bounds = SPEC_LENGTH_BUCKETS
    for lo, hi in pairwise(bounds):
        if completion_tokens < hi:
            return f"<{_k(hi)}" if lo == 0 else f"{_k(lo)}-{_k(hi)}"
    return f"{_k(bounds[-1])}+"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def turn_label(turn: int) -> str:
    """The category of 1-based user turn TURN."""
    return f"{SPEC_TURN_CAP}+" if turn >= SPEC_TURN_CAP else str(max(turn, 1))


@dataclass(slots=True)
class Tally:
    """Answers and their summed figures in one category."""

    answers: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, spec: SpecFigures) -> None:
        self.answers += 1
        self.steps += spec["steps"]
        self.drafted += spec["drafted"]
        self.accepted += spec["accepted"]

    def merge(self, other: Tally) -> None:
        self.answers += other.answers
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted

    @property
    def rate(self) -> float | None:
        """Accepted draft tokens per proposed one (vLLM's draft_acceptance_rate)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_length(self) -> float | None:
        """Tokens per verify step, the bonus token included (vLLM's mean_acceptance_length)."""
        return 1 + self.accepted / self.steps if self.steps else None


class Figures(TypedDict):
    """A tally as status, export and the drafter report show it: answers and their summed counts,
    rate = accepted / drafted (4 digits), mean length = 1 + accepted / steps (3 digits); None:
    nothing to divide."""

    answers: int
    steps: int
    drafted: int
    accepted: int
    rate: float | None
    mean_length: float | None


def figures(t: Tally) -> Figures:
    """T's figures, rounded as every reader shows them."""
    rate, length = t.rate, t.mean_length
    return {"answers": t.answers, "steps": t.steps, "drafted": t.drafted, "accepted": t.accepted,
            "rate": None if rate is None else round(rate, 4),
            "mean_length": None if length is None else round(length, 3)}


@dataclass(frozen=True, slots=True)
class Answer:
    """One answer's place in the categories, and its figures."""

    source: str
    variant: str
    turn: str
    length: str
    spec: SpecFigures

    def label(self, facet: Facet) -> str:
        return {Facet.SOURCE: self.source, Facet.VARIANT: self.variant, Facet.TURN: self.turn,
                Facet.LENGTH: self.length}[facet]


def answers_of(rec: Mapping[str, Any]) -> Iterator[Answer]:
    """The answers of one shard record that carry figures (none for an error record)."""
    if "error" in rec:
        return
    source = str(rec.get("source") or NONE_LABEL)
    variant = str(rec.get("variant") or NONE_LABEL)
    turns = rec.get("turns")
    if isinstance(turns, list) and turns:
        for t in turns:
            spec = t.get("spec") if isinstance(t, Mapping) else None
            if spec:
                yield Answer(source, variant, turn_label(int(t.get("turn", 0)) + 1),
                             length_bucket(_completion_tokens(t)), spec)
        return
    spec = rec.get("spec")
    if not spec:
        return
    turn = rec.get("turn")
    if isinstance(turn, int):
        ordinal = turn + 1
    else:  # first/last: the answer is to the prompt's last user turn
        ordinal = sum(1 for m in rec.get("messages") or () if isinstance(m, Mapping) and m.get("role") == "user")
    yield Answer(source, variant, turn_label(ordinal), length_bucket(_completion_tokens(rec)), spec)


def _completion_tokens(part: Mapping[str, Any]) -> int:
    usage = part.get("usage")
    return int(usage.get("completion_tokens") or 0) if isinstance(usage, Mapping) else 0


def record_rate(rec: Mapping[str, Any]) -> float | None:
    """A record's own acceptance rate, over all its answers (None: no figures)."""
    t = Tally()
    for a in answers_of(rec):
        t.add(a.spec)
    return t.rate


@dataclass(slots=True)
class AcceptanceTable:
    """The tallies of a set of answers: overall and per category of every facet."""

    overall: Tally = field(default_factory=Tally)
    by: dict[Facet, dict[str, Tally]] = field(default_factory=lambda: {f: {} for f in Facet})

    def add(self, answer: Answer) -> None:
        self.overall.add(answer.spec)
        for facet in Facet:
            self.by[facet].setdefault(answer.label(facet), Tally()).add(answer.spec)

    def add_record(self, rec: Mapping[str, Any]) -> None:
        for a in answers_of(rec):
            self.add(a)

    def merge(self, other: AcceptanceTable) -> None:
        self.overall.merge(other.overall)
        for facet in Facet:
            for label, t in other.by[facet].items():
                self.by[facet].setdefault(label, Tally()).merge(t)

    def weakest(self, min_answers: int = SPEC_MIN_ANSWERS,
                min_gap: float = SPEC_WEAKEST_MIN_GAP) -> tuple[Facet, str, Tally] | None:
        """The category furthest below the overall rate, among facets with more than one category
        and categories of at least MIN_ANSWERS answers (None: no such category at least MIN_GAP
        below overall)."""
        base = self.overall.rate
        if base is None:
            return None
        best: tuple[float, Facet, str, Tally] | None = None
        for facet in Facet:
            cats = self.by[facet]
            if len(cats) < 2:
                continue
            for label, t in cats.items():
                if t.answers < min_answers or t.rate is None or t.rate > base - min_gap:
                    continue
                gap = base - t.rate
                if best is None or gap > best[0]:
                    best = (gap, facet, label, t)
        return None if best is None else (best[1], best[2], best[3])


#: The length buckets in their own order (shortest first), as length_bucket names them.
_LENGTHS = {length_bucket(bound): i for i, bound in enumerate(SPEC_LENGTH_BUCKETS)}


def category_order(facet: Facet, labels: Iterable[str], *tables: AcceptanceTable | None) -> list[str]:
    """LABELS of FACET in the order every reader lists them: turns by number and length buckets
    shortest first (a label of another shape after them, by name); sources and variants by their
    answers in TABLES (the first table's first), most first, then by name."""
    if facet is Facet.TURN or facet is Facet.LENGTH:
        def natural(label: str) -> tuple[int, int, str]:
            if facet is Facet.LENGTH:
                return (0, _LENGTHS[label], label) if label in _LENGTHS else (1, 0, label)
            digits = label.rstrip("+")
            return (0, int(digits), label) if digits.isdigit() else (1, 0, label)
        return sorted(labels, key=natural)

    def answers(label: str) -> tuple[int, ...]:
        return tuple(-(t.by[facet][label].answers if t is not None and label in t.by[facet] else 0) for t in tables)

    return sorted(labels, key=lambda label: (answers(label), label))


def table_of(records: Iterable[Mapping[str, Any]]) -> AcceptanceTable:
    table = AcceptanceTable()
    for rec in records:
        table.add_record(rec)
    return table


#: The tallies' counts, in the order a Tally holds them (the tally hash's field suffixes).
STATS = ("answers", "steps", "drafted", "accepted")


def tally_fields(rec: Mapping[str, Any], sep: str = "\x1f") -> dict[str, int]:
    """What one record adds to a run's tallies: field "<facet>SEP<label>SEP<stat>" -> amount,
    summed over its answers (empty for a record without figures, and for an error record).
    The overall tally is the sum of any one facet's: every answer is in one category of each.
    On the consumer's path for every record shipped: kept cheap."""
    sums: dict[str, list[int]] = {}
    for a in answers_of(rec):
        spec = a.spec
        steps, drafted, accepted = spec["steps"], spec["drafted"], spec["accepted"]
        for facet, label in ((_SOURCE, a.source), (_VARIANT, a.variant), (_TURN, a.turn), (_LENGTH, a.length)):
            prefix = f"{facet}{sep}{label.translate(_CONTROL) or NONE_LABEL}{sep}"
            t = sums.get(prefix)
            if t is None:
                sums[prefix] = [1, steps, drafted, accepted]
            else:
                t[0] += 1
                t[1] += steps
                t[2] += drafted
                t[3] += accepted
    out: dict[str, int] = {}
    for prefix, (answers, steps, drafted, accepted) in sums.items():
        out[prefix + "answers"] = answers
        if steps:
            out[prefix + "steps"] = steps
        if drafted:
            out[prefix + "drafted"] = drafted
        if accepted:
            out[prefix + "accepted"] = accepted
    return out


_SOURCE, _VARIANT, _TURN, _LENGTH = Facet.SOURCE.value, Facet.VARIANT.value, Facet.TURN.value, Facet.LENGTH.value
#: Control characters (the tallies' separators among them), each shown as '?' in a label.
_CONTROL = {c: "?" for c in range(32)}


def clean_label(label: str) -> str:
    """LABEL with the control characters the tallies' fields are split by made visible ('?')."""
    return label.translate(_CONTROL) or NONE_LABEL


def table_of_fields(fields: Mapping[str, int], sep: str = "\x1f") -> AcceptanceTable:
    """The table the tallies FIELDS (tally_fields' names, summed) hold; fields of another shape
    are left out. Overall: the source facet's sum."""
    table = AcceptanceTable()
    for name, n in fields.items():
        parts = name.split(sep)
        if len(parts) != 3 or parts[2] not in STATS:
            continue
        try:
            facet = Facet(parts[0])
        except ValueError:
            continue
        t = table.by[facet].setdefault(parts[1], Tally())
        setattr(t, parts[2], getattr(t, parts[2]) + int(n))
    for t in table.by[Facet.SOURCE].values():
        table.overall.merge(t)
    return table


def weakest_line(table: AcceptanceTable, min_answers: int = SPEC_MIN_ANSWERS) -> str | None:
    """The drafter's weakest category in words ("drafter weakest on source weak.jsonl: 35% vs 70%
    overall"), None when no category of enough answers is below the overall rate."""
    found = table.weakest(min_answers)
    if found is None or table.overall.rate is None:
        return None
    facet, label, t = found
    return f"drafter weakest on {facet.value} {label}: {t.rate or 0:.0%} vs {table.overall.rate:.0%} overall"
