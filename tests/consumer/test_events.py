"""The consumer's named events (consumer/events.py): a listener that raises is logged, counted and
isolated (the consumer and the other listeners go on), a duty's error reaches the part that
reported; and each event is reported where the part's callback was, heard by the listeners that
were wired by hand before (telemetry, the copies' rate, the breaker)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import redis
from prometheus_client import REGISTRY

from genqueue.common.keepers.marks import ShardMarks
from genqueue.common.records import Record
from genqueue.consumer.answer.checkpoints import Checkpoints
from genqueue.consumer.answer.client import EndpointClient
from genqueue.consumer.config import ConsumerConfig
from genqueue.consumer.events import Events
from genqueue.consumer.worker import Consumer
from tests.doubles import item, result


def a_record(latency_s: float | None = None) -> Record:
    """A result of 5 completion tokens (taking LATENCY_S, when given)."""
    rec = result(item(0))
    return rec if latency_s is None else {**rec, "timings": {"latency_s": latency_s}}  # type: ignore[typeddict-item]


def failures(event: str) -> float:
    return REGISTRY.get_sample_value("genqueue_observer_failures_total", {"event": event}) or 0.0


def test_a_listener_that_raises_is_logged_counted_and_the_others_still_hear(caplog: pytest.LogCaptureFixture) -> None:
    ev = Events()
    heard: list[tuple[str, str]] = []

    class Broken:
        def record(self, run: str, rec: Record) -> None:
            raise RuntimeError("a bug in an observer")

    ev.recorded.duty(lambda run, rec: heard.append(("duty", run)))
    ev.recorded.add(Broken().record)
    ev.recorded.add(lambda run, rec: heard.append(("after", run)))
    before = failures("recorded")
    with caplog.at_level(logging.ERROR, logger="genqueue.consumer.events"):
        for _ in range(12):
            ev.recorded("r", a_record())  # never raises to the dispatcher that reports it
    assert heard == [("duty", "r"), ("after", "r")] * 12
    assert ev.failures.counts == {("recorded", "test_a_listener_that_raises_is_logged_counted_and_the_others_still_"
                                               "hear.<locals>.Broken.record"): 12}
    assert failures("recorded") - before == 12
    lines = [r for r in caplog.records if r.name == "genqueue.consumer.events"]
    # the first with its traceback, then the 10th (100th, ...) with the count: never a line a record
    assert len(lines) == 2 and lines[0].exc_info is not None and "Broken.record" in lines[0].getMessage()
    assert "'recorded'" in lines[0].getMessage() and "has failed 10 times" in lines[1].getMessage()
    assert "RuntimeError: a bug in an observer" in lines[1].getMessage()


def test_an_awaited_event_isolates_its_listeners_but_not_its_duty(caplog: pytest.LogCaptureFixture) -> None:
    ev = Events()
    heard: list[str] = []

    async def broken(run: str, seq: int | None, marks: ShardMarks) -> None:
        raise ValueError("odd content under a key")

    async def counts(run: str, seq: int | None, marks: ShardMarks) -> None:
        heard.append(f"{run}:{seq}")

    ev.shipped.add(broken)
    ev.shipped.add(counts)
    with caplog.at_level(logging.ERROR, logger="genqueue.consumer.events"):
        asyncio.run(ev.shipped("r", 3, ShardMarks()))
    assert heard == ["r:3"] and ev.failures.counts[("shipped", broken.__qualname__)] == 1
    assert any("ValueError: odd content under a key" in r.getMessage() or r.exc_info for r in caplog.records)

    async def acks(run: str, seq: int | None, marks: ShardMarks) -> None:
        raise ConnectionError("Redis went away")  # the outbox's shipper meets it, as before

    ev.shipped.duty(acks)
    with pytest.raises(ConnectionError):
        asyncio.run(ev.shipped("r", 4, ShardMarks()))
    assert heard == ["r:3"], "an event whose duty failed is not heard by its listeners"
    with pytest.raises(ValueError, match="has a duty already"):
        ev.shipped.duty(acks)
    with pytest.raises(asyncio.CancelledError):  # a cancel is never taken for a listener's failure
        async def cancelled(run: str, seq: int | None, marks: ShardMarks) -> None:
            raise asyncio.CancelledError
        other = Events()
        other.shipped.add(cancelled)
        asyncio.run(other.shipped("r", 5, ShardMarks()))


@pytest.mark.integration
def test_each_event_is_reported_where_its_callback_was_and_heard_as_before(tmp_path: Path, redis_url: str) -> None:
    cfg = ConsumerConfig(endpoint="http://127.0.0.1:9/v1", redis_url=redis_url, spool=str(tmp_path))
    c = Consumer(cfg, redis.Redis.from_url(redis_url))  # rq's worker names its connection at once

    async def main() -> None:
        parts = c._assemble(EndpointClient(cfg.endpoint), Checkpoints(cfg.redis_url, 4))
        ev = c.events
        # each part reports where its on_* callback went before, now the event of that name
        reported = {
            "shipped": c.outbox._on_shipped, "shard_lost": c.outbox._on_lost, "run_gone": c.outbox._on_no_run,
            "features_shipped": c.outbox._on_features, "recorded": parts.dispatcher._on_record,
            "ended_elsewhere": parts.dispatcher._on_won, "arrived_done": parts.intake._on_complete,
            "runs_resolved": parts.intake._on_runs, "limit_raised": parts.steering._on_grow,
            "swept": parts.leases._on_swept,
        }
        assert {name: hook.name for name, hook in reported.items()} == {name: name for name in reported}
        assert all(hook is getattr(ev, name) for name, hook in reported.items())
        # the consumer's own duties, as its callbacks did them
        duties = {h.name: getattr(h._duty, "__qualname__", None) for h in ev.hooks()}
        assert duties == {
            "recorded": None, "shipped": "Settler.shipped", "features_shipped": None,
            "shard_lost": "Settler.shard_lost", "run_gone": "Settler.run_gone",
            "ended_elsewhere": "Settler.ended_elsewhere", "arrived_done": "Settler.arrived_done",
            "runs_resolved": "Outbox.unpark", "swept": "Event.set", "limit_raised": "Event.set",
            "phase": None, "serving": None}
        # the listeners, in the order _on_record called them before
        assert ev.recorded.listeners == [parts.telemetry.record, parts.copier.recorded, c._check_breaker]
        assert ev.features_shipped.listeners == [c._count_features]
        assert ev.phase.listeners == [parts.telemetry.set_phase] and ev.serving.listeners == [parts.telemetry.start_run]
        # and heard: a record is counted by telemetry and feeds the copies' rate
        parts.dispatcher._on_record("r", a_record(latency_s=0.5))
        assert parts.telemetry.totals["r"]["completions"] == 1 and parts.copier.rate.value == 10.0
        ev.phase("pre-flight")
        assert parts.telemetry.snapshot()["phase"] == "pre-flight"
        ev.serving("s")
        assert "s" in parts.telemetry.totals
        c.wake.clear()
        parts.leases._on_swept()
        assert c.wake.is_set()
        assert ev.failures.counts == {}

    try:
        asyncio.run(main())
    finally:
        c.rq.close()
        c._snap_rq.close()
        c.outbox.close()
