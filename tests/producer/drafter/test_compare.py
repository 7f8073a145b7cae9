"""The drafter report's pure core (producer/drafter/compare.py) on hand-made records: one answer
per item, restricted to the items both runs answered, the differences, a baseline without
speculation shown as none, the candidate's weakest category, and the text."""

from __future__ import annotations

from typing import Any

import pytest

from genqueue.common.records import SpecFigures
from genqueue.producer.drafter.compare import NONE, UNDECLARED, collect, report, report_lines


def fig(accepted: int, drafted: int = 30, steps: int = 10) -> SpecFigures:
    return {"k": 3, "steps": steps, "drafted": drafted, "accepted": accepted, "hist": [0, 0, 0, 0]}


def rec(key: str, source: str, accepted: int | None, *, run: str = "eval-b", drafter: str | None = "new",
        tokens: int = 100, **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"key": key, "run": run, "source": source, "turn": None,
                         "messages": [{"role": "user", "content": "q"}], "usage": {"completion_tokens": tokens}}
    if accepted is not None:
        r["spec"] = fig(accepted)
    if drafter is not None:
        r["drafter"] = drafter
    return {**r, **extra}


def err(key: str, run: str = "eval-b") -> dict[str, Any]:
    return {"key": key, "run": run, "turn": None, "messages": [], "error": {"class": "permanent"}}


def held_out(run: str, drafter: str | None, good: int, weak: int, n: int = 30) -> list[dict[str, Any]]:
    return ([rec(f"g{i}", "good.jsonl", good, run=run, drafter=drafter) for i in range(n)]
            + [rec(f"w{i}", "weak.jsonl", weak, run=run, drafter=drafter) for i in range(n)])


def rows(r: Any, facet: str) -> dict[str, Any]:
    return {row["category"]: row for row in r["by"][facet]}


def test_the_candidate_alone_its_table_and_weakest_category() -> None:
    r = report(collect(held_out("eval-b", "new", 24, 12)))
    assert r["baseline"] is None and r["items_compared"] == 60 and r["only_candidate"] == r["only_baseline"] == 0
    c = r["candidate"]
    assert (c["run"], c["drafter"], c["items_answered"], c["items_failed"], c["speculates"]) == (
        "eval-b", "new", 60, 0, True)
    o = r["overall"]["candidate"]
    assert o is not None and o["answers"] == 60 and o["rate"] == pytest.approx(36 / 60)
    assert o["mean_length"] == pytest.approx(1 + 18 / 10)
    src = rows(r, "source")
    assert list(src) == ["good.jsonl", "weak.jsonl"]  # most answers first, then by name
    assert src["weak.jsonl"]["candidate"]["rate"] == pytest.approx(0.4)
    assert src["weak.jsonl"]["baseline"] is None and src["weak.jsonl"]["rate_diff"] is None
    w = r["weakest"]
    assert w is not None and (w["facet"], w["category"]) == ("source", "weak.jsonl")
    assert w["line"] == "drafter weakest on source weak.jsonl: 40% vs 60% overall"
    assert [row["category"] for row in r["by"]["turn"]] == ["1"]


def test_side_by_side_over_the_items_both_answered() -> None:
    cand = held_out("eval-b", "new", 24, 12) + [rec("c-only", "good.jsonl", 30)]
    base = held_out("eval-a", "old", 18, 18) + [rec("b-only", "weak.jsonl", 0, run="eval-a", drafter="old"),
                                                rec("b-only2", "weak.jsonl", 0, run="eval-a", drafter="old")]
    r = report(collect(cand), collect(base))
    assert (r["items_compared"], r["only_candidate"], r["only_baseline"]) == (60, 1, 2)
    b = r["baseline"]
    assert b is not None and (b["run"], b["drafter"], b["items_answered"], b["speculates"]) == ("eval-a", "old", 62, True)
    assert r["candidate"]["items_answered"] == 61  # counted, not compared
    src = rows(r, "source")
    good, weak = src["good.jsonl"], src["weak.jsonl"]
    assert good["candidate"]["answers"] == good["baseline"]["answers"] == 30  # the extra items left out
    assert good["rate_diff"] == pytest.approx(0.8 - 0.6) and weak["rate_diff"] == pytest.approx(0.4 - 0.6)
    assert good["mean_length_diff"] == pytest.approx(0.6) and weak["mean_length_diff"] == pytest.approx(-0.6)
    o = r["overall"]
    assert o["candidate"]["rate"] == o["baseline"]["rate"] == pytest.approx(0.6) and o["rate_diff"] == 0


def test_one_answer_per_item_a_result_beats_an_error_and_errors_count_as_failed() -> None:
    recs = [err("a"), rec("a", "s", 30), rec("a", "s", 0),  # the first result counts; a later copy does not
            err("b"), err("b"),  # only errors: failed
            rec("c", "s", 15), err("c"),  # an error after a result changes nothing
            {"run": "eval-b", "messages": []}]  # no key: a bad line
    got = collect(recs)
    assert set(got.answered) == {"a", "c"} and got.failed == {"b"} and got.bad == 1 and got.records == 7
    r = report(got)
    assert r["overall"]["candidate"]["accepted"] == 45 and r["candidate"]["items_failed"] == 1


def test_a_baseline_without_speculation_is_none() -> None:
    cand = held_out("eval-b", "new", 24, 12)
    base = held_out("plain", None, 0, 0)
    for b in base:
        del b["spec"]
    r = report(collect(cand), collect(base))
    assert r["baseline"] is not None and not r["baseline"]["speculates"]
    assert r["baseline"]["drafter"] == UNDECLARED and r["items_compared"] == 60
    assert all(row["baseline"] is None and row["rate_diff"] is None
               for cats in r["by"].values() for row in cats)
    text = report_lines(r)
    (line,) = [t for t in text if t.startswith("source")]
    assert line.split()[-5:] == [NONE, NONE, NONE, "-", "-"], line
    assert any("no speculation (none)" in t for t in text)


def test_a_category_only_one_run_has_shows_a_dash_and_no_difference() -> None:
    cand = [rec(f"k{i}", "s", 20, tokens=100) for i in range(5)]
    base = [rec(f"k{i}", "s", 20, tokens=300 if i else 100, run="eval-a", drafter="old") for i in range(5)]
    r = report(collect(cand), collect(base))
    length = rows(r, "length")
    assert list(length) == ["<256", "256-1k"]
    assert length["256-1k"]["candidate"] is None and length["256-1k"]["baseline"]["answers"] == 4
    assert length["256-1k"]["rate_diff"] is None


def test_a_relabelled_run_names_both_drafters_and_an_unlabelled_one_says_so() -> None:
    recs = [rec(f"k{i}", "s", 20, drafter="a" if i < 3 else "b") for i in range(5)]
    assert collect(recs).drafter == "a (3), b (2)"
    assert collect([rec("k", "s", 20, drafter=None)]).drafter == UNDECLARED


def test_the_text_puts_both_runs_side_by_side() -> None:
    r = report(collect(held_out("eval-b", "new", 24, 12)), collect(held_out("eval-a", "old", 18, 18)))
    text = report_lines(r)
    assert text[0] == "candidate  eval-b  (drafter new): 60 items answered, 0 failed"
    assert text[1] == "baseline   eval-a  (drafter old): 60 items answered, 0 failed"
    assert text[2] == "compared   60 items both answered; 0 only in eval-b, 0 only in eval-a (left out)"
    assert text[3] == "drafter weakest on source weak.jsonl: 40% vs 60% overall"
    groups = next(t for t in text if "difference" in t)
    assert groups.index("eval-b") < groups.index("eval-a") < groups.index("difference")
    split = {t.split()[0]: t.split() for t in text if t}
    assert split["overall"] == ["overall", "all", "60", "60.0%", "2.80", "60", "60.0%", "2.80", "+0.0", "pt", "+0.00"]
    (weak,) = [t.split() for t in text if "weak.jsonl" in t and not t.startswith("drafter")]
    assert weak == ["weak.jsonl", "30", "40.0%", "2.20", "30", "60.0%", "2.80", "-20.0", "pt", "-0.60"]
    alone = report_lines(report(collect(held_out("eval-b", "new", 24, 12))))
    assert "difference" not in "\n".join(alone) and alone[1] == "items      60 (no baseline: --against names one)"
