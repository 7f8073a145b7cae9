"""Speculative-decoding figures end to end on the stand-in (issue 33): `producer enqueue`, the
stand-in speculating with a planted weak category, `consumer run --burst`, the records read back
(real Redis, the stand-in as its own process)."""

from __future__ import annotations

import pytest

from genqueue.common.records import spec_rate, sum_spec
from genqueue.consumer.sim.kv import spec_yield
from tests.consumer.e2e import Sim
from tests.vllm.pipeline import assert_all_done, consume, enqueue, results

pytestmark = pytest.mark.integration


def _conversation(i: int, weak: bool) -> dict[str, object]:
    tag = "[weak]" if weak else "[plain]"
    return {"id": f"r{i}", "conversations": [
        {"from": "human", "value": f"{tag} question {i}"}, {"from": "gpt", "value": "old"},
        {"from": "human", "value": f"{tag} follow-up {i}"}, {"from": "gpt", "value": "old"}]}


def test_every_turn_carries_its_figures_and_the_weak_category_shows_at_its_planted_rate(tmp_path, redis_url, conn):
    (tmp_path / "spec").mkdir()
    sim = Sim(tmp_path / "spec", "--mean-tokens", "120", "--spec-tokens", "3", "--spec-acceptance", "0.8",
              "--spec-acceptance-for", "text=[weak]:0.4", "--per-request-spec-decode-metrics", "summary")
    try:
        enqueue(tmp_path, redis_url, "spec", [_conversation(i, weak=i % 2 == 1) for i in range(120)],
                "--max-tokens", "400")
        c = consume(tmp_path, redis_url, sim.url, "spec")
    finally:
        sim.stop()
    recs = results(tmp_path, "spec")
    assert_all_done(conn, "spec", recs, jobs=15)
    assert "the engine speculates, 3 draft tokens per step" in c.output()
    by = {"weak": [], "plain": []}
    for r in recs:
        assert r["turns"] and all(t["spec"]["k"] == 3 for t in r["turns"])  # a cut turn ends a conversation
        assert r["spec"] == sum_spec([t["spec"] for t in r["turns"]])
        by["weak" if "[weak]" in r["messages"][0]["content"] else "plain"].append(r["spec"])
    for name, p in (("plain", 0.8), ("weak", 0.4)):
        total = sum_spec(by[name])
        assert total is not None and len(by[name]) == 60
        assert spec_rate(total) == pytest.approx(spec_yield(3, p) / 3, rel=0.05), name


def test_an_engine_that_speculates_without_per_request_figures_is_named_once_and_nothing_fails(
        tmp_path, redis_url, conn):
    (tmp_path / "nofig").mkdir()
    sim = Sim(tmp_path / "nofig", "--mean-tokens", "40", "--spec-tokens", "3")  # vLLM's default: none
    try:
        enqueue(tmp_path, redis_url, "nofig", [_conversation(i, weak=False) for i in range(8)])
        c = consume(tmp_path, redis_url, sim.url, "nofig")
    finally:
        sim.stop()
    recs = results(tmp_path, "nofig")
    assert_all_done(conn, "nofig", recs, jobs=1)
    assert all("spec" not in r and all("spec" not in t for t in r["turns"]) for r in recs)
    lines = [line for line in c.output().splitlines() if "--per-request-spec-decode-metrics" in line]
    assert len(lines) == 1 and "WARNING" in lines[0]
    assert lines[0].endswith("the engine speculates (its /metrics has spec_decode counters) but its answers carry "
                             "no per-request figures, so none is recorded: start vLLM with "
                             "--per-request-spec-decode-metrics summary")
