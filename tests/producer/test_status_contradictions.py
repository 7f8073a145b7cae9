"""Each contradiction `producer status` was seen to show mid-run, as a test (real Redis; snapshots
written by the real consumer telemetry, or as it writes them)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import redis

from genqueue.common import __version__
from genqueue.common.keepers.items import FAILED, IN_RUN, ItemTable
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.runs import CONSUMERS, RunStore, consumer_key, key_digest
from genqueue.common.records import ConsumerInfo
from genqueue.common.settings import RunSettings
from genqueue.consumer.engine.doctor import ConsumerView, Sample, diagnose
from genqueue.consumer.telemetry import Telemetry, progress_line
from genqueue.producer.status import format_status, run_status
from tests.producer.test_status_machine import RUN, InlineRq, Model, _record

KEYS = [f"{i:032x}" for i in range(12)]


def _run(conn: redis.Redis) -> None:
    RunStore(conn).create_or_check(RUN, RunSettings())
    ItemTable(conn, RUN).change([key_digest(k) for k in KEYS], add=IN_RUN)


def _consumer(conn: redis.Redis, name: str = "c1", spool: str = "/spool/a", skew: float = 0.0) -> Model:
    m = Model(name, spool, skew, phase=None)
    identity: ConsumerInfo = {"host": "node1", "gpu": 0, "worker": name, "endpoint": "http://e/v1"}
    m.telemetry = Telemetry(identity, conn, InlineRq(), m.parts(), gpus=1)  # type: ignore[arg-type]
    m.telemetry.spool = spool
    m.telemetry.start_run(RUN)
    return m


def _publish(m: Model, **kw: Any) -> None:
    assert m.telemetry is not None
    asyncio.run(m.telemetry.publish(**kw))


def _snap(conn: redis.Redis, worker: str, now: float, **fields: Any) -> None:
    s = {"worker": worker, "host": "node1", "gpu": 0, "last_seen": now - 1, "version": __version__,
         "in_flight": 0, "pending_items": 0, "paused": {}, "engine": {"metrics": False}, "shipping": {}, **fields}
    conn.set(consumer_key(worker), orjson.dumps(s))
    conn.zadd(CONSUMERS, {worker: now - 1})


def _ship(conn: redis.Redis, keys: list[str]) -> None:
    marks = ShardMarks()
    for k in keys:
        marks.add(k, error=False, kind="finished")
    Marks(conn, RUN).mark_shipped(marks)


def test_tokens_count_what_was_generated_before_any_ack(conn: redis.Redis) -> None:
    # was: "tokens  prompt 0, completion 0" beside "done 8" (tokens came only from acked jobs)
    _run(conn)
    m = _consumer(conn)
    m.jobs = {"j": None}  # type: ignore[dict-item]
    for k in KEYS[:8]:
        m.telemetry.record(RUN, _record(k, False, 50))  # type: ignore[union-attr]
    _publish(m)
    _ship(conn, KEYS[:8])
    r = run_status(conn, RUN)
    assert r["items_done"] == 8 and r["completion_tokens"] == 400 and r["prompt_tokens"] == 80
    assert "prompt 80, completion 400 generated (0 completion in acked jobs)" in format_status(r, color=False)


def test_an_eta_whenever_a_rate_is_shown(conn: redis.Redis) -> None:
    # was: "ETA - (no rate yet)" beside "last minute 0.3 items/s" (no job acked yet)
    _run(conn)
    _ship(conn, KEYS[:8])
    now = time.time()
    _snap(conn, "c1", now, runs={RUN: {"completions_per_s": 0.3, "completion_tokens_per_s": 68.0,
                                       "prompt_tokens_per_s": 5.0, "completions": 8, "completion_tokens": 400}})
    r = run_status(conn, RUN, now=now)
    text = format_status(r, color=False, width=None)
    assert "last minute 0.3 items/s" in text and r["eta_s"] is not None
    assert "ETA 0m 13s at 0.3 items/s (last minute)" in text, text  # 4 left at 0.3/s
    # a rate of nothing is no rate: no 0.0 items/s beside an ETA of -
    _snap(conn, "c1", now, runs={RUN: {"completions_per_s": 0.0, "completion_tokens_per_s": 0.0,
                                       "prompt_tokens_per_s": 0.0}})
    r = run_status(conn, RUN, now=now)
    assert r["eta_s"] is None and r["speed"]["note"] == "nothing answered in the last minute"


def test_in_flight_over_a_lowered_limit_is_said_so() -> None:
    # was: "in flight 158 of 12" (--concurrency auto lowered the limit under what was sent)
    snap: Any = {"runs": {}, "paused": {}, "in_flight": 158, "concurrency": 12, "held_jobs": 9,
                 "shipping": {"waiting_shards": 0}}
    line = progress_line(snap)
    assert "158 of 12" not in line and "in flight 158 (over its limit, lowered to 12" in line
    samples = [Sample(float(t), {"metrics": True, "running": 160.0, "waiting": 0.0},
                      ConsumerView(limit=12, auto=True, in_flight=158, pending=0, queue_depth=3)) for t in range(0, 30, 2)]
    advice = diagnose(samples).advice
    assert "158 in flight of 12" not in advice and "over its limit lowered to 12" in advice, advice


def test_gpu_hours_spent_never_go_down_when_consumers_drain(conn: redis.Redis) -> None:
    # was: GPU-hours 0.065 spent mid-run, then 0.00011 after the consumers drained (recomputed
    # from the snapshots, from the run's first ack on)
    _run(conn)
    m = _consumer(conn)
    m.jobs = {"j": None}  # type: ignore[dict-item]
    _publish(m)
    m.skew = 600.0  # ten minutes later, still holding the run's work
    m.telemetry.record(RUN, _record(KEYS[0], False, 50))  # type: ignore[union-attr]
    _publish(m)
    before = run_status(conn, RUN, now=time.time() + 600)["cost"]["gpu_hours_spent"]
    assert before >= 600 / 3600 * 0.99
    RunStore(conn).count_acked(RUN, {"items_done": 1}, time.time() + 590)  # the run's first ack: at the drain
    m.jobs = {}
    _publish(m, exited=True)
    after = run_status(conn, RUN, now=time.time() + 600)["cost"]["gpu_hours_spent"]
    assert after >= before, (before, after)


def test_spool_counts_drop_with_the_consumer_that_held_them(conn: redis.Redis) -> None:
    # was: "1 waiting on disk (oldest 0m 46s)" after B, restarted on A's spool, shipped it
    _run(conn)
    now = time.time()
    ship = {"shards": 0, "bytes": 0, "waiting_shards": 1, "unshipped_records": 3, "oldest_waiting_at": now - 46}
    _snap(conn, "a", now, started_at=now - 100, spool="/spool/a", runs={RUN: {"shipping": ship, "in_flight": 2}})
    _snap(conn, "b", now, started_at=now - 5, spool="/spool/a",
          runs={RUN: {"shipping": {"shards": 1, "bytes": 10, "waiting_shards": 0, "unshipped_records": 0}}})
    r = run_status(conn, RUN, now=now)
    assert r["shipping"]["waiting_shards"] == 0 and r["shipping"]["oldest_waiting_s"] is None
    assert r["items_in_flight"] == 0 and r["items_shipping"] == 0
    assert "0 waiting on disk" in format_status(r, color=False)
    # a consumer that drained (exited) takes its spool's figures along too
    _snap(conn, "b", now, started_at=now - 5, spool="/spool/b", exited=True,
          runs={RUN: {"shipping": {**ship, "shards": 2}}})
    _snap(conn, "a", now, started_at=now - 100, spool="/spool/a", runs={RUN: {"shipping": {"shards": 1}}})
    r = run_status(conn, RUN, now=now)
    assert r["shipping"]["waiting_shards"] == 0 and r["shipping"]["shards"] == 3


def test_the_tail_timer_is_the_runs_own() -> None:
    # was: "the run's tail ... for 228 s so far" on a run 70 s old: the last run's tail and the
    # idle spell after it counted
    def look(t: float, running: float, in_flight: int) -> Sample:
        return Sample(t, {"metrics": True, "running": running, "waiting": 0.0},
                      ConsumerView(limit=64, auto=False, in_flight=in_flight, pending=0, queue_depth=0))

    samples = [look(t, 2, 2) for t in range(0, 60, 2)]  # run A's tail
    samples += [look(t, 0, 0) for t in range(60, 160, 2)]  # idle
    samples += [look(t, 30, 30) for t in range(160, 200, 2)]  # run B, all its jobs taken at once
    samples += [look(t, 2, 2) for t in range(200, 230, 2)]  # run B's tail
    v = diagnose(samples)
    assert v.bound == "tail" and float(v.numbers["tail_seconds"] or 0) <= 70, v


def test_shipping_ages_are_in_redis_time(conn: redis.Redis) -> None:
    # was: each consumer's own clock: a node 100 s behind Redis showed its shard 146 s old
    _run(conn)
    now = time.time()
    node = now - 100
    ship = {"shards": 1, "bytes": 1, "waiting_shards": 1, "unshipped_records": 1, "oldest_waiting_at": node - 46,
            "last_upload_at": node - 10}
    _snap(conn, "c1", now, clock_offset=100.0, runs={RUN: {"shipping": ship}})
    r = run_status(conn, RUN, now=now)
    assert abs(r["shipping"]["oldest_waiting_s"] - 46) < 1, r["shipping"]
    assert "(oldest 0m 46s), last upload 0m 10s ago" in format_status(r, color=False)


def test_complete_only_when_no_item_failed(conn: redis.Redis) -> None:
    # was: "100.0%: 12 of 12 items; run complete" with 4 of them error records
    _run(conn)
    _ship(conn, KEYS[:8])
    marks = ShardMarks()
    for k in KEYS[8:]:
        marks.add(k, error=True, kind="transient_exhausted")
    Marks(conn, RUN).mark_shipped(marks)
    progress = next(x for x in format_status(run_status(conn, RUN), color=False).splitlines()
                    if x.startswith("progress"))
    assert "run complete" not in progress and "NOT complete: 4 items failed" in progress, progress
    _run(conn)
    ItemTable(conn, RUN).change([key_digest(k) for k in KEYS[8:]], clear=FAILED)
    _ship(conn, KEYS[8:])
    assert "run complete" in format_status(run_status(conn, RUN), color=False)
