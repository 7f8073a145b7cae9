"""common/keepers/snapshots.py against a real Redis: a consumer's snapshot written, listed and read back
as `producer status` reads it, with the queue lengths its consumer reads in the same round trip."""

from __future__ import annotations

import orjson
import pytest
import redis

from genqueue.common.keepers.rqaccess import JobPlace, QueueLength, place_key, queue_lengths, queue_name, refused_key
from genqueue.common.keepers.runs import CONSUMERS, consumer_key
from genqueue.common.keepers.snapshots import SNAPSHOT_TTL, STALE_AFTER, Snapshots, Spent, read_report
from genqueue.consumer.telemetry import spent_since

pytestmark = pytest.mark.integration

NOW = 1.7e9


def snapshot(worker: str, runs: tuple[str, ...] = ("a",), **extra: object) -> dict[str, object]:
    return {"worker": worker, "last_seen": NOW, "exited": False, "paused": {}, "engine": {"metrics": False},
            "shipping": {"shards": 0}, "jobs": {}, "runs": {r: {"completions": 1} for r in runs}, **extra}


def test_a_published_snapshot_is_read_back_with_its_age_and_the_queue_lengths(conn: redis.Redis) -> None:
    conn.rpush(place_key("a", JobPlace.QUEUED), "j1", "j2", "j3")
    conn.hset(refused_key(queue_name("a")), mapping={"j9": "not a genqueue job"})
    conn.set(refused_key(queue_name("b")), "garbage")  # a refused key of another type: 0, not an error
    lengths = Snapshots(conn).publish(snapshot("w0", ("a", "b", "c")), NOW)
    assert lengths == {"a": QueueLength(3, 1), "b": QueueLength(0, 0), "c": QueueLength(0, 0)}
    assert queue_lengths(conn, ["a", "c"]) == {"a": QueueLength(3, 1), "c": QueueLength(0, 0)}
    assert 0 < conn.ttl(consumer_key("w0")) <= SNAPSHOT_TTL
    [r] = Snapshots(conn).reports(NOW + 2)
    assert r["worker"] == "w0" and r["runs"]["a"] == {"completions": 1}
    assert r["age_s"] == pytest.approx(2.0) and r["live"]
    [late] = Snapshots(conn).reports(NOW + STALE_AFTER + 1)
    assert not late["live"]
    # a publish that does not prune reads the same lengths and keeps the day-old report listed
    later = Snapshots(conn).publish(snapshot("w1", ("a", "b")), NOW + SNAPSHOT_TTL + 10, prune=False)
    assert later == {"a": QueueLength(3, 1), "b": QueueLength(0, 0)}
    assert conn.zscore(CONSUMERS, "w0") == NOW
    # a day later the report is gone from the list (the key has expired by then too)
    Snapshots(conn).publish(snapshot("w1"), NOW + SNAPSHOT_TTL + 10)
    assert conn.zscore(CONSUMERS, "w0") is None


def test_an_exited_consumer_is_not_live_and_a_snapshot_without_runs_reads_as_none() -> None:
    gone = read_report(orjson.dumps(snapshot("w", exited=True)), NOW)
    assert gone is not None and not gone["live"]
    bare = read_report(orjson.dumps({"worker": "w"}), NOW)  # the first shape: fields may be missing
    assert bare is not None and bare["runs"] == {} and not bare["live"]  # last seen: never (0)


@pytest.mark.parametrize("raw", [
    b"garbage", b"", b"null", b"[1]", orjson.dumps({"worker": 5}), orjson.dumps({"worker": "w", "runs": {"a": 5}}),
    orjson.dumps({"worker": "w", "runs": []}), orjson.dumps({"worker": "w", "last_seen": "x"}),
    orjson.dumps({"worker": "w", "last_seen": True}), orjson.dumps({"worker": "w", "engine": 3}),
    orjson.dumps({"worker": "w", "paused": ["x"]}),
])
def test_what_is_not_a_snapshot_is_left_out(conn: redis.Redis, raw: bytes) -> None:
    assert read_report(raw, NOW) is None
    conn.set(consumer_key("bad"), raw)
    conn.zadd(CONSUMERS, {"bad": NOW, "gone": NOW})  # "gone": listed, its key expired
    Snapshots(conn).publish(snapshot("good"), NOW)
    assert [r["worker"] for r in Snapshots(conn).reports(NOW)] == ["good"]


def test_a_report_reads_every_field_a_snapshot_writes_with_its_type() -> None:
    """ConsumerReport and ConsumerSnapshot stand on one ConsumerFields (total=False: a consumer
    of an earlier shape wrote fewer): a field added to one and not the other would be written and
    never read typed, or read and never written. They differ only where the docstring says:
    `paused` (the first shape wrote every reason, False when not in force) and the reader's own two."""
    import typing

    from genqueue.common.keepers.snapshots import ConsumerReport
    from genqueue.common.snapshot import ConsumerSnapshot

    wrote, read = typing.get_type_hints(ConsumerSnapshot), typing.get_type_hints(ConsumerReport)
    assert set(read) - set(wrote) == {"age_s", "live"}
    assert set(wrote) <= set(read)
    differ = {k for k in wrote if wrote[k] != read[k]}
    assert differ == {"paused"}, differ
    assert read["paused"] == dict[str, str | bool] and wrote["paused"] == dict[str, str]


def test_spent_is_each_consumers_totals_so_a_publish_told_twice_counts_once(conn: redis.Redis) -> None:
    """A publish retried after its answer was lost (Redis had done it) tells the same totals: the
    run's figures do not move. Consumers' fields sum, with counters of consumers before
    2026-12-06 and garbage (counted 0) beside them."""
    snaps = Snapshots(conn)
    first = Spent(10, 1, 1000, 500, 3.5)
    for _ in range(2):
        snaps.publish(snapshot("w0", ("a",)), NOW, {"a": first}, spender="w0@1")
    assert snaps.spent("a") == first
    snaps.publish(snapshot("w1", ("a",)), NOW, {"a": Spent(2, 0, 100, 50, 0.5)}, spender="w1@2")
    snaps.publish(snapshot("w0", ("a",)), NOW, {"a": Spent(12, 1, 1200, 600, 4.0)}, spender="w0@1")
    conn.hset(Snapshots.spent_key("a"), mapping={"completions": 5, "gpu_seconds": "1.5", "old@x": "garbage",
                                                 "neg@y": "[1,2,3,4,-5]", "short@z": "[1,2]"})
    assert snaps.spent("a") == Spent(19, 1, 1300, 650, 6.0)
    assert snaps.spent("none") == Spent()


def test_spent_since_keeps_totals_and_charges_gpu_time_to_the_runs_whose_work_was_held() -> None:
    from collections import Counter

    def snap(**runs: dict[str, int]) -> dict[str, object]:
        return {"runs": runs}

    totals = {"a": Counter(completions=4, prompt_tokens=40, completion_tokens=300)}
    one = spent_since(totals, {}, snap(a={"in_flight": 2}, b={}), 2.0, 1)  # type: ignore[arg-type]
    assert one == {"a": Spent(4, 0, 40, 300, 2.0)}
    totals["b"] = Counter(completions=1, completion_tokens=100)
    totals["a"]["completion_tokens"] += 300
    two = spent_since(totals, one, snap(a={}, b={}), 4.0, 2)  # type: ignore[arg-type]
    # both wrote records in the 4 s: 8 GPU-seconds split 3:1 by the tokens each generated
    assert two["a"] == Spent(4, 0, 40, 600, 8.0) and two["b"] == Spent(1, 0, 0, 100, 2.0)
    idle = spent_since(totals, two, snap(a={}, b={}), 10.0, 2)  # type: ignore[arg-type]
    assert idle == two, "an idle consumer spends no run's GPU-hours, and its totals stay"
