"""The consumer's parts in-process, with fakes: the book, the dispatcher's item guard, the
acker, leases, the outbox's ship outcomes, and supervision. No Redis, no HTTP."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from genqueue.common.contracts import ErrorClass, Item, ResultRecord
from genqueue.common.marks import ShardMarks
from genqueue.common.settings import RunSettings
from genqueue.common.storage import LocalStore
from genqueue.consumer.acker import Acker
from genqueue.consumer.admission import Limiter
from genqueue.consumer.book import Book, JobState
from genqueue.consumer.breaker import Breaker, BreakerSettings
from genqueue.consumer.dispatch import Dispatcher
from genqueue.consumer.generate import RunContext
from genqueue.consumer.intake import InvalidJob, parse_items
from genqueue.consumer.leases import Leases
from genqueue.consumer.outbox import Outbox
from genqueue.consumer.rqthread import RqThread
from genqueue.consumer.supervise import LoopFailed, supervised

CTX = RunContext("r", RunSettings(), "m", {"host": "h", "gpu": None, "worker": "w", "endpoint": "e"})


def item(i: int, text: str = "hi") -> Item:
    return {"key": f"{i:032x}", "index": i, "turn": None, "messages": [{"role": "user", "content": text}]}


def job(jid: str, n: int, start: int = 0) -> JobState[Any]:
    return JobState(jid, object(), CTX, [item(start + i) for i in range(n)], 1, None)


def result(it: Item) -> ResultRecord:
    return {"key": it["key"], "index": it["index"], "turn": None, "run": "r", "messages": it["messages"],
            "sampling": {}, "fingerprint": "f", "version": "v", "consumer": CTX.consumer, "attempt": 1,
            "content": "ok", "reasoning": None, "reasoning_form": "none", "tool_calls": [],
            "finish_reason": "stop", "outcome": "finished", "usage": {"prompt_tokens": 3, "completion_tokens": 5},
            "model": "m"}


# --- book ------------------------------------------------------------------------------
def test_book_acks_only_complete_jobs_whose_last_shard_shipped() -> None:
    book: Book[Any] = Book()
    a, b = job("a", 2), job("b", 1, start=10)
    book.hold(a)
    book.hold(b)
    taken = [book.take() for _ in range(3)]
    assert book.take() is None and book.in_flight == 3
    for seq, t in zip((1, 2, 2), taken, strict=True):
        assert t is not None
        book.answered(t[0])
        book.recorded(t[0], result(t[1]), seq)
    assert a.complete and b.complete and a.max_seq == 2 and b.max_seq == 2
    assert book.ackable("r", 1) == []
    assert {js.id for js in book.ackable("r", 2)} == {"a", "b"}
    assert a.counts["items_done"] == 2 and a.counts["completion_tokens"] == 10


def test_book_lost_shard_abandons_its_jobs_and_their_waiting_items() -> None:
    book: Book[Any] = Book()
    a, b = job("a", 3), job("b", 3, start=10)
    book.hold(a)
    book.hold(b)
    t = book.take()
    assert t is not None and t[0] is a
    book.answered(a)
    book.recorded(a, result(t[1]), 4)
    lost = book.lose_shard("r", 4)
    assert lost == [a] and a.abandoned and "a" not in book.jobs
    # a's two waiting items are gone; b's three remain
    left = [book.take() for _ in range(4)]
    assert [x[0].id for x in left if x] == ["b", "b", "b"]


# --- dispatcher: the item guard ----------------------------------------------------------
class FakeGate:
    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.up.set()
        self.paused = False


class FakeOutbox:
    spool_limit = 1 << 30
    spool_bytes = 0

    def __init__(self) -> None:
        self.records: list[Any] = []

    def full(self) -> bool:
        return False

    def append(self, run: str, rec: Any) -> int:
        self.records.append(rec)
        return 1


class ExplodingGenerator:
    """Answers every item, except that item 1 raises like a bug would."""

    async def answer(self, ctx: RunContext, it: Item, *, attempt: int, enqueued_at: float | None) -> Any:
        await asyncio.sleep(0)
        if it["index"] == 1:
            raise TypeError("'NoneType' object is not subscriptable")
        return result(it)


def test_an_item_that_raises_becomes_an_internal_error_record_and_its_job_completes() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        js = job("a", 3)
        book.hold(js)
        outbox = FakeOutbox()
        stopping, wake = asyncio.Event(), asyncio.Event()
        seen: list[Any] = []
        d = Dispatcher(book, Limiter(8), FakeGate(), outbox, ExplodingGenerator(),  # type: ignore[arg-type]
                       on_record=lambda run, rec: seen.append(rec), wake=wake, stopping=stopping,
                       low_water=lambda: 8)
        task = asyncio.create_task(d.run())
        for _ in range(200):
            if js.complete:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        assert js.complete, "the job must complete although one item raised"
        errors = [r for r in outbox.records if "error" in r]
        assert len(outbox.records) == 3 and len(errors) == 1
        assert errors[0]["error"]["class"] == ErrorClass.INTERNAL
        assert "TypeError" in errors[0]["error"]["message"] and errors[0]["key"] == item(1)["key"]
        assert js.counts["failed_internal"] == 1 and d.internal_errors == 1 and book.in_flight == 0
        assert len(seen) == 3

    asyncio.run(scenario())


# --- acker ---------------------------------------------------------------------------------
class FakeWorker:
    name = "w"

    def __init__(self, ours: bool = True) -> None:
        self.ours = ours
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def finish(self, held: Any, manifest: dict[str, Any]) -> bool:
        self.calls.append(("finish", held, manifest))
        return self.ours

    def fail(self, held: Any, reason: str, *, retry: bool) -> None:
        self.calls.append(("fail", held, {"reason": reason, "retry": retry}))

    def give_back(self, held: Any) -> None:
        self.calls.append(("give_back", held, {}))

    def renew(self, held: list[Any]) -> list[Any]:
        return [h for h in held if getattr(h, "swept", False)]


class FakePipe:
    def __init__(self) -> None:
        self.ops: list[tuple[Any, ...]] = []

    def __enter__(self) -> FakePipe:  # noqa: PYI034 - a fake for one test
        return self

    def __exit__(self, *a: object) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kw: self.ops.append((name, *args))

    def execute(self) -> list[Any]:
        return []


class FakeConn:
    def __init__(self) -> None:
        self.pipe = FakePipe()

    def pipeline(self) -> FakePipe:
        return self.pipe


class Held:
    def __init__(self, jid: str) -> None:
        self.id = jid
        self.swept = False

        class _Job:
            started_at = None

        self.job = _Job()


def held_job(jid: str, n: int) -> JobState[Any]:
    return JobState(jid, Held(jid), CTX, [item(i) for i in range(n)], 1, None)


def complete(book: Book[Any], js: JobState[Any], seq: int) -> None:
    book.hold(js)
    while (t := book.take()) is not None:
        book.answered(t[0])
        book.recorded(t[0], result(t[1]), seq)


def test_acker_acks_shipped_jobs_and_counts_run_stats() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        w, conn, rq = FakeWorker(), FakeConn(), RqThread()
        acker = Acker(rq, w, conn, book)  # type: ignore[arg-type]
        js = held_job("a", 2)
        complete(book, js, 3)
        assert await acker.shipped("r", 2) == 0  # its last shard (3) is not shipped yet
        assert await acker.shipped("r", 3) == 1
        assert [c[0] for c in w.calls] == ["finish"] and w.calls[0][2]["items_done"] == 2
        assert ("hincrby", "genqueue:run:r:stats", "items_done", 2) in conn.pipe.ops
        assert len(book) == 0 and acker.snapshot().acked == 1
        rq.close()

    asyncio.run(scenario())


def test_a_zombie_ack_is_refused_and_forgotten() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        w, conn, rq = FakeWorker(ours=False), FakeConn(), RqThread()
        acker = Acker(rq, w, conn, book)  # type: ignore[arg-type]
        complete(book, held_job("a", 1), 1)
        assert await acker.shipped("r", 1) == 0
        assert conn.pipe.ops == [], "no run stats for an ack that did not happen"
        assert len(book) == 0 and acker.snapshot().lease_lost == 1
        rq.close()

    asyncio.run(scenario())


def test_a_lost_shard_sends_its_jobs_back_with_a_retry_spent() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        w, conn, rq = FakeWorker(), FakeConn(), RqThread()
        acker = Acker(rq, w, conn, book)  # type: ignore[arg-type]
        complete(book, held_job("a", 1), 5)
        complete(book, held_job("b", 1), 2)
        assert await acker.shard_lost("r", 5) == 1
        fails = [c for c in w.calls if c[0] == "fail"]
        assert len(fails) == 1 and fails[0][1].id == "a" and fails[0][2]["retry"] is True
        assert "shard 5" in fails[0][2]["reason"]
        assert list(book.jobs) == ["b"]
        rq.close()

    asyncio.run(scenario())


# --- leases --------------------------------------------------------------------------------
def test_renewal_drops_leases_found_swept() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        rq = RqThread()
        a, b = held_job("a", 2), held_job("b", 2)
        book.hold(a)
        book.hold(b)
        b.held.swept = True
        leases = Leases(rq, FakeWorker(), book, lease=30, runs=list, on_swept=lambda: None)  # type: ignore[arg-type]
        assert await leases.renew_once() == 1
        assert list(book.jobs) == ["a"] and b.abandoned
        assert [t[0].id for t in iter(book.take, None)] == ["a", "a"]
        rq.close()

    asyncio.run(scenario())


# --- outbox: an explicit outcome per shard ------------------------------------------------
def test_a_vanished_shard_is_lost_not_shipped_and_a_gone_run_keeps_its_shard(tmp_path: Path) -> None:
    async def scenario() -> None:
        events: list[tuple[str, str, int]] = []

        async def output_of(run: str) -> str | None:
            return str(tmp_path / "out") if run == "r" else None

        async def shipped(run: str, seq: int | None, marks: ShardMarks) -> None:
            assert marks.done == [bytes.fromhex(item(2)["key"])] and marks.failed == []
            events.append(("shipped", run, seq or 0))

        async def lost(run: str, seq: int) -> None:
            events.append(("lost", run, seq))

        async def no_run(run: str) -> None:
            events.append(("no_run", run, 0))

        ob = Outbox(str(tmp_path / "spool"), "w", max_bytes=1 << 20, max_age=60, spool_limit=1 << 30,
                    store_for=LocalStore, output_of=output_of, on_shipped=shipped, on_lost=lost, on_no_run=no_run)
        ob.append("r", result(item(1)))
        ob.seal_due(set(), force=True)
        ob.queue[0].path.unlink()  # the spool loses the sealed shard
        ob.append("r", result(item(2)))
        ob.seal_due(set(), force=True)
        ob.append("gone", result(item(3)))
        ob.seal_due(set(), force=True)
        gone_path = ob.queue[-1].path
        task = asyncio.create_task(ob.shipper())
        assert await ob.flush(10)
        task.cancel()
        assert events == [("lost", "r", 1), ("shipped", "r", 2), ("no_run", "gone", 0)]
        assert gone_path.exists(), "a shard of a run that is gone stays in the spool"
        assert ob.snapshot().lost == 1
        ob.close()

    asyncio.run(scenario())


# --- supervision ---------------------------------------------------------------------------
def test_a_failing_loop_is_restarted_then_stops_the_consumer() -> None:
    async def scenario() -> None:
        runs = 0

        async def flaky() -> None:
            nonlocal runs
            runs += 1
            if runs < 3:
                raise RuntimeError("boom")

        await supervised("flaky", flaky, restarts=5)
        assert runs == 3

        async def broken() -> None:
            raise RuntimeError("always")

        t0 = time.monotonic()
        with pytest.raises(LoopFailed, match="broken failed: RuntimeError: always"):
            await supervised("broken", broken, restarts=2)
        assert time.monotonic() - t0 < 10

    asyncio.run(scenario())


# --- what a job carries ----------------------------------------------------------------------
@pytest.mark.parametrize("args,kwargs,why", [
    ("not a list", {}, "not a list of items"),
    ([[item(0)], [item(1)]], {}, "not a list of items"),
    ([[]], {}, "no items"),
    ([[item(0)]], {"x": 1}, "keyword arguments"),
    ([["a string"]], {}, "not an object"),
    ([[{**item(0), "key": "zz"}]], {}, "key"),
    ([[{**item(0), "index": "7"}]], {}, "index"),
    ([[{**item(0), "index": True}]], {}, "index"),
    ([[{**item(0), "turn": 1.5}]], {}, "turn"),
    ([[{**item(0), "messages": []}]], {}, "messages"),
    ([[{**item(0), "messages": [{"role": "wizard", "content": "x"}]}]], {}, "role"),
    ([[{**item(0), "messages": [{"role": "user", "content": 42}]}]], {}, "content"),
    ([[{**item(0), "messages": [{"role": "system", "content": "x"}]}]], {}, "no user message"),
    ([[{**item(0), "tools": "calculator"}]], {}, "tools"),
    ([[{**item(0), "note": 3}]], {}, "note"),
    ([[item(0, "x" * 101)]], {}, "over the limit"),
])
def test_a_job_whose_items_do_not_parse_is_refused(args: Any, kwargs: Any, why: str) -> None:
    with pytest.raises(InvalidJob, match=why):
        parse_items(args, kwargs, max_chars=100)


def test_valid_items_parse() -> None:
    items = [item(0), {**item(1), "turn": 2, "tools": [{"type": "function"}], "note": "stopped_at_tool_turn"}]
    assert parse_items([items], {}, max_chars=100) == items
    assert parse_items((items,), None, max_chars=100) == items


# --- the failure-storm breaker -------------------------------------------------------------
def error_rec(i: int, cls: str, message: str) -> Any:
    return {"key": item(i)["key"], "error": {"class": cls, "type": "E", "status": 400, "message": message}}


def test_a_storm_of_identical_permanent_failures_trips_the_breaker_within_the_first_items() -> None:
    b = Breaker(BreakerSettings(first_n=8, window=100, rate=0.5, same=0.8))
    trips = [b.record(error_rec(i, "permanent", f"HTTP 400: you requested {9000 + i} tokens")) for i in range(20)]
    assert trips[:7] == [None] * 7
    assert trips[7] is not None and "first 8 items all failed" in trips[7] and "HTTP N" in trips[7]
    assert trips[8:] == [None] * 12, "it trips once"


def test_a_storm_after_a_healthy_start_trips_on_the_window() -> None:
    b = Breaker(BreakerSettings(first_n=8, window=20, rate=0.5, same=0.8))
    for i in range(30):
        assert b.record(result(item(i))) is None
    trips = [b.record(error_rec(i, "bad_response", "choices is empty")) for i in range(10)]
    assert trips[-1] is not None and "10 of the last 20" in trips[-1]


def test_healthy_runs_with_genuine_failures_and_transient_faults_never_trip() -> None:
    import random

    rng = random.Random(7)
    b = Breaker()
    for i in range(20_000):
        r = rng.random()
        if r < 0.04:  # genuine permanent failures, each its own prompt (messages differ in words)
            rec = error_rec(i, "permanent", f"prompt {rng.choice(['too long', 'has bad tool', 'rejected'])} x{i}")
        elif r < 0.10:  # transient faults that exhausted their attempts: never counted
            rec = error_rec(i, "transient_exhausted", "HTTP 503")
        else:
            rec = result(item(i))
        assert b.record(rec) is None, f"tripped at item {i}"
    # and an opening run of failures that disagree is no storm
    b2 = Breaker()
    assert all(b2.record(error_rec(i, "permanent", m)) is None
               for i, m in enumerate(["a", "b", "c", "d", "e", "f", "g", "h"]))
