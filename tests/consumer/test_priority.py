"""Runs share a consumer by priority, then evenly: the share of held items each run may fetch
(consumer/work/shares.py), which run's item takes a free slot (consumer/work/book.py), and the CLI that
sets a run's priority without touching its settings. The end-to-end proof is in
test_priority_e2e.py."""

from __future__ import annotations

from typing import Any

import orjson

from genqueue.consumer.work.book import Book, JobState
from genqueue.consumer.work.shares import RunDemand, fetch_order, targets
from tests import doubles
from tests.conftest import cli, sharegpt, write_jsonl


def job(run: str, jid: str, n: int) -> JobState[Any]:
    return doubles.job(jid, n, run=run)


# --- shares: what each run may hold waiting ----------------------------------------------
def test_equal_runs_split_the_budget_and_a_new_small_run_is_fetched_first() -> None:
    big, small = RunDemand("big", 0, 128, True), RunDemand("small", 0, 0, True)
    shares = targets(128, [big, small])
    assert shares == {"big": 64, "small": 64}
    # the big run holds the whole budget already: only the small one is fetched for
    assert fetch_order([big, small], shares) == ["small"]


def test_a_run_whose_queue_is_empty_leaves_its_share_to_the_others() -> None:
    shares = targets(128, [RunDemand("big", 0, 10, True), RunDemand("done", 0, 0, False)])
    assert shares == {"big": 128}
    shares = targets(128, [RunDemand("big", 0, 10, True), RunDemand("tail", 0, 20, False)])
    assert shares["big"] == 64 and shares["tail"] == 64


def test_a_higher_run_takes_the_budget_and_lower_ones_get_what_it_leaves() -> None:
    hi, lo = RunDemand("hi", 5, 0, True), RunDemand("lo", 0, 100, True)
    shares = targets(128, [lo, hi])
    assert shares == {"hi": 128, "lo": 0}
    assert fetch_order([lo, hi], shares) == ["hi"]
    # the high run's queue is empty and it holds 30: the low one may fill the rest
    shares = targets(128, [RunDemand("hi", 5, 30, False), RunDemand("lo", 0, 20, True)])
    assert shares["lo"] == 98 and fetch_order([RunDemand("lo", 0, 20, True)], shares) == ["lo"]


def test_the_top_priority_always_gets_to_fetch() -> None:
    assert targets(2, [RunDemand(f"r{i}", 0, 0, True) for i in range(5)]) == {f"r{i}": 1 for i in range(5)}


# --- the book: which run's item a free slot takes ------------------------------------------
def test_equal_runs_share_the_slots_evenly() -> None:
    book: Book[Any] = Book()
    book.hold(job("big", "b1", 100))
    for _ in range(10):  # the big run holds every slot
        assert book.take() is not None
    book.hold(job("small", "s1", 8))
    taken = []
    for _ in range(10):  # slots free up one by one: the small run gets them until it has as many
        t = book.take()
        assert t is not None
        taken.append(t[0].run)
    assert taken[:8] == ["small"] * 8 and taken[8:] == ["big", "big"]
    assert book.in_flight_of("small") == 8 and book.in_flight_of("big") == 12
    assert {r: load.in_flight for r, load in book.snapshot().runs.items() if load.in_flight} == {"big": 12, "small": 8}


def test_a_higher_run_takes_every_slot_that_frees_up_and_none_in_flight_is_cut() -> None:
    book: Book[Any] = Book()
    book.hold(job("big", "b1", 50))
    flying = [book.take() for _ in range(10)]
    book.hold(job("urgent", "u1", 5))
    book.set_priorities({"urgent": 3})
    assert book.in_flight == 10  # nothing in flight is touched
    order = []
    for t in flying[:7]:
        assert t is not None
        book.answered(t[0])
        nxt = book.take()
        assert nxt is not None
        order.append(nxt[0].run)
    assert order == ["urgent"] * 5 + ["big", "big"]
    assert book.in_flight_of("big") == 5 and book.in_flight_of("urgent") == 5 and book.pending_of("urgent") == 0


def test_one_run_is_served_in_order_and_an_abandoned_job_leaves_its_queue() -> None:
    book: Book[Any] = Book()
    a, b = job("r", "a", 3), job("r", "b", 2)
    book.hold(a)
    book.hold(b)
    book.set_shares({"r": 5})
    first = book.take()
    assert first is not None and first[0] is a and book.below_share  # 4 left, share 5: fetch
    book.abandon(a)
    assert book.pending == 2 == book.pending_of("r")
    rest = [book.take(), book.take(), book.take()]
    assert [t[0].id if t else None for t in rest] == ["b", "b", None]


# --- the CLI ----------------------------------------------------------------------------
def test_priority_is_set_at_enqueue_and_changed_later_without_a_new_fingerprint(tmp_path, redis_url, conn):
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "p.jsonl", [sharegpt(i) for i in range(5)])
    base = ("producer", "enqueue", str(data), "--run", "prio", "--output", str(tmp_path / "out"),
            "--rejects", str(tmp_path / "rej.jsonl"), "--json")
    first = orjson.loads(cli(*base, "--priority", "3", env=env).stdout)
    assert first["priority"] == 3 and first["created_run"]
    assert cli("producer", "priority", "--run", "prio", env=env).stdout.strip() == "run prio: priority 3"
    out = cli("producer", "priority", "--run", "prio", "-2", env=env).stdout
    assert out.strip() == "run prio: priority 3 -> -2"
    again = orjson.loads(cli(*base, env=env).stdout)  # a re-run without --priority keeps it
    assert again["priority"] == -2 and again["fingerprint"] == first["fingerprint"]
    st = orjson.loads(cli("producer", "status", "--run", "prio", "--json", env=env).stdout)
    assert st["priority"] == -2 and st["fingerprint"] == first["fingerprint"] and len(st["fingerprints"]) == 1
    assert st["share"] == {"in_flight": 0, "of": 0, "consumers": 0}
    human = cli("producer", "status", "--run", "prio", env=env).stdout
    assert any(line.startswith("priority") and line.endswith("-2; share: 0 of the 0 requests in flight on its "
                                                          "0 live consumer(s)") for line in human.splitlines())
    listed = [orjson.loads(x) for x in cli("producer", "runs", "--json", env=env).stdout.splitlines()]
    assert [(r["run"], r["priority"]) for r in listed] == [("prio", -2)]
    gone = cli("producer", "priority", "--run", "nope", "4", env=env, check=False)
    assert gone.returncode == 2 and gone.stderr.startswith("error: no run named 'nope'")
    assert conn.hget("genqueue:run:nope", "priority") is None and not conn.exists("genqueue:run:nope")
    bad = cli("producer", "priority", "--run", "prio", "high", env=env, check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
