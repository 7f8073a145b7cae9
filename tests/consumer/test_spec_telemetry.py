"""A consumer's own acceptance (consumer/telemetry.py SpecCounts): its table per run, its
snapshot figures, its genqueue_spec_* counters with a capped set of categories, and the doctor's
note on the weakest category; and the status section's lines drawn from a view (pure)."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY

from genqueue.common.acceptance import AcceptanceTable, answers_of, table_of
from genqueue.consumer.metrics import OTHER_CATEGORY, SpecCounts
from genqueue.producer.status.screen import wrap
from genqueue.producer.status.speculation import SHOWN_CATEGORIES, speculation_lines, speculation_view


def rec(source: str, accepted: int, tokens: int = 100) -> dict[str, Any]:
    return {"key": "k", "source": source, "messages": [{"role": "user"}], "usage": {"completion_tokens": tokens},
            "spec": {"k": 3, "steps": 10, "drafted": 30, "accepted": accepted, "hist": [0, 0, 0, 0]}}


def sample(name: str, run: str, facet: str, category: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"run": run, "facet": facet, "category": category})


def test_counters_by_category_with_the_rest_as_other_and_the_weakest_named() -> None:
    counts = SpecCounts(cap=3)
    recs = [rec(f"s{i % 5}.jsonl", 24 if i % 5 else 6) for i in range(200)]  # s0 is weak
    for r in recs:
        for a in answers_of(r):
            counts.add("tele", a)
    assert counts.totals("tele") == {"answers": 200, "steps": 2000, "drafted": 6000, "accepted": 40 * 6 + 160 * 24}
    assert counts.totals() == counts.totals("tele") and counts.totals("other-run") is None
    # three sources have their own series, the last two are "other"; every facet sums to the whole
    assert sample("genqueue_spec_answers_total", "tele", "source", "s0.jsonl") == 40
    assert sample("genqueue_spec_answers_total", "tele", "source", "s4.jsonl") is None
    assert sample("genqueue_spec_answers_total", "tele", "source", OTHER_CATEGORY) == 80
    assert sample("genqueue_spec_accepted_tokens_total", "tele", "source", "s0.jsonl") == 40 * 6
    assert sample("genqueue_spec_drafted_tokens_total", "tele", "turn", "1") == 6000
    assert sample("genqueue_spec_steps_total", "tele", "length", "<256") == 2000
    # the table keeps every source, and the doctor's note names the weak one
    assert set(counts.tables["tele"].by["source"]) == {f"s{i}.jsonl" for i in range(5)}
    assert counts.notes() == ["drafter weakest on source s0.jsonl: 20% vs 68% overall"]
    for r in recs[:150]:
        for a in answers_of(r):
            counts.add("tele2", a)
    assert [n.rsplit(" (run ", 1)[1] for n in counts.notes()] == ["tele)", "tele2)"]


def test_the_status_lines_name_the_weakest_and_clip_long_facets() -> None:
    recs = [rec(f"/data/in/source-{i:02d}.jsonl", 24 if i else 6) for i in range(12) for _ in range(30)]
    view = speculation_view(table_of(recs), [("gpu0", True, {"answers": 5, "steps": 10, "drafted": 30, "accepted": 15})])
    assert view is not None and view["weakest"] is not None
    assert view["weakest"]["category"] == "/data/in/source-00.jsonl" and view["weakest"]["rate"] == 0.2
    assert [r["answers"] for r in view["by"]["source"]] == [30] * 12
    lines = speculation_lines(view, 100)
    assert lines[0] == "speculation  acceptance (run, all consumers) 75%, mean length 3.25, 360 answers shipped"
    assert lines[1] == "  drafter weakest on source /data/in/source-00.jsonl: 20% vs 75% overall"
    assert lines[2] == "  acceptance (each consumer, this run)  gpu0 50% len 2.50 (5 answers)"
    rows = [line for line in lines if "source-" in line and "weakest" not in line]
    assert len(rows) == SHOWN_CATEGORIES and "(+4 more source categories; --wide shows all)" in "\n".join(lines)
    assert len([line for line in speculation_lines(view) if "source-" in line]) == 13  # --wide: every one
    narrow = [x for line in speculation_lines(view, 40) for x in wrap(line, 40, 4)]  # as format_status wraps them
    assert "  drafter weakest on source\n    /data/in/source-00.jsonl: 20% vs 75%\n    overall" in "\n".join(narrow)
    assert speculation_view(AcceptanceTable(), []) is None  # no figures: no section
