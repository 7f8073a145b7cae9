"""Status numbers for a run in a known state (real Redis, snapshots written as consumers do)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from genqueue.common import __version__
from genqueue.common.eta import RateWindow, Sample, format_duration
from genqueue.common.keepers.items import DONE, FAILED, IN_RUN, ItemTable
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.outcomes import outcome_view
from genqueue.common.keepers.runs import CONSUMERS, RunStore, consumer_key, key_digest
from genqueue.common.keepers.runsources import RunSources
from genqueue.common.settings import RunSettings
from genqueue.consumer.engine.readings import engine_view, parse_prometheus
from genqueue.producer.export.parts import tool_turns_code
from genqueue.producer.status import format_status, run_status
from genqueue.producer.status.figures import eta_view, placement
from genqueue.producer.status.report import Rates
from tests.conftest import cli


def test_eta_arithmetic() -> None:
    # 1,000 items left, 500 tokens per item on average (500,000 tokens left), 2,500 tokens/s -> 200 s
    rates: Rates = {"completions_per_s": 5.0, "completion_tokens_per_s": 2500.0, "prompt_tokens_per_s": 0.0}
    assert eta_view(1000, 500_000.0, True, rates, None) == (pytest.approx(200.0), "completion_tokens")
    assert eta_view(0, 0.0, True, rates, None) == (0.0, None)
    assert eta_view(5, 50.0, True, rates, "nothing shipped yet") == (None, None)
    assert eta_view(5, None, False, rates, None) == (1.0, "items")  # no token to go by: the items rate
    assert format_duration(200) == "3m 20s" and format_duration(90061) == "1d 1h 01m"


def test_rate_window_spans_the_last_minute() -> None:
    w = RateWindow(60)
    for t in range(0, 121, 2):
        w.add(Sample(float(t), t * 10, t * 100, t * 50))
    r = w.rates()
    assert r["completions_per_s"] == pytest.approx(10.0)
    assert r["completion_tokens_per_s"] == pytest.approx(50.0)
    assert w.samples[-1].t - w.samples[0].t <= 62


def test_engine_metrics_parsing() -> None:
    text = """# HELP vllm:num_requests_running x
vllm:num_requests_running{model_name="m"} 250.0
vllm:num_requests_waiting{model_name="m"} 12.0
vllm:kv_cache_usage_perc{model_name="m"} 0.91
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 300
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 400
"""
    assert parse_prometheus(text)["vllm:num_requests_waiting"] == 12.0
    v = engine_view(text)
    assert v["running"] == 250 and v["kv_cache_usage"] == 0.91 and v["spec_acceptance"] == pytest.approx(0.75)
    assert engine_view(None) == {"metrics": False}
    assert engine_view("vllm:gpu_cache_usage_perc 0.5\n")["kv_cache_usage"] == 0.5


@pytest.mark.integration
def test_status_of_a_run_in_known_state(conn: redis.Redis) -> None:
    store = RunStore(conn)
    settings = RunSettings()
    store.create_or_check("known", settings)
    ItemTable(conn, "known").change([key_digest(f"{i:032x}") for i in range(1000)], add=IN_RUN)
    # progress comes from the marks the consumers write when a shard ships
    ItemTable(conn, "known").change([key_digest(f"{i:032x}") for i in range(380)], add=DONE)
    ItemTable(conn, "known").change([key_digest(f"{i:032x}") for i in range(380, 400)], add=FAILED)
    store.record_source("known", "/data/x.jsonl", {"records": 1010, "rejected_by_reason": {"invalid_json": 10}})
    conn.hset(run_key("known", "stats"), mapping={"items_done": 380, "items_failed": 20, "completion_tokens": 190_000,
                                                   "prompt_tokens": 40_000, "outcome_finished": 370,
                                                   "outcome_cut_in_answer": 10,
                                                   "failed_permanent": 20})
    now = time.time()
    conn.hset(run_key("known"), "started_at", repr(now - 100))

    def snap(worker: str, gpu: int, age: float, rate: float, version: str = __version__,
             fp: str = settings.fingerprint, copies: dict[str, int] | None = None) -> None:
        s = {"worker": worker, "host": "node1", "gpu": gpu, "last_seen": now - age, "version": version,
             "in_flight": 50, "pending_items": 14, "stopping": False,
             "paused": {"endpoint_down": False, "spool_full": False},
             "runs": {"known": {"fingerprint": fp, "completions_per_s": rate / 500,
                                "completion_tokens_per_s": rate, "prompt_tokens_per_s": rate / 5}},
             "engine": {"metrics": True, "running": 48, "waiting": 3, "kv_cache_usage": 0.8, "spec_decode": False},
             "shipping": {"shards": 4, "bytes": 2_000_000, "waiting_shards": 1, "last_upload_at": now - 5},
             **({"copies": copies} if copies is not None else {})}
        conn.set(f"genqueue:consumer:{worker}", orjson.dumps(s))
        conn.zadd("genqueue:consumers", {worker: now - age})

    snap("w0", 0, 1, 1500.0, copies={"sent": 9, "shipped": 7, "dropped": 1, "yielded": 1,
                                                "ended_elsewhere": 2})
    snap("w1", 1, 2, 1500.0, version="9.9.9", copies={"sent": 0, "shipped": 0, "dropped": 0, "ended_elsewhere": 0})
    snap("w2", 2, 300, 9999.0)  # stopped reporting five minutes ago: not in the rate
    r = run_status(conn, "known", now=now)
    assert r["items"] == 1000 and r["records"] == 1010 and r["rejected"] == 10
    # no rq job is queued, so no item is: the rest are elsewhere (here: in no job at all)
    assert r["items_in_flight"] == 128 and r["items_queued"] == 0 and r["items_elsewhere"] == 1000 - 400 - 128
    assert r["speed"]["last_minute"]["completion_tokens_per_s"] == pytest.approx(3000.0)
    # 600 items left x (190,000 / 380 = 500 tokens each) / 3,000 tok/s = 100 s
    assert r["eta_s"] == pytest.approx(100.0)
    assert r["speed"]["run_average"]["completions_per_s"] == pytest.approx(4.0, rel=0.01)
    assert [d for d in r["drift"] if "w1" in d and "9.9.9" in d]
    assert not [d for d in r["drift"] if "w0" in d]
    text = format_status(r)
    assert "STOPPED REPORTING" in text and "w2" in text and "DRIFT" in text and "1m 40s" in text
    # what w2 shipped stays shipped; its spool's shard left with it (it reports no more)
    assert "12 shards, 6.0 MB shipped, 2 waiting on disk" in text and "KV 80%" in text
    # end-of-run copies: a line under the consumer that made some, none under those that did not
    copies = [line.strip() for line in text.splitlines() if line.strip().startswith("copies:")]
    assert copies == ["copies: 9 sent (7 written, 1 failed, 1 gave way), 2 of its own items ended by others"], text
    assert [c["copies"] for c in r["consumers"] if c["worker"] == "w0"] == [
        {"sent": 9, "shipped": 7, "dropped": 1, "yielded": 1, "ended_elsewhere": 2}]


SECRET = "hunter2-s3cr3t"


def publish(conn: redis.Redis, worker: str, now: float, shipping: dict[str, Any], run: str = "ship") -> None:
    """A consumer's snapshot, as consumer/telemetry.py writes it."""
    snap = {"worker": worker, "host": "node1", "gpu": 0, "last_seen": now - 1, "version": __version__,
            "in_flight": 0, "pending_items": 0, "paused": {"endpoint_down": False, "spool_full": False},
            "runs": {run: {"completions_per_s": 0.0, "completion_tokens_per_s": 0.0}},
            "engine": {"metrics": False}, "shipping": shipping}
    conn.set(consumer_key(worker), orjson.dumps(snap))
    conn.zadd(CONSUMERS, {worker: now - 1})


@pytest.mark.integration
def test_shipping_errors_and_stalled_shards_are_on_screen_without_secrets(conn: redis.Redis, redis_url: str) -> None:
    RunStore(conn).create_or_check("ship", RunSettings(output="s3://bucket/out"))
    conn.hset(run_key("ship", "warnings"), "w1", f"endpoint http://admin:{SECRET}@gpu-node:8000/v1 is slow")
    now = time.time()
    url = (f"http://minio:{SECRET}@s3.internal:9000/bucket/out/ship/shards/w0-000003.jsonl"
           f"?X-Amz-Signature={SECRET}&partNumber=2")
    publish(conn, "w0", now, {"shards": 2, "bytes": 3_000_000, "waiting_shards": 4, "last_upload_at": now - 950,
                              "last_error": f'EndpointConnectionError: Could not connect to the endpoint URL: "{url}"',
                              "last_error_at": now - 42, "oldest_waiting_at": now - 900})
    # a consumer of the first snapshot shape: a text error, no timestamps
    publish(conn, "w1", now, {"shards": 1, "bytes": 1_000_000, "waiting_shards": 0, "last_upload_at": now - 5,
                              "last_error": "timed out"})
    r = run_status(conn, "ship", now=now)
    ship = r["shipping"]
    assert ship["stalled"] and ship["oldest_waiting_s"] == pytest.approx(900) and ship["waiting_shards"] == 4
    assert [(e["worker"], e["class"]) for e in ship["errors"]] == [("w0", "EndpointConnectionError"), ("w1", "error")]
    assert ship["errors"][0]["age_s"] == pytest.approx(42) and ship["errors"][1]["age_s"] is None
    text = format_status(r, color=False)
    lines = text.splitlines()
    ship_line = next(x for x in lines if x.startswith("shipping"))
    assert "3 shards, 4.0 MB shipped, 4 waiting on disk (oldest 15m 00s)" in ship_line
    assert lines[lines.index(ship_line) + 1].split() == ["STALLED:", "shards", "waiting", "over", "5m", "00s"]
    w0 = lines[lines.index(ship_line) + 2]
    assert w0.split()[:7] == ["w0", "last", "shipping", "error", "(0m", "42s", "ago)", "EndpointConnectionError:"][:7]
    assert "EndpointConnectionError: Could not connect" in w0 and len(w0) <= 100
    wide = format_status(r, color=False, width=None).splitlines()
    assert "***@s3.internal:9000" in next(x for x in wide if x.startswith("  w0"))
    assert "last shipping error error: timed out" in lines[lines.index(ship_line) + 3]
    assert "\x1b[" not in text
    painted = format_status(r, color=True).splitlines()
    red = [x for x in painted if x.startswith("\x1b[31m")]
    # the line, its STALLED row and its errors
    assert len(red) == 4 and "shipping" in red[0] and "STALLED" in red[1] and "w0" in red[2]
    # --json and a pipe (not a terminal): plain, and no secret anywhere
    out = cli("producer", "status", "--run", "ship", env={"REDIS_URL": redis_url}).stdout
    as_json = cli("producer", "status", "--run", "ship", "--json", env={"REDIS_URL": redis_url}).stdout
    for shown in (text, "\n".join(painted), orjson.dumps(r).decode(), out, as_json):
        assert SECRET not in shown
    assert "\x1b[" not in out and "STALLED" in out and "\x1b[" not in as_json
    assert orjson.loads(as_json)["shipping"]["stalled"] is True


@pytest.mark.integration
def test_shards_waiting_briefly_are_not_an_alarm(conn: redis.Redis) -> None:
    RunStore(conn).create_or_check("ship", RunSettings())
    now = time.time()
    publish(conn, "w0", now, {"shards": 1, "bytes": 10, "waiting_shards": 2, "last_upload_at": now - 3,
                              "last_error": None, "last_error_at": None, "oldest_waiting_at": now - 12})
    r = run_status(conn, "ship", now=now)
    assert not r["shipping"]["stalled"] and r["shipping"]["errors"] == []
    text = format_status(r, color=True)
    assert "\x1b[" not in text and "STALLED" not in text and "2 waiting on disk (oldest 0m 12s)" in text


@given(st.integers(0, 500), st.integers(0, 500), st.integers(0, 500), st.integers(0, 500), st.integers(0, 500),
       st.integers(0, 50))
def test_every_item_is_in_one_place(items: int, done: int, failed: int, in_flight: int, unshipped: int,
                                    jobs_queued: int) -> None:
    done, failed = min(done, items), min(failed, max(items - done, 0))
    where = placement(items, done, failed, in_flight, unshipped, jobs_queued)
    assert sum(where.values()) == items and min(where.values()) >= 0
    remaining = items - done - failed
    assert (where["queued"] == 0) == (jobs_queued == 0 or remaining == where["shipping"])


@pytest.mark.integration
def test_outcomes_are_counted_with_the_marks_once(conn: redis.Redis) -> None:
    """The marks' script counts each item once, by its outcome: a shard shipped twice (a
    leftover shipped again) or an error record of an item with a result counts nothing more."""
    marks = ShardMarks()
    for i, outcome in enumerate(["finished", "finished", "cut_in_answer", "partial"]):
        marks.add(f"{i:032x}", error=False, kind=outcome, turns=2)
    Marks(conn, "cnt").mark_shipped(marks)
    Marks(conn, "cnt").mark_shipped(marks)
    errors = ShardMarks()
    errors.add(f"{0:032x}", error=True, kind="permanent")  # item 0 has a result: counted nowhere
    errors.add(f"{9:032x}", error=True, kind="transient_exhausted")
    Marks(conn, "cnt").mark_shipped(errors)
    stats = RunStore(conn).stats("cnt")
    assert stats["shipped_turns"] == 8  # two turns each, counted once
    view = outcome_view(stats, 4, 1)
    assert (view["complete"], view["partial"], view["cut"], view["outcomes_counted"]) == (2, 1, 1, 4)
    assert view["failed_by_class"] == {"transient_exhausted": 1} and view["cut_by_outcome"] == {"cut_in_answer": 1}


def _conversation(i: int, **fields: Any) -> dict[str, Any]:
    """A regenerate result record of item I (the fields the marks read), with FIELDS."""
    return {"key": f"{i:032x}", "outcome": "finished", "turns": [{"turn": 0, "tool_results_spliced": True},
                                                                 {"turn": 0, "step": 1}], **fields}


@pytest.mark.integration
def test_tool_turns_are_counted_with_the_marks_once_in_exports_words(conn: redis.Redis) -> None:
    """What became of each conversation's recorded tool turns is counted as its shard ships, by
    the rule export counts by (marks.record_tool_turns), once however often the shard ships."""
    diverged = {"note": "tool_call_diverged", "stopped": {"turn": 0, "reason": "tool_call_diverged"}}
    recs = [_conversation(0), _conversation(1), _conversation(2, **diverged),
            _conversation(3, note="stopped_at_tool_turn"),
            _conversation(4, outcome="partial", stopped={"turn": 0, "step": 1, "reason": "error"}),
            {"key": f"{5:032x}", "outcome": "finished", "turns": [{"turn": 0}]},  # no tool turns
            {"key": f"{6:032x}", "outcome": "finished", "content": "x"}]  # not regenerate
    marks = ShardMarks()
    for rec in recs:
        marks.add_record(rec)
    Marks(conn, "tools").mark_shipped(marks)
    Marks(conn, "tools").mark_shipped(marks)  # a leftover shipped again counts nothing more
    view = outcome_view(RunStore(conn).stats("tools"), len(recs), 0)
    counted = (view["tool_turns_to_end"], view["tool_call_diverged"], view["stopped_at_tool_turn"])
    assert counted == (2, 1, 2)
    # export's codes from the same rule: to the end 1, diverged 2, stopped 3
    assert [tool_turns_code(r) for r in recs] == [1, 1, 2, 3, 3, 0, 0]  # type: ignore[arg-type]
    assert view["complete"] == 6 and view["partial"] == 1  # a diverged conversation ends complete


@pytest.mark.integration
def test_an_input_still_being_read_is_said(conn: redis.Redis) -> None:
    RunStore(conn).create_or_check("rd", RunSettings())
    now = time.time()
    RunSources(conn, "rd").start_reading("/data/part-2.jsonl", now - 65)
    r = run_status(conn, "rd", now=now)
    assert r["input"]["reading"] == {"/data/part-2.jsonl": pytest.approx(now - 65)} and not r["input"]["complete"]
    row = next(x for x in format_status(r, color=False).splitlines() if x.startswith("input"))
    assert "part-2.jsonl: still reading (an enqueue began 1m 05s ago)" in row
    RunSources(conn, "rd").end_reading("/data/part-2.jsonl")
    assert run_status(conn, "rd", now=now)["input"]["reading"] == {}
