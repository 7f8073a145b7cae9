"""What a consumer holds is made once (issue 46), in-process: items waiting here that another
consumer copies are set aside (a copy of an item that waits is its transfer), a job taken again
here skips what this spool already holds unshipped, and a job held twice is sent once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import redis

from genqueue.common.keepers.flights import Flights
from genqueue.common.keepers.marks import ShardMarks
from genqueue.common.keepers.runs import CONSUMERS
from genqueue.common.storage import LocalStore
from genqueue.consumer.shipping.outbox import Outbox
from genqueue.consumer.work.book import Book
from tests.doubles import item, job, result


def _sent(book: Book[Any]) -> list[tuple[str, int]]:
    out = []
    while (t := book.take()) is not None:
        out.append((t[0].id, t[1]["index"]))
    return out


def test_items_copied_elsewhere_are_set_aside_and_come_back_when_the_copy_ends_without_a_result() -> None:
    """old: a consumer sent the items of its job that waited while another consumer copied them
    (61 records twice by reference against 8 inline after a stopped consumer went on);
    new: they wait aside while the copy lives, and are made here only if it ends without a result."""
    book: Book[Any] = Book()
    a = job("a", 5)
    book.hold(a)
    keys = [it["key"] for it in a.items]
    assert book.set_aside("r", {keys[3], keys[4]}) == 2
    assert book.pending == 3 and sorted(book.aside_keys("r")) == sorted(keys[3:])
    assert book.drop_done("r", {keys[4]}) == [a]  # its copy shipped: done here too
    assert a.remaining == 4 and a.counts["items_won_elsewhere"] == 1
    assert book.put_back("r", {keys[3]}) == 0  # still claimed: stays aside
    assert book.put_back("r", set()) == 1  # the copy ended without a result: first in line here
    assert _sent(book) == [("a", 3), ("a", 0), ("a", 1), ("a", 2)]
    assert book.aside_keys("r") == [] and book.aside_runs() == set()


def test_an_abandoned_or_drained_job_leaves_nothing_aside() -> None:
    book: Book[Any] = Book()
    a, b = job("a", 2), job("b", 2, start=10)
    book.hold(a)
    book.hold(b)
    book.set_aside("r", {a.items[1]["key"], b.items[0]["key"]})
    book.abandon(a)
    assert book.aside_keys("r") == [b.items[0]["key"]]
    assert book.put_back("r", set()) == 1 and _sent(book) == [("b", 10), ("b", 11)]
    book.set_aside("r", {b.items[0]["key"]})  # nothing waits any more: nothing to set aside
    assert book.aside_keys("r") == []
    c = job("c", 2, start=20)
    book.hold(c)
    book.set_aside("r", {c.items[0]["key"]})
    book.drop_pending()
    assert book.aside_runs() == set() and book.pending == 0


def test_a_job_held_again_here_is_sent_once() -> None:
    """A Redis rewind queues again a job this consumer holds; taken again, it is held once: the
    earlier hold's waiting items do not go out beside the new hold's."""
    book: Book[Any] = Book()
    first = job("a", 3)
    book.hold(first)
    t = book.take()
    assert t is not None
    again = job("a", 3)
    book.hold(again)
    assert first.abandoned and book.jobs["a"] is again
    assert _sent(book) == [("a", 0), ("a", 1), ("a", 2)]


def test_the_outbox_names_the_results_written_here_and_not_shipped(tmp_path: Path) -> None:
    """A job taken again here after a rewind skips the items whose results wait in this spool
    (Outbox.unshipped_results), and is acked once their shard ships."""

    async def scenario() -> None:
        shipped: list[int] = []

        async def output_of(run: str) -> str | None:
            return str(tmp_path / "out")

        async def on_shipped(run: str, seq: int | None, marks: ShardMarks) -> None:
            shipped.append(seq or 0)

        async def nothing(*_args: object) -> None:
            return None

        ob = Outbox(str(tmp_path / "spool"), "w", max_bytes=1 << 20, max_age=60, spool_limit=1 << 30,
                    store_for=LocalStore, output_of=output_of, on_shipped=on_shipped, on_lost=nothing,
                    on_no_run=nothing)
        one, two, three = item(1), item(2), item(3)
        s1 = ob.append("r", result(one))
        ob.seal_due(set(), force=True)
        s2 = ob.append("r", result(two))
        assert s2 > s1
        keys = [one["key"], two["key"], three["key"]]
        assert ob.unshipped_results("r", keys) == {one["key"]: s1, two["key"]: s2}
        assert ob.unshipped_results("other", keys) == {}
        ob.seal_due(set(), force=True)
        task = asyncio.create_task(ob.shipper())
        assert await ob.flush(10)
        task.cancel()
        assert shipped == [s1, s2]
        assert ob.unshipped_results("r", keys) == {}
        ob.close()

    asyncio.run(scenario())


def test_claims_by_others_are_those_of_live_consumers_but_the_asker(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    now = float(conn.time()[0])
    conn.zadd(CONSUMERS, {"me": now, "alive": now - 1, "dead": now - 3600})
    for holder, key in (("me", "k0"), ("alive", "k1"), ("dead", "k2"), ("never-seen", "k3")):
        assert Flights(conn, "r").claim(key, holder)
    assert Flights(conn, "r").claimed_by_others("me") == {"k1"}
    assert Flights(conn, "r").claimed_by_others("alive") == {"k0"}
    assert Flights(conn, "empty").claimed_by_others("me") == set()
