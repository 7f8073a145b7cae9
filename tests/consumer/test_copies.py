"""Copies at the end of a run (consumer/copies.py, common/keepers/flights.py): an idle consumer sends a
copy of what another still holds; the first result shipped ends the item everywhere; nothing
rests on a copy.

Unit tests of the rule, the book and the dispatcher in-process; the offers and claims on a real
redis-server; end to end, real consumers on two stand-ins over HTTP, one of them four times
slower per token, and (slow tier) the copying consumer killed while its copies run.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import pytest
import redis

from genqueue.common.contracts import Item, Mode
from genqueue.common.keepers import flights as fl
from genqueue.common.keepers.flights import Flight, Flights, Offer
from genqueue.common.keepers.runs import CONSUMERS
from genqueue.common.settings import RunSettings
from genqueue.consumer.answer.generate import RunContext
from genqueue.consumer.copies import FASTER, Rate, choose, copies_clause, copyable
from genqueue.consumer.dispatch import Dispatcher
from genqueue.consumer.engine.admission import Limiter
from genqueue.consumer.work.book import Book
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results
from tests.doubles import FakeGate, FakeOutbox, item, job, result, run_context

# --- the rule --------------------------------------------------------------------------


def offer(worker: str, rate: float, *flights: tuple[str, float | None]) -> Offer:
    return Offer(worker, rate, time.time(), tuple(Flight("j", k, a) for k, a in flights))


def test_unsent_items_go_first_then_the_youngest_in_flight_on_a_slower_engine() -> None:
    slow = offer("slow", 100.0, ("old", 3.0), ("young", 0.5), ("unsent", None), ("mid", 1.0))
    picks = choose([slow], "me", 100.0 * FASTER, 3, set())
    assert [f.key for _, f in picks] == ["unsent", "young", "mid"]


def test_no_copy_of_an_item_in_flight_on_an_engine_as_fast() -> None:
    # a copy started later on an engine as fast never ends first: only the unsent item is copied
    peer = offer("peer", 100.0, ("running", 0.1), ("unsent", None))
    assert [f.key for _, f in choose([peer], "me", 100.0 * FASTER * 0.99, 8, set())] == ["unsent"]


def test_no_copy_from_a_holder_over_twice_as_fast_nor_of_own_or_held_items() -> None:
    fast = offer("fast", 1000.0, ("unsent", None))
    mine = offer("me", 1.0, ("mine", None))
    slow = offer("slow", 10.0, ("held-here", None), ("other", None))
    picks = choose([fast, mine, slow], "me", 400.0, 8, {"held-here"})
    assert [f.key for _, f in picks] == ["other"]
    assert choose([slow], "me", 0.0, 8, set()) == []  # no rate measured here yet: no copy
    assert choose([slow], "me", 400.0, 0, set()) == []  # no slot free
    assert choose([offer("new", 0.0, ("x", None))], "me", 400.0, 8, set()) == []  # its rate unknown


def test_the_rate_is_tokens_over_seconds_of_the_recent_results() -> None:
    r = Rate()
    assert r.value == 0.0
    r.observe(100, 1.0)
    r.observe(300, 1.0)
    r.observe(0, 5.0)  # an empty answer says nothing of the speed
    assert r.value == 200.0


def test_the_end_line_says_of_ours_ended_by_others_not_others_quote() -> None:
    """old: "... 1 given back, copies: 3 sent for others (2 written), 1 of ours ended by others', 2.0 items/s"
    new: "... 1 given back, copies: 3 sent for others (2 written), 1 of ours ended by others, 2.0 items/s" """
    counts = {"sent": 3, "shipped": 2, "dropped": 1, "yielded": 0, "ended_elsewhere": 1}
    assert copies_clause(counts) + ", 2.0 items/s" == \
        ", copies: 3 sent for others (2 written), 1 of ours ended by others, 2.0 items/s"
    assert copies_clause({}) == copies_clause({"sent": 0, "ended_elsewhere": 0}) == ""


def test_conversations_regenerated_turn_by_turn_are_not_copied() -> None:
    one = item(1)
    two: Item = {**item(2), "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                         {"role": "user", "content": "c"}]}
    regen = run_context(settings=RunSettings(multi_turn=Mode.REGENERATE))
    assert copyable(regen, one) and not copyable(regen, two)
    assert copyable(run_context(settings=RunSettings(multi_turn=Mode.LAST)), two)


# --- the book and the dispatcher ----------------------------------------------------------


def test_items_waiting_here_that_were_shipped_elsewhere_are_dropped_and_count_done() -> None:
    book: Book[object] = Book()
    a, b = job("a", 3), job("b", 2, start=3)
    book.hold(a)
    book.hold(b)
    taken = book.take()
    assert taken is not None and taken[0] is a
    ended = book.drop_done("r", {item(1)["key"], item(2)["key"], item(4)["key"], "not-here"})
    assert ended == [a, a, b]
    assert book.pending == 1 and [it["key"] for _, it in book.pending_items("r")] == [item(3)["key"]]
    assert a.remaining == 1 and a.counts["items_won_elsewhere"] == 2 and a.counts["items_done"] == 2
    assert b.remaining == 1


class HangingGenerator:
    """Answers item 0 at once; every other item only when released (an engine still decoding it)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled: list[str] = []

    async def answer(self, ctx: RunContext, it: Item, *, attempt: int = 1, enqueued_at: float | None = None,
                     copy: bool = False) -> Any:
        if it["index"] != 0:
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.append(it["key"])
                raise
        return {**result(it), "copy": True} if copy else result(it)  # as records.record marks a copy


async def _until(cond: Any, what: str) -> None:
    for _ in range(300):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def test_an_item_in_flight_shipped_elsewhere_is_cancelled_and_its_job_completes_without_a_record() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        js = job("a", 2)
        book.hold(js)
        outbox, gen = FakeOutbox(), HangingGenerator()
        acked: list[str] = []

        async def on_won(run: str) -> None:
            acked.append(run)

        d = Dispatcher(book, Limiter(8), FakeGate(), outbox, gen,  # type: ignore[arg-type]
                       on_record=lambda run, rec: None, wake=asyncio.Event(), stopping=asyncio.Event(),
                       low_water=lambda: 8, on_won=on_won)
        task = asyncio.create_task(d.run())
        await _until(lambda: len(outbox.records) == 1 and book.in_flight == 1, "item 0 answered, item 1 in flight")
        assert [f.key for f in d.held_items("r")] == [item(1)["key"]] and d.held_items("r")[0].age is not None
        assert await d.done_elsewhere("r", {item(1)["key"]}) == 1
        await _until(lambda: js.complete, "the job completes once item 1 is ended here")
        task.cancel()
        assert gen.cancelled == [item(1)["key"]]  # the request was cut: the engine stops decoding it
        assert len(outbox.records) == 1 and js.counts["items_won_elsewhere"] == 1
        assert acked == ["r"] and book.in_flight == 0 and d.limiter.used == 0

    asyncio.run(scenario())


def test_a_stop_still_cancels_an_item_and_a_copy_writes_only_a_result() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        js = job("a", 2)
        book.hold(js)
        outbox, gen = FakeOutbox(), HangingGenerator()
        stopping = asyncio.Event()
        d = Dispatcher(book, Limiter(8), FakeGate(), outbox, gen,  # type: ignore[arg-type]
                       on_record=lambda run, rec: None, wake=asyncio.Event(), stopping=stopping,
                       low_water=lambda: 8)
        task = asyncio.create_task(d.run())
        await _until(lambda: book.in_flight == 1, "item 1 in flight")
        # a copy of another consumer's item runs in a free slot, beside this consumer's own;
        # never while the spool is full (admission is paused then, and so are copies)
        outbox.full = lambda: True  # type: ignore[method-assign]
        assert not d.start_copy(run_context("r"), item(7))
        del outbox.full
        assert d.start_copy(run_context("r"), item(7))
        assert d.limiter.used == 2 and item(7)["key"] in d.held_keys("r")
        gen.release.set()
        await _until(lambda: len(outbox.records) == 3, "item 1 and the copy answered")
        assert {r["key"] for r in outbox.records} == {item(0)["key"], item(1)["key"], item(7)["key"]}
        assert d.copies_shipped == 1 and js.complete and d.limiter.used == 0
        assert {r["key"] for r in outbox.records if r.get("copy")} == {item(7)["key"]}  # the record says it
        # a stop cancels what is in flight for good (its job goes back): not taken for a win
        js2 = job("b", 2, start=10)
        gen.release.clear()
        book.hold(js2)
        d.wake.set()
        await _until(lambda: book.in_flight == 2, "items 10 and 11 in flight")
        assert await d.finish(0.05, lambda: False) == 2
        assert not js2.complete and js2.counts["items_won_elsewhere"] == 0
        stopping.set()
        task.cancel()

    asyncio.run(scenario())


def test_a_copy_gives_its_slot_to_an_item_held_here_and_a_copy_cut_before_it_ran_frees_its_slot() -> None:
    async def scenario() -> None:
        book: Book[Any] = Book()
        outbox, gen = FakeOutbox(), HangingGenerator()
        d = Dispatcher(book, Limiter(2), FakeGate(), outbox, gen,  # type: ignore[arg-type]
                       on_record=lambda run, rec: None, wake=asyncio.Event(), stopping=asyncio.Event(),
                       low_water=lambda: 2)
        task = asyncio.create_task(d.run())
        assert d.start_copy(run_context("r"), item(7)) and d.start_copy(run_context("r"), item(8))
        assert d.copy_slots() == 0 and d.room_for_work()  # the intake still takes a job: copies give way
        await asyncio.sleep(0.05)
        js = job("a", 1, start=11)  # item 11, held until released
        book.hold(js)
        d.wake.set()
        await _until(lambda: book.in_flight == 1 and len(d.copies) == 1, "the held job's item in flight")
        # the youngest copy (item 8) was cut for it; the older one runs on; no slot is lost
        assert gen.cancelled == [item(8)["key"]] and list(d.copies) == [("r", item(7)["key"])]
        assert d.limiter.used == 2 and d.copies_yielded == 1 and book.pending == 0
        js2 = job("b", 1, start=12)
        book.hold(js2)
        d.wake.set()
        await _until(lambda: book.in_flight == 2 and not d.copies, "the next item takes the last copy's slot")
        assert gen.cancelled == [item(8)["key"], item(7)["key"]] and d.copies_yielded == 2
        gen.release.set()
        await _until(lambda: js.complete and js2.complete, "the jobs' items answered")
        assert {r["key"] for r in outbox.records} == {item(11)["key"], item(12)["key"]}  # no copy wrote anything
        assert d.limiter.used == 0 and d.copies_shipped == 0
        # a copy cut before its task first ran (in the same tick) still gives its slot back
        gen.release.clear()
        assert d.start_copy(run_context("r"), item(9))
        d.cancel_copies()
        await _until(lambda: not d.copies, "the copy ended")
        assert d.limiter.used == 0
        task.cancel()

    asyncio.run(scenario())


def test_no_copy_takes_a_slot_while_an_item_of_a_held_job_waits_for_one() -> None:
    """The copier's look awaits Redis between its check and each copy it sends: an item that
    arrived meanwhile, waiting for the slot a cut copy freed, must not lose it to a new copy."""
    async def scenario() -> None:
        book: Book[Any] = Book()
        d = Dispatcher(book, Limiter(4), FakeGate(), FakeOutbox(), HangingGenerator(),  # type: ignore[arg-type]
                       on_record=lambda run, rec: None, wake=asyncio.Event(), stopping=asyncio.Event(),
                       low_water=lambda: 4)
        assert d.copy_slots() == 4
        book.hold(job("a", 1, start=11))  # no dispatcher runs: the item waits
        assert d.copy_slots() == 0 and not d.start_copy(run_context("r"), item(7))
        assert d.limiter.used == 0 and not d.copies

    asyncio.run(scenario())


# --- offers and claims on a real Redis ------------------------------------------------------


def test_offers_expire_withdraw_and_one_claim_per_item(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    Flights(conn, "r").offer("a", 250.0, [Flight("j1", "k1", 0.5), Flight("j1", "k2", None)])
    Flights(conn, "r").offer("b", 500.0, [Flight("j2", "k3", 1.0)])
    got = {o.worker: o for o in Flights(conn, "r").offers()}
    assert set(got) == {"a", "b"} and got["a"].rate == 250.0
    assert got["a"].flights == (Flight("j1", "k1", 0.5), Flight("j1", "k2", None))
    assert 0 < conn.pttl(Flights.key("r")) <= fl.OFFER_TTL * 1000  # a dead consumer's offer goes away
    assert [o.worker for o in Flights(conn, "r").offers(now=time.time() + fl.OFFER_TTL + 1)] == []  # stale
    Flights(conn, "r").offer("a", 250.0, [])  # withdrawn
    assert [o.worker for o in Flights(conn, "r").offers()] == ["b"]
    conn.hset(Flights.key("r"), "garbage", b"{not json")
    conn.hset(Flights.key("r"), "wrong", b'{"rate": 1, "at": 1, "items": [[1]]}')
    assert [o.worker for o in Flights(conn, "r").offers()] == ["b"]  # odd content is skipped, never a crash
    conn.zadd(CONSUMERS, {"a": float(conn.time()[0])})  # a live consumer (it reported just now)
    assert Flights(conn, "r").claim("k1", "a") and not Flights(conn, "r").claim("k1", "b")
    assert Flights(conn, "r").claimed() == {"k1"} and conn.ttl(Flights.hedges_key("r")) > 0
    assert not Flights(conn, "r").claim("k1", "a")  # already its own: not a second copy


def test_a_claim_of_a_consumer_no_longer_live_is_taken_over(redis_url: str) -> None:
    """A consumer killed while its copies ran would keep their items from every other idle
    consumer until the claims expire (10 min): a claim counts only while its holder is live
    (seen within STALE_AFTER, in Redis time, as `producer status` judges it)."""
    from genqueue.common.keepers.snapshots import STALE_AFTER

    conn = redis.Redis.from_url(redis_url)
    now = float(conn.time()[0])
    conn.zadd(CONSUMERS, {"alive": now - 1, "dead": now - STALE_AFTER - 5})
    for holder, item_key in (("alive", "k1"), ("dead", "k2"), ("never-seen", "k3")):
        assert Flights(conn, "s").claim(item_key, holder)
    assert not Flights(conn, "s").claim("k1", "me")  # its holder reported a second ago
    assert Flights(conn, "s").claim("k2", "me") and Flights(conn, "s").claim("k3", "me")
    assert conn.hgetall(Flights.hedges_key("s")) == {b"k1": b"alive", b"k2": b"me", b"k3": b"me"}
    assert not Flights(conn, "s").release("k2", "dead")  # the old holder, back, cannot free what it lost


# --- end to end: real consumers on a fast and a slow stand-in ----------------------------------

ITEMS = 240
SLOTS = 16


def _stats(sim: Sim) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{sim.port}/sim/stats", timeout=2) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def _fleet(tmp_path: Any, redis_url: str, copies: str = "1") -> tuple[Sim, Sim, dict[str, str]]:
    # one seed: both engines answer a request alike, so a copy is as long as its original
    fast = Sim(tmp_path, "--slots", str(SLOTS), "--step-time", "0.01", "--mean-tokens", "60", "--seed", "3")
    (tmp_path / "slow").mkdir()
    slow = Sim(tmp_path / "slow", "--slots", str(SLOTS), "--step-time", "0.04", "--mean-tokens", "60",
               "--seed", "3")
    env = {"REDIS_URL": redis_url, "GENQUEUE_TAIL_COPIES": copies}
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(ITEMS)])
    cli("producer", "enqueue", str(data), "--run", "t", "--output", str(tmp_path / "out"), "--batch-size", "16",
        "--max-tokens", "400", "--rejects", str(tmp_path / "rej.jsonl"), env=env)
    return fast, slow, env


def _consumer(tmp_path: Any, name: str, sim: Sim, env: dict[str, str]) -> Proc:
    return Proc("consumer", ["-v", "run", "--run", "t", "--endpoint", sim.url, "--burst", "--spool",
                             str(tmp_path / f"spool-{name}"), "--shard-max-age", "1", "-c", str(SLOTS)],
                tmp_path / f"{name}.log", env=env)


@pytest.mark.integration
@pytest.mark.slow  # 15 s: in the slow tier, which CI runs too
def test_an_idle_fast_engine_copies_what_the_slow_one_holds_and_every_item_ends_once(tmp_path, redis_url):
    fast, slow, env = _fleet(tmp_path, redis_url)
    procs = []
    try:
        procs = [_consumer(tmp_path, "fast", fast, env), _consumer(tmp_path, "slow", slow, env)]
        for p in procs:
            assert p.wait(120) == 0, p.output()[-3000:]
        s_fast, s_slow = _stats(fast), _stats(slow)
    finally:
        for p in procs:
            p.signal(15)
        fast.stop()
        slow.stop()
    results = read_results(tmp_path / "out", "t")
    keys = [r["key"] for r in results]
    assert len(set(keys)) == ITEMS and all("error" not in r for r in results)
    fast_log, slow_log = procs[0].output(), procs[1].output()
    copied = [r for r in results if r.get("copy")]
    assert copied and all(r["consumer"]["endpoint"] == fast.url for r in copied), copied[:2]
    assert "copies of items other consumers hold sent" in fast_log, fast_log[-2000:]
    # the slow consumer saw results shipped by the fast one and cut its own requests (the engine aborts them)
    assert "already have a result shipped; ended here" in slow_log, slow_log[-2000:]
    assert s_slow["cancelled"] >= 1
    # what a copy costs: at most the copies' tokens; every record of an item counted once in export
    twice = len(keys) - len(set(keys))
    print(f"records written twice: {twice}; slow engine requests cut: {s_slow['cancelled']}; "
          f"fast engine requests {s_fast['requests']}, slow {s_slow['requests']}")
    rows = cli("producer", "export", "--run", "t", "--format", "openai", "-o", str(tmp_path / "x.jsonl"), env=env)
    assert rows.returncode == 0, rows.stderr
    exported = len((tmp_path / "x.jsonl").read_bytes().splitlines())
    trunc = tmp_path / "x.truncated.jsonl"
    cut = len(trunc.read_bytes().splitlines()) if trunc.exists() else 0
    assert exported + cut == ITEMS, rows.stdout + rows.stderr  # every item once: finished, or cut by max_tokens
    assert f"duplicates removed   {twice}\n" in rows.stdout, rows.stdout
    screen = cli("producer", "status", "--run", "t", "--wide", env=env).stdout
    assert "copies: " in screen and "of its own items ended by others" in screen, screen


@pytest.mark.slow
@pytest.mark.integration
def test_the_copying_consumer_killed_costs_nothing_but_its_copies(tmp_path, redis_url):
    """Nothing rests on a copy: the fast consumer is killed (SIGKILL) while its copies run; the
    slow consumer still ends every item it holds, and a new fast consumer ends the rest."""
    fast, slow, env = _fleet(tmp_path, redis_url)
    procs = []
    try:
        procs = [_consumer(tmp_path, "fast", fast, env), _consumer(tmp_path, "slow", slow, env)]
        deadline = time.monotonic() + 90
        while "copies of items other consumers hold sent" not in procs[0].output():
            assert time.monotonic() < deadline, procs[0].output()[-2000:]
            assert procs[0].p.poll() is None, "the fast consumer ended before it copied anything"
            time.sleep(0.05)
        procs[0].kill()
        procs.append(_consumer(tmp_path, "fast2", fast, env))
        assert procs[1].wait(120) == 0, procs[1].output()[-3000:]
        assert procs[2].wait(120) == 0, procs[2].output()[-3000:]
    finally:
        for p in procs:
            p.signal(15)
        fast.stop()
        slow.stop()
    keys = {r["key"] for r in read_results(tmp_path / "out", "t") if "error" not in r}
    assert len(keys) == ITEMS
    status = cli("producer", "status", "--run", "t", "--json", env=env)
    assert status.returncode == 0, status.stderr


def test_odd_content_under_the_offer_keys_pauses_copies_and_crashes_nothing(tmp_path, redis_url, caplog):
    """A flights or hedges key of another type (written by hand): the look says so once and the
    loop goes on; every held item is untouched."""
    import logging

    from genqueue.consumer.copies import Copier
    from genqueue.consumer.rqthread import RqThread

    conn = redis.Redis.from_url(redis_url)
    conn.set(Flights.key("r"), "not a hash")

    class Idle:
        """A dispatcher holding one item of run r, with slots free."""

        def held_runs(self) -> set[str]:
            return {"r"}

        def held_keys(self, run: str) -> list[str]:
            return [item(0)["key"]]

        def held_items(self, run: str) -> list[Flight]:
            return [Flight("j", item(0)["key"], 0.1)]

        def copy_slots(self) -> int:
            return 4

    async def scenario() -> None:
        rq = RqThread()
        h = Copier(rq, conn, "me", Idle(), contexts=lambda: {"r": run_context("r")},  # type: ignore[arg-type]
                   tail_runs=lambda: ["r"], stopped=set)
        h.rate.observe(100, 1.0)
        loop = asyncio.create_task(h.run())
        await asyncio.sleep(0.8)
        assert not loop.done(), "the loop must survive odd content"
        loop.cancel()
        rq.close()

    with caplog.at_level(logging.WARNING, logger="genqueue.consumer.copies"):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if "copies paused" in r.getMessage()]
    assert len(said) == 1 and "WRONGTYPE" in said[0], said


def test_copies_of_a_run_paused_or_gone_are_cut_and_others_run_on(redis_url):
    """`producer pause` (or the breaker, or the run deleted) while copies of it run here: the
    next look cuts them and leaves the copies of other runs alone."""
    from genqueue.consumer.copies import Copier
    from genqueue.consumer.rqthread import RqThread

    conn = redis.Redis.from_url(redis_url)

    async def scenario() -> None:
        rq = RqThread()
        book: Book[Any] = Book()
        d = Dispatcher(book, Limiter(4), FakeGate(), FakeOutbox(), HangingGenerator(),  # type: ignore[arg-type]
                       on_record=lambda run, rec: None, wake=asyncio.Event(), stopping=asyncio.Event(),
                       low_water=lambda: 4)
        stopped: set[str] = set()
        h = Copier(rq, conn, "me", d, contexts=lambda: {"r": run_context("r"), "s": run_context("s")},
                   tail_runs=lambda: ["r", "s"], stopped=lambda: stopped)
        h.rate.observe(100, 1.0)
        assert d.start_copy(run_context("r"), item(7)) and d.start_copy(run_context("s"), item(8))
        await h.look()
        assert len(d.copies) == 2  # neither run is stopped: both run on
        stopped.add("r")
        await h.look()
        await _until(lambda: list(d.copies) == [("s", item(8)["key"])], "the paused run's copy cut")
        assert d.limiter.used == 1
        d.cancel_copies()
        await _until(lambda: not d.copies, "the copies ended")
        rq.close()

    asyncio.run(scenario())


class ErrsOnEight(HangingGenerator):
    """Item 8's copy ends in an error at once; the others hang until released."""

    async def answer(self, ctx: RunContext, it: Item, *, attempt: int = 1, enqueued_at: float | None = None,
                     copy: bool = False) -> Any:
        if it["index"] == 8:
            return {**result(it), "error": {"class": "server", "type": "HTTP 500", "message": "boom"}}
        return await super().answer(ctx, it, attempt=attempt, enqueued_at=enqueued_at, copy=copy)


def test_a_copy_ended_without_a_result_gives_its_claim_back_and_one_that_failed_is_not_sent_again(redis_url):
    """Claims are one copy per item across the fleet: a copy that gave way, was cut, or failed
    must give its claim back, or no other idle consumer may copy that item until it expires."""
    from rq import Queue

    from genqueue.common.keepers.rqaccess import SERIALIZER
    from genqueue.consumer.copies import Copier
    from genqueue.consumer.rqthread import RqThread

    conn = redis.Redis.from_url(redis_url)
    k7, k8, k9 = item(7)["key"], item(8)["key"], item(9)["key"]
    held = Queue("elsewhere", connection=conn, serializer=SERIALIZER).enqueue("os.getcwd", [item(7), item(8)])
    Flights(conn, "r").offer("other", 10.0, [Flight(held.id, k7, None), Flight(held.id, k8, None)])
    assert Flights(conn, "r").claim(k9, "third")

    async def scenario() -> None:
        rq = RqThread()
        d = Dispatcher(Book(), Limiter(4), FakeGate(), FakeOutbox(), ErrsOnEight(),  # type: ignore[arg-type]
                       on_record=lambda run, rec: None, wake=asyncio.Event(), stopping=asyncio.Event(),
                       low_water=lambda: 4)
        h = Copier(rq, conn, "me", d, contexts=lambda: {"r": run_context("r")}, tail_runs=lambda: ["r"],
                   stopped=set)
        h.rate.observe(100, 1.0)
        await h.look()
        assert h.copies_sent == 2
        await _until(lambda: list(d.copies) == [("r", k7)], "item 8's copy ended in an error")
        assert d.copies_lost == 1 and Flights(conn, "r").claimed() == {k7, k8, k9}
        Flights(conn, "r").offer("other", 10.0, [Flight(held.id, k7, None), Flight(held.id, k8, None)])
        await h.look()  # item 8's claim given back; its copy failed here, so it is not sent again from here
        assert Flights(conn, "r").claimed() == {k7, k9} and h.copies_sent == 2 and list(d.copies) == [("r", k7)]
        assert not d.unclaimed
        d.cancel_copies()  # item 7's copy cut (as when it gives way to an item held here)
        await _until(lambda: not d.copies, "item 7's copy ended")
        await h._give_back()
        assert Flights(conn, "r").claimed() == {k9}  # another consumer's claim is left alone
        assert not Flights(conn, "r").release(k9, "me") and Flights(conn, "r").release(k9, "third")
        rq.close()

    asyncio.run(scenario())


def test_offers_are_stamped_and_judged_by_redis_clock_so_skewed_nodes_see_each_other(redis_url, monkeypatch):
    """Offers last OFFER_TTL (3 s): stamped with each node's own clock, a node 100 s behind
    wrote offers every other node took for stale, and its items were never copied."""
    from genqueue.common.keepers.clock import redis_time
    from genqueue.consumer.copies import Copier
    from genqueue.consumer.rqthread import RqThread

    conn = redis.Redis.from_url(redis_url)
    offset = redis_time(conn) - time.time()

    async def scenario() -> None:
        rq = RqThread()
        book: Book[Any] = Book()
        book.hold(job("a", 2))  # two items waiting unsent here
        d = Dispatcher(book, Limiter(4), FakeGate(), FakeOutbox(), HangingGenerator(),  # type: ignore[arg-type]
                       on_record=lambda run, rec: None, wake=asyncio.Event(), stopping=asyncio.Event(),
                       low_water=lambda: 4)
        # this node's clock is 100 s behind; rqcompat's RedisClock corrects it by the measured offset
        real = time.time
        h = Copier(rq, conn, "behind", d, contexts=lambda: {"r": run_context("r")}, tail_runs=lambda: ["r"],
                   stopped=set, clock=lambda: time.time() + (100.0 + offset))
        with monkeypatch.context() as m:
            m.setattr(time, "time", lambda: real() - 100.0)
            await h.look()
        rq.close()

    asyncio.run(scenario())
    seen = Flights(conn, "r").offers(now=redis_time(conn))  # another node, reading by Redis's clock
    assert [o.worker for o in seen] == ["behind"] and len(seen[0].flights) == 2
    stamped = time.time() - 100.0  # what the node's own clock would have stamped
    assert fl.OFFER_TTL < redis_time(conn) - stamped  # which that reader would have taken for stale


class RaisesOnEight(HangingGenerator):
    """Item 8's copy raises an unexpected exception (a bug, not an error record)."""

    async def answer(self, ctx: RunContext, it: Item, *, attempt: int = 1, enqueued_at: float | None = None) -> Any:
        if it["index"] == 8:
            raise RuntimeError("a bug")
        return await super().answer(ctx, it, attempt=attempt, enqueued_at=enqueued_at)


def test_a_copy_that_raised_counts_as_lost_like_one_that_ended_in_an_error() -> None:
    """Issue 31: copies_lost counted only error records; a copy that raised was not counted."""
    async def scenario() -> None:
        d = Dispatcher(Book(), Limiter(4), FakeGate(), FakeOutbox(), RaisesOnEight(),  # type: ignore[arg-type]
                       on_record=lambda run, rec: None, wake=asyncio.Event(), stopping=asyncio.Event(),
                       low_water=lambda: 4)
        assert d.start_copy(run_context("r"), item(8))
        await _until(lambda: not d.copies, "item 8's copy ended")
        assert d.copies_lost == 1 and ("r", item(8)["key"]) in d.copies_failed

    asyncio.run(scenario())


def test_items_of_a_job_by_reference_are_copied_through_the_pack_reader(redis_url):
    """Issue 34: a job by reference carries no items; the copies read them through the intake's
    pack reader (read_reference), and without one copy none of them (its holder answers them)."""
    from rq import Queue

    from genqueue.common.keepers.rqaccess import SERIALIZER, TASK, PackRef, reference_meta
    from genqueue.consumer.copies import Copier
    from genqueue.consumer.rqthread import RqThread

    conn = redis.Redis.from_url(redis_url)
    q = Queue("byref-elsewhere", connection=conn, serializer=SERIALIZER)
    q.enqueue_many([q.prepare_data(TASK, args=[], job_id="gq-byref", meta=reference_meta(2, PackRef(3, 1)))])
    k7, k8 = item(7)["key"], item(8)["key"]
    asked: list[tuple[str, PackRef]] = []

    async def read_reference(run: str, ref: PackRef) -> list[object]:
        asked.append((run, ref))
        return [item(7), item(8)]

    async def scenario(reader: Any) -> int:
        rq = RqThread()
        d = Dispatcher(Book(), Limiter(4), FakeGate(), FakeOutbox(), HangingGenerator(),  # type: ignore[arg-type]
                       on_record=lambda run, rec: None, wake=asyncio.Event(), stopping=asyncio.Event(),
                       low_water=lambda: 4)
        Flights(conn, "r").offer("other", 10.0, [Flight("gq-byref", k7, None), Flight("gq-byref", k8, None)])
        h = Copier(rq, conn, "me", d, contexts=lambda: {"r": run_context("r")}, tail_runs=lambda: ["r"],
                   stopped=set, read_reference=reader)
        h.rate.observe(100, 1.0)
        await h.look()
        sent = h.copies_sent
        d.cancel_copies()
        await _until(lambda: not d.copies, "the copies ended")
        await h._give_back()
        rq.close()
        return sent

    assert asyncio.run(scenario(None)) == 0
    assert asyncio.run(scenario(read_reference)) == 2 and asked == [("r", PackRef(3, 1))]
