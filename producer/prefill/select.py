"""Which of a source run's answers a capture pass captures (pure: records in, rows out).

One copy per item key is read, as the export keeps one (producer/export/reduce.py's rank, short of
its quality gates: a result whose outcome is finished beats another result, which beats an error;
then the original beats an end-of-run copy, then the lowest attempt, the earliest finish, the
first read). Every answer of it that finished (export's answer_outcomes: it and every answer
before it) and kept its token ids is a row: `<key>`, or `<key>:<turn>[.<step>]` in mode
regenerate (the names a capture during generation gives, and export-features joins by), its ids
the prompt the engine rendered followed by the ids it generated (the tokens export's input_ids).

The choice (`--capture-by`, `--capture-budget`): every row in the order read, or the rows the
drafter handled worst first (lowest acceptance rate, rows without figures last); under a budget,
each row in that order that still fits is taken (its tokens x bytes per token).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from genqueue.common.contracts import Outcome
from genqueue.common.prefill import PrefillChoice
from genqueue.common.records import SpecFigures, TokenIds, full_prompts


@dataclass(frozen=True, slots=True)
class SourceRow:
    """One answer a pass may capture: its feature ROW id, TOKEN_IDS, the user TURN it answers,
    the input record's ID, its acceptance RATE (None: the engine returned no figures), and how
    many of the last ids the engine generated (COMPLETION)."""

    row: str
    token_ids: list[int]
    turn: int | None
    id: str | None
    rate: float | None
    completion: int = 0


@dataclass(frozen=True, slots=True)
class Reading:
    """What a source run's records came to: its ROWS, and the counts of RECORDS read, of answers
    that finished WITHOUT_IDS, and of records whose ids did not chain (BROKEN)."""

    rows: list[SourceRow]
    records: int
    without_ids: int
    broken: int


def _rank(rec: Mapping[str, Any], order: int) -> tuple[int, int, int, float, int]:
    kind = 2 if "error" in rec else 0 if rec.get("outcome") == Outcome.FINISHED else 1
    timings = rec.get("timings") or {}
    finished = timings.get("finished_at") if isinstance(timings, dict) else None
    return (kind, 1 if rec.get("copy") else 0, int(rec.get("attempt") or 0),
            float(finished) if isinstance(finished, int | float) else math.inf, order)


def one_per_key(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The copy of each key the export keeps, in the order keys were first read."""
    best: dict[str, tuple[tuple[int, int, int, float, int], Mapping[str, Any]]] = {}
    for n, rec in enumerate(records):
        key = rec.get("key")
        if not isinstance(key, str):
            continue
        rank = _rank(rec, n)
        cur = best.get(key)
        if cur is None or rank < cur[0]:
            best[key] = (rank, rec)
    return [rec for _, rec in best.values()]


def row_id(key: str, turn: int | None, step: int, *, regenerate: bool) -> str:
    """The feature row of an answer (consumer/answer/generate.py's feature_row in regenerate)."""
    if not regenerate:
        return key
    return f"{key}:{turn}" + (f".{step}" if step else "")


def answers(rec: Mapping[str, Any]) -> Iterator[tuple[int | None, int, TokenIds | None, list[int] | None,
                                                     SpecFigures | None]]:
    """The answers of result record REC that finished, each with every answer before it (the rule
    of export's answer_outcomes, by which its tokens rows are kept): (turn, step, token ids, the
    whole prompt ids, acceptance figures). Raises ValueError when a regenerate record's ids do not
    chain."""
    turns = rec.get("turns")
    if not isinstance(turns, list):
        if rec.get("outcome") == Outcome.FINISHED:
            ids = rec.get("token_ids")
            yield rec.get("turn"), 0, ids, ids["prompt"] if ids is not None else None, rec.get("spec")
        return
    fallback = rec.get("outcome") if rec.get("outcome") != Outcome.PARTIAL else "unknown"
    for t, prompt in zip(turns, full_prompts(turns), strict=True):
        if (t.get("outcome") or fallback) != Outcome.FINISHED:
            return
        yield t.get("turn"), int(t.get("step") or 0), t.get("token_ids"), prompt, t.get("spec")


def source_rows(records: Iterable[Mapping[str, Any]], *, regenerate: bool) -> Reading:
    """Every row a pass may capture of a run's RECORDS (its shards' lines), one copy per key."""
    rows: list[SourceRow] = []
    n = without = broken = 0
    for rec in one_per_key(records):
        n += 1
        if "error" in rec:
            continue
        rid = rec.get("id")
        try:
            for turn, step, ids, prompt, spec in answers(rec):
                if ids is None or prompt is None:
                    without += 1
                    continue
                rate = spec["accepted"] / spec["drafted"] if spec is not None and spec.get("drafted") else None
                rows.append(SourceRow(row_id(str(rec["key"]), turn, step, regenerate=regenerate),
                                      prompt + ids["completion"], turn, rid if isinstance(rid, str) else None, rate,
                                      len(ids["completion"])))
        except (ValueError, TypeError, KeyError):
            broken += 1
    return Reading(rows, n, without, broken)


def choose(rows: list[SourceRow], by: PrefillChoice, budget: int | None, per_token: int | None) -> list[SourceRow]:
    """ROWS in BY's order, those that fit BUDGET bytes at PER_TOKEN bytes a token (None: all)."""
    if by is PrefillChoice.ACCEPTANCE:
        rows = sorted(rows, key=lambda r: (r.rate is None, r.rate if r.rate is not None else 0.0, r.row))
    if budget is None or per_token is None:
        return list(rows)
    out: list[SourceRow] = []
    left = budget
    for r in rows:
        cost = len(r.token_ids) * per_token
        if cost <= left:
            out.append(r)
            left -= cost
    return out
