"""The book of held jobs (consumer/work/book.py) in-process: what is acked, what a lost shard abandons."""

from __future__ import annotations

from typing import Any

from genqueue.consumer.work.book import Book
from tests.doubles import job, result


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


def test_a_jobs_items_go_out_in_their_order_jobs_in_the_order_taken() -> None:
    """Prefix-cache locality: a job holds a conversation's turns in order (producer/enqueue/jobwriter.py);
    the book sends them in that order, one job's after the other's, so turn k reaches the engine
    before turn k+1, whose prompt begins with turn k's."""
    book: Book[Any] = Book()
    a, b = job("a", 4), job("b", 3, start=10)
    book.hold(a)
    book.hold(b)
    order = []
    while (t := book.take()) is not None:
        order.append((t[0].id, t[1]["index"]))
    assert order == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 10), ("b", 11), ("b", 12)]
