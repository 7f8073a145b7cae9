"""The run's item table against a real Redis: its size, its counts kept by every script that
changes a state (claims, release, marks, rebuild's in-run marks), its encoding, and the
export's missing set read from it."""

from __future__ import annotations

import os
import random

import pytest
import redis

from genqueue.common.keepers.claims import CLAIM_GRACE, CLAIM_TTL, Claims, claim_key
from genqueue.common.keepers.itemlayout import DECODE_AFTER, DEFAULT_BUCKETS, RECORD_BYTES, bucket_key
from genqueue.common.keepers.items import DONE, FAILED, IN_RUN, ITEMS_PER_BUCKET, ItemCounts, ItemTable, buckets_for
from genqueue.common.keepers.marks import Marks, ShardMarks

RUN = "it"


def model_counts(states: dict[bytes, int]) -> ItemCounts:
    s = list(states.values())
    return ItemCounts(sum(1 for x in s if x & IN_RUN), sum(1 for x in s if x & DONE), sum(1 for x in s if x & FAILED),
                      sum(1 for x in s if x & FAILED and x & DONE), sum(1 for x in s if x & IN_RUN and x & DONE))


def clear_failed(table: ItemTable, picked: list[bytes], model: dict[bytes, int]) -> None:
    """Clear FAILED of PICKED in TABLE and in its MODEL."""
    table.change(picked, clear=FAILED)
    for d in picked:
        model[d] = model.get(d, 0) & ~FAILED


def assert_table_is(table: ItemTable, model: dict[bytes, int], pool: list[bytes]) -> None:
    """TABLE holds MODEL's entries, and each digest of POOL reads as MODEL says."""
    assert dict(table.each()) == model
    assert list(table.states(pool)) == [model.get(d, 0) for d in pool]


def test_buckets_are_sized_once_for_the_run() -> None:
    # at least the default (buckets are made as items land: a small run pays nothing for them)
    assert buckets_for(0) == buckets_for(ITEMS_PER_BUCKET * 1024) == 1024
    assert buckets_for(ITEMS_PER_BUCKET * 1024 + 1) == 2048
    assert buckets_for(1_000_000) == 16_384 and 1_000_000 / 16_384 <= ITEMS_PER_BUCKET


def test_the_first_writer_fixes_the_size(conn: redis.Redis) -> None:
    table = ItemTable(conn, RUN)
    assert table.buckets() == 0 and table.states([os.urandom(16)]) == b"\x00"  # nothing yet: no bucket read
    assert table.ensure(100_000) == 2048
    assert table.ensure(10) == 2048  # fixed: a later enqueue's size changes nothing
    other = ItemTable(conn, "other")
    other.change([os.urandom(16)], add=IN_RUN)  # a writer that said no size: the default
    assert other.buckets() == 1024


@pytest.mark.parametrize(("hashes", "one_bucket"), [(False, False), (False, True), (True, False)],
                         ids=["blobs", "blobs-one-bucket", "hashes"])
def test_counts_follow_every_change_of_state(conn: redis.Redis, hashes: bool, one_bucket: bool) -> None:
    """Random claims, releases, marks (results and error records) and direct changes, against a
    model: the counts the scripts keep are the model's at every step, and so is each state. In
    both layouts; and with every digest in one bucket, which then holds more records than a
    script searches in its string (past DECODE_AFTER look-ups and changes in one call it is decoded
    for the rest of the call)."""
    rng = random.Random(7)
    table, claims, marks = ItemTable(conn, RUN), Claims(conn), Marks(conn, RUN)
    table.ensure(200, hashes=hashes)
    pool = [bytes(4) + os.urandom(12) if one_bucket else os.urandom(16) for _ in range(3 * DECODE_AFTER if one_bucket
                                                                                       else 300)]
    most = DECODE_AFTER + DECODE_AFTER // 2 if one_bucket else 40
    model: dict[bytes, int] = {}
    for step in range(120):
        picked = rng.sample(pool, rng.randint(1, most))
        op = rng.choice(["claim", "release", "done", "failed", "add", "clear"])
        if op == "claim":
            won = claims.claim(RUN, f"c{step}", picked)
            for d, w in zip(picked, won, strict=True):
                assert w == (not model.get(d, 0) & IN_RUN)
                model[d] = model.get(d, 0) | IN_RUN
            if rng.random() < 0.5:  # given back: those it won leave the run again
                for d in conn.smembers(claim_key(RUN, f"c{step}")):
                    model[bytes(d)] &= ~IN_RUN
                claims.release(RUN, f"c{step}")
        elif op in ("done", "failed"):
            sm = ShardMarks()
            for d in picked:
                sm.add(d.hex(), error=op == "failed", kind="x")
                model[d] = model.get(d, 0) | (DONE if op == "done" else FAILED)
            marks.mark_shipped(sm)
        elif op == "add":
            table.change(picked, add=IN_RUN)
            for d in picked:
                model[d] = model.get(d, 0) | IN_RUN
        else:
            clear_failed(table, picked, model)
        model = {d: s for d, s in model.items() if s}
        assert table.counts() == model_counts(model), (step, op)
    assert_table_is(table, model, pool)
    p = marks.progress()
    c = model_counts(model)
    assert (p.items, p.done, p.failed, p.failed_and_done) == (c.in_run, c.done, c.failed, c.failed_done)
    assert marks.all_done() == (c.in_run == c.in_run_done)


def test_a_run_of_its_size_is_a_string_of_records_a_bucket_and_a_grown_one_still_works(conn: redis.Redis) -> None:
    """A table this genqueue makes keeps a bucket as a string of 22-byte records: at most 26 B of
    Redis an item at the size it was made for, and a run grown past it gives the same answers
    (longer strings, no other cost)."""
    table = ItemTable(conn, RUN)
    n = ITEMS_PER_BUCKET * DEFAULT_BUCKETS
    table.ensure(n)
    assert table.blobs() and table.buckets() == DEFAULT_BUCKETS
    digests = [os.urandom(16) for _ in range(n)]
    for i in range(0, n, 4_096):
        table.change(digests[i:i + 4_096], add=IN_RUN)
    keys = [bucket_key(RUN, b) for b in range(table.buckets())]
    assert {conn.type(k) for k in keys} - {b"none"} == {b"string"}
    used = sum(conn.memory_usage(k, samples=0) or 0 for k in keys)
    assert RECORD_BYTES <= used / n <= RECORD_BYTES + 4, used / n
    more = [os.urandom(16) for _ in range(30 * n // 10)]  # three times what it was sized for
    for i in range(0, len(more), 16_384):
        table.change(more[i:i + 16_384], add=IN_RUN | DONE)
    assert table.counts() == ItemCounts(n + len(more), len(more), 0, 0, len(more))
    everyone = digests + more  # read in parts, as jobs read them: one script over all held a loaded Redis 5 s
    assert set(b"".join(table.states(everyone[i:i + 16_384]) for i in range(0, len(everyone), 16_384))) == {
        IN_RUN, IN_RUN | DONE}
    assert len(dict(table.each())) == n + len(more)


def test_a_table_an_earlier_genqueue_made_stays_in_listpacks_and_a_grown_one_still_works(conn: redis.Redis) -> None:
    table = ItemTable(conn, RUN)
    table.ensure(5_000, hashes=True)
    digests = [os.urandom(16) for _ in range(5_000)]
    for i in range(0, 5_000, 1_000):
        table.change(digests[i:i + 1_000], add=IN_RUN)
    def encodings() -> set[bytes]:  # of the buckets made (a bucket is made when an item lands in it)
        return {conn.object("encoding", bucket_key(RUN, b)) for b in range(table.buckets())} - {None}

    assert encodings() == {b"listpack"}
    more = [os.urandom(16) for _ in range(150_000)]  # 30 times what it was sized for
    was = conn.config_get("hash-max-listpack-entries")["hash-max-listpack-entries"]
    conn.config_set("hash-max-listpack-entries", 128)  # Redis's default (a packaged redis.conf may say 512)
    try:
        for i in range(0, 150_000, 10_000):
            table.change(more[i:i + 10_000], add=IN_RUN | DONE)
    finally:
        conn.config_set("hash-max-listpack-entries", was)
    assert b"hashtable" in encodings()  # past 128 an entry: more bytes an item, the same answers
    assert table.counts() == ItemCounts(155_000, 150_000, 0, 0, 150_000)
    assert set(table.states(digests + more)) == {IN_RUN, IN_RUN | DONE}


@pytest.mark.parametrize("hashes", [False, True], ids=["blobs", "hashes"])
def test_the_missing_set_is_the_run_minus_what_the_export_saw(conn: redis.Redis, hashes: bool) -> None:
    table = ItemTable(conn, RUN)
    table.ensure(3_000, hashes=hashes)
    digests = [os.urandom(16) for _ in range(3_000)]
    table.change(digests, add=IN_RUN)
    table.change([os.urandom(16) for _ in range(50)], add=DONE)  # marks of items never in the run
    conn.sadd("seen", *digests[:2_500])
    assert table.fill_missing("seen", "missing", 60) == 500
    assert {bytes(d) for d in conn.smembers("missing")} == set(digests[2_500:])
    assert 0 < conn.ttl("missing") <= 60


def test_a_run_made_before_the_item_table_has_its_sets_moved_into_it(conn: redis.Redis) -> None:
    """An upgrade in the middle of a run: its keys, done and failed sets become the table's
    entries, counts kept, and the sets are gone."""
    digests = [os.urandom(16) for _ in range(5_000)]
    conn.sadd(f"genqueue:run:{RUN}:keys", *digests)
    conn.sadd(f"genqueue:run:{RUN}:done", *digests[:3_000])
    conn.sadd(f"genqueue:run:{RUN}:failed", *digests[2_900:3_100])
    table = ItemTable(conn, RUN)
    table.ensure(5_000)
    assert table.migrate_sets() == 5_000 + 3_000 + 200
    assert not conn.exists(f"genqueue:run:{RUN}:keys", f"genqueue:run:{RUN}:done", f"genqueue:run:{RUN}:failed")
    assert table.counts() == ItemCounts(5_000, 3_000, 200, 100, 3_000)
    assert Marks(conn, RUN).progress().failed_only == 100
    assert table.migrate_sets() == 0


def test_the_table_builds_its_keys_as_the_runs_keeper_does() -> None:
    """The table's keys are the run's: built on keeper.py's run_key, as every keeper's are."""
    from genqueue.common.keepers import itemlayout, items, keeper

    assert items.ItemTable.key("r1") == keeper.run_key("r1", "itemtable") == "genqueue:run:r1:itemtable"
    assert itemlayout.bucket_key("r1", 255) == keeper.run_key("r1", "items:ff")


def test_held_claims_count_genqueues_claims_and_leave_out_other_keys(conn: redis.Redis) -> None:
    """What status and `producer runs` read of a run's claims: a key under the claim prefix that
    is no set with a TTL (not one of genqueue's) is left out, never read as one (a string there
    made SCARD fail with WRONGTYPE, a traceback on `producer status`)."""
    claims = Claims(conn)
    digests = [os.urandom(16) for _ in range(5)]
    assert claims.claim("hc", "p1-a", digests[:3]) == [True] * 3
    assert claims.claim("hc", "p2-b", digests[3:]) == [True] * 2
    conn.expire(claim_key("hc", "p2-b"), CLAIM_TTL - CLAIM_GRACE - 5)  # its producer is gone
    conn.set(claim_key("hc", "junk"), "x", ex=100)
    conn.sadd(claim_key("hc", "no-ttl"), b"y")
    held = claims.held("hc")
    assert (held.claims, held.items, held.stale) == (2, 5, 1) and held.oldest_s >= CLAIM_GRACE + 5
    assert {c.id for c in claims.others("hc", "p1")} == {"p2-b"}
    assert claims.held("none") == type(held)()
