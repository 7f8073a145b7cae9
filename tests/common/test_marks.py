"""The mark store's own reads and scripts, against a real Redis: the parts the producer and the
consumer used to spell themselves (item states, all done, progress, the re-claim, the marks of a
shard file)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.keepers.claims import Reclaim, ReclaimLockLostError, Requeue, claim_key
from genqueue.common.keepers.itemlayout import RECORD_BYTES
from genqueue.common.keepers.items import DONE, FAILED, IN_RUN, ItemTable
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.marks import Marks, ShardMarks, marks_of_file
from genqueue.common.keepers.markscript import LAST_MARK_AT
from genqueue.common.keepers.runlock import RunLock
from genqueue.common.keepers.runs import key_digest

RUN = "m"


def counters(stats: dict[str, int]) -> dict[str, int]:
    """STATS without the time of the last mark (LAST_MARK_AT, tested on its own)."""
    return {k: v for k, v in stats.items() if k != LAST_MARK_AT}


def key(i: int) -> str:
    return f"{i:032x}"


def shipped(conn: redis.Redis, done: list[int], failed: list[int]) -> None:
    marks = ShardMarks()
    for i in done:
        marks.add_record({"key": key(i), "outcome": "complete", "turns": [{"content": "a"}, {"content": "b"}]})
    for i in failed:
        marks.add_record({"key": key(i), "error": {"class": "timeout"}})
    Marks(conn, RUN).mark_shipped(marks)


def test_item_states_and_all_done(conn: redis.Redis) -> None:
    ItemTable(conn, RUN).change([*(key_digest(key(i)) for i in range(3))], add=IN_RUN)
    shipped(conn, done=[0, 5], failed=[1])
    states = Marks(conn, RUN).item_states([key_digest(key(i)) for i in (0, 1, 2, 5)])
    assert list(states) == [IN_RUN | DONE, IN_RUN | FAILED, IN_RUN, DONE]
    assert Marks(conn, RUN).item_states([]) == b""
    assert not Marks(conn, RUN).all_done()
    shipped(conn, done=[1, 2], failed=[])
    assert Marks(conn, RUN).all_done()


def test_progress_reads_the_marks_with_their_counters(conn: redis.Redis) -> None:
    ItemTable(conn, RUN).change([*(key_digest(key(i)) for i in range(4))], add=IN_RUN)
    shipped(conn, done=[0, 1], failed=[1, 2])
    conn.hset(run_key(RUN, "stats"), "garbage", "x")
    p = Marks(conn, RUN).progress()
    assert (p.items, p.done, p.failed, p.failed_and_done, p.failed_only) == (4, 2, 2, 1, 1)
    # an error record of an item that has a result already counts nowhere
    assert counters(p.stats) == {"shipped_outcome_complete": 2, "shipped_turns": 4, "shipped_failed_timeout": 1}


def test_the_reclaim_takes_what_has_no_result(conn: redis.Redis) -> None:
    ItemTable(conn, RUN).change([*(key_digest(key(i)) for i in range(4))], add=IN_RUN)
    shipped(conn, done=[0], failed=[1])
    conn.set(RunLock.key(RUN), "tok")
    reclaim = Reclaim(conn)
    digests = [key_digest(key(i)) for i in (0, 1, 2, 2, 9)]
    assert reclaim(RUN, "c", ttl=60, token="tok", retry_failed=False, digests=digests)[0] == [
        Requeue.DONE, Requeue.FAILED, Requeue.QUEUED, Requeue.SKIPPED, Requeue.SKIPPED]
    assert conn.smembers(claim_key(RUN, "c")) == {key_digest(key(2))}
    # sent again (a lost reply): the same answer; with failed items retried, the failed one too
    assert reclaim(RUN, "c", ttl=60, token="tok", retry_failed=True, digests=digests)[0][:3] == [
        Requeue.DONE, Requeue.QUEUED, Requeue.QUEUED]
    assert 0 < conn.ttl(claim_key(RUN, "c")) <= 60


def test_the_reclaim_writes_nothing_without_the_lock(conn: redis.Redis) -> None:
    ItemTable(conn, RUN).change([key_digest(key(1))], add=IN_RUN)
    conn.set(RunLock.key(RUN), "someone else")
    with pytest.raises(ReclaimLockLostError):
        Reclaim(conn)(RUN, "c", ttl=60, token="tok", retry_failed=False, digests=[key_digest(key(1))])
    assert not conn.exists(claim_key(RUN, "c"))


def test_the_marks_of_a_shard_file_skip_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "shard.jsonl"
    lines = [orjson.dumps({"key": key(1), "outcome": "complete"}), orjson.dumps({"key": key(2), "error": {"class": "x"}}),
             b'{"key": "torn', orjson.dumps(["not", "a", "record"]), orjson.dumps({"key": 7})]
    path.write_bytes(b"\n".join(lines) + b"\n")
    marks = marks_of_file(path)
    assert marks.done == [key_digest(key(1))] and marks.done_kind == ["shipped_outcome_complete"]
    assert marks.failed == [key_digest(key(2))] and marks.failed_kind == ["shipped_failed_x"]


def test_marking_twice_changes_nothing_and_counts_once(conn: redis.Redis) -> None:
    """The consumers' mark is one HINCRBY an item: an item marked again (a regenerated record, a
    shard sent twice, one repeated within a shard) is taken back to its state and counted once."""
    table = ItemTable(conn, RUN)
    table.change([key_digest(key(i)) for i in range(3)], add=IN_RUN)
    shipped(conn, done=[0, 0, 1], failed=[2])
    shipped(conn, done=[0, 1], failed=[2, 0])
    states = Marks(conn, RUN).item_states([key_digest(key(i)) for i in range(3)])
    assert list(states) == [IN_RUN | DONE | FAILED, IN_RUN | DONE, IN_RUN | FAILED]
    p = Marks(conn, RUN).progress()
    assert (p.items, p.done, p.failed, p.failed_and_done) == (3, 2, 2, 1)
    assert counters(p.stats) == {"shipped_outcome_complete": 2, "shipped_turns": 4, "shipped_failed_timeout": 1}
    # the counts agree with the entries, as a count of the whole table says
    entries = dict(table.each())
    assert sum(1 for s in entries.values() if s & DONE) == p.done
    assert sum(1 for s in entries.values() if s & FAILED) == p.failed


def test_an_entry_that_is_no_integer_is_marked_as_if_it_were_none(conn: redis.Redis) -> None:
    """A table an earlier genqueue made (a hash a bucket): HINCRBY refuses an entry that is not
    an integer; the mark then reads it as 0 and sets it, as the table's readers do (garbage in
    Redis is never a failed shipment)."""
    table = ItemTable(conn, RUN)
    table.ensure(10, hashes=True)
    table.change([key_digest(key(0))], add=IN_RUN)
    d = key_digest(key(1))
    table.change([d], add=IN_RUN)
    bucket = next(k for k in conn.scan_iter(match=run_key(RUN, "items:*")) if conn.hexists(k, d))
    conn.hset(bucket, d, "x")
    shipped(conn, done=[0, 1], failed=[])
    assert list(Marks(conn, RUN).item_states([key_digest(key(0)), d])) == [IN_RUN | DONE, DONE]
    assert counters(Marks(conn, RUN).progress().stats) == {"shipped_outcome_complete": 2, "shipped_turns": 4}


def test_a_torn_or_foreign_bucket_is_read_as_far_as_it_goes_and_mended(conn: redis.Redis) -> None:
    """A bucket kept as a string of records: one cut in the middle of a record is read up to its
    last whole record, and one that is not a string (a hash planted there) as empty; the mark
    sets what it marks and writes the bucket whole again, never failing the shipment."""
    table = ItemTable(conn, RUN)
    table.ensure(10)
    assert table.blobs()
    a, b, c = (key_digest(key(i)) for i in range(3))  # one bucket: their first four bytes are 0
    table.change([a, b], add=IN_RUN)
    bucket = run_key(RUN, "items:0")
    conn.append(bucket, b"torn!")  # a record cut short after b's
    shipped(conn, done=[0, 1, 2], failed=[])
    assert list(Marks(conn, RUN).item_states([a, b, c])) == [IN_RUN | DONE, IN_RUN | DONE, DONE]
    assert len(conn.get(bucket) or b"") == 3 * RECORD_BYTES
    conn.delete(bucket)
    conn.hset(bucket, "x", "y")  # not a string: its entries are gone, as if deleted
    shipped(conn, done=[], failed=[0])
    assert conn.type(bucket) == b"string" and list(Marks(conn, RUN).item_states([a, b])) == [FAILED, 0]


@pytest.mark.parametrize("hashes", [False, True], ids=["blobs", "hashes"])
def test_a_shards_marks_cost_a_few_redis_commands_not_one_an_item(conn: redis.Redis, hashes: bool) -> None:
    """INFO's total_commands_processed counts the calls a script makes: marking 1,000 items of
    one outcome by their entries is one MGET and one MSET of the buckets they touch and a
    handful more; in a table an earlier genqueue made (a hash a bucket), their 1,000 HINCRBYs."""
    table = ItemTable(conn, RUN)
    table.ensure(1000, hashes=hashes)
    table.change([key_digest(key(i)) for i in range(1000)], add=IN_RUN)
    before = int(conn.info("stats")["total_commands_processed"])
    shipped(conn, done=list(range(1000)), failed=[])
    used = int(conn.info("stats")["total_commands_processed"]) - before
    assert (1000 <= used <= 1000 + 20) if hashes else used <= 20, used
    assert table.counts().done == 1000 == sum(1 for _, s in table.each() if s & DONE)


def test_a_jobs_first_take_reads_no_item_until_the_marks_were_rebuilt(conn: redis.Redis, tmp_path: Path) -> None:
    """The consumer's look-up before it runs a job: on the job's first take, in a run whose marks
    only shipping wrote, none of its items can be done (each item is in one job, marked once
    that job ran), so one command answers instead of one an item. Once marks were written by a
    rebuild from the output (a Redis loss, a rewind: the queue may hold jobs whose items shipped
    since), every take reads each item again, as a job taken before does."""
    import hashlib

    from genqueue.common.storage import LocalStore, SealedShard, shard_name

    table, marks = ItemTable(conn, RUN), Marks(conn, RUN)
    keys = [key(i) for i in range(128)]
    table.change([key_digest(k) for k in keys], add=IN_RUN)
    shipped(conn, done=[3, 7], failed=[9])
    before = int(conn.info("stats")["total_commands_processed"])
    assert marks.done_of(keys, first_take=True) == set()
    used = int(conn.info("stats")["total_commands_processed"]) - before
    assert used <= 3, used  # the script, its HEXISTS, and INFO
    assert marks.done_of(keys) == {key(3), key(7)}  # a take after the first: every item read
    # a rebuild from the output (here: one shard of the run) makes every take read its items
    store = LocalStore(str(tmp_path / "out"))
    body = orjson.dumps({"key": key(11), "outcome": "complete", "turns": [{"content": "a"}]}) + b"\n"
    (tmp_path / "s.jsonl").write_bytes(body)
    store.ship(SealedShard(RUN, 1, tmp_path / "s.jsonl", shard_name("w0", 1), 1, len(body),
                           hashlib.sha256(body).hexdigest(), 1))
    assert marks.rebuild(store).records == 1
    assert marks.done_of(keys, first_take=True) == {key(3), key(7), key(11)}
    assert table.counts().done == 3  # the counter beside the counts is none of them


def test_a_rebuild_of_an_empty_output_changes_no_first_take(conn: redis.Redis, tmp_path: Path) -> None:
    """Nothing shipped, nothing rebuilt: a first take still reads no item."""
    from genqueue.common.storage import LocalStore

    ItemTable(conn, RUN).change([key_digest(key(0))], add=IN_RUN | DONE)
    (tmp_path / "out").mkdir()
    assert Marks(conn, RUN).rebuild(LocalStore(str(tmp_path / "out"))).shards == 0
    assert Marks(conn, RUN).done_of([key(0)], first_take=True) == set()


def test_a_shipped_shard_stamps_when_it_marked_and_a_rebuild_does_not(conn: redis.Redis, tmp_path: Path) -> None:
    """LAST_MARK_AT: the time (Redis's clock) a shipped shard last marked an item newly, from which
    status tells when a run that is over ended; marks that add nothing, and a rebuild from the
    shards, leave it as it was."""
    import hashlib

    from genqueue.common.storage import LocalStore, SealedShard, shard_name

    marks = Marks(conn, RUN)
    ItemTable(conn, RUN).change([key_digest(key(i)) for i in range(3)], add=IN_RUN)
    assert marks.progress().last_mark_at is None
    shipped(conn, done=[0], failed=[])
    stamped = marks.progress().last_mark_at
    assert stamped is not None and abs(stamped - conn.time()[0]) <= 2
    conn.hset(run_key(RUN, "stats"), LAST_MARK_AT, 1000)
    shipped(conn, done=[0], failed=[])  # nothing new
    store = LocalStore(str(tmp_path / "out"))
    body = orjson.dumps({"key": key(1), "outcome": "complete", "turns": [{"content": "a"}]}) + b"\n"
    (tmp_path / "s.jsonl").write_bytes(body)
    store.ship(SealedShard(RUN, 1, tmp_path / "s.jsonl", shard_name("w0", 1), 1, len(body),
                           hashlib.sha256(body).hexdigest(), 1))
    assert marks.rebuild(store).records == 1
    assert marks.progress().last_mark_at == 1000.0
    shipped(conn, done=[], failed=[2])  # an error record is a mark too: the run may end on one
    assert marks.progress().last_mark_at != 1000.0
