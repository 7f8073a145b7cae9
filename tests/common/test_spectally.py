"""The acceptance tallies' keeper (common/keepers/spectally.py) against a real Redis: counted by
the marking script once per item newly marked done, rebuilt with the marks from the shipped
shards, deleted with the run."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import redis

from genqueue.common.acceptance import Facet, table_of
from genqueue.common.keepers.marks import Marks, ShardMarks
from genqueue.common.keepers.rundelete import delete_run
from genqueue.common.keepers.spectally import SpecTallies
from genqueue.common.storage.base import SealedShard
from genqueue.common.storage.local import LocalStore
from genqueue.common.storage.names import shard_name

RUN = "tally"


def fig(drafted: int, accepted: int, steps: int) -> dict[str, Any]:
    return {"k": 3, "steps": steps, "drafted": drafted, "accepted": accepted, "hist": [0, 0, 0, 0]}


def rec(i: int, source: str, accepted: int, **extra: Any) -> dict[str, Any]:
    return {"key": f"{i:032x}", "source": source, "outcome": "complete", "messages": [{"role": "user"}],
            "usage": {"completion_tokens": 100 + i}, "spec": fig(30, accepted, 10), **extra}


def conversation(i: int) -> dict[str, Any]:
    return {"key": f"{i:032x}", "source": "conv.jsonl", "variant": "think", "outcome": "complete", "messages": [],
            "turns": [{"turn": 0, "usage": {"completion_tokens": 50}, "spec": fig(30, 24, 10)},
                      {"turn": 1, "usage": {"completion_tokens": 2000}, "spec": fig(60, 12, 20)}]}


def ship(conn: redis.Redis, recs: list[dict[str, Any]]) -> None:
    marks = ShardMarks()
    for r in recs:
        marks.add_record(r)
    Marks(conn, RUN).mark_shipped(marks)


def same(a: Any, b: Any) -> bool:
    return a.overall == b.overall and a.by == b.by


def test_each_item_counts_once_in_every_facet(conn: redis.Redis) -> None:
    recs = [rec(i, "good.jsonl", 24) for i in range(6)] + [rec(10 + i, "weak\x1fname.jsonl", 12) for i in range(4)]
    recs += [conversation(20), {"key": f"{21:032x}", "error": {"class": "permanent"}, "spec": fig(3, 3, 1)},
             {"key": f"{22:032x}", "source": "nofig.jsonl", "outcome": "complete", "messages": []}]
    ship(conn, recs[:7])
    ship(conn, recs[5:])  # two items shipped again (a copy, a redone job): counted once
    ship(conn, recs)
    got = SpecTallies(conn).table(RUN)
    want = table_of([{**r, "source": r.get("source", "").replace("\x1f", "?")} for r in recs])
    assert same(got, want)
    assert got.overall.answers == 12 and got.overall.drafted == 10 * 30 + 90
    assert got.by[Facet.SOURCE]["weak?name.jsonl"].accepted == 4 * 12
    assert got.by[Facet.TURN]["2"].steps == 20 and got.by[Facet.VARIANT]["think"].answers == 2
    assert "nofig.jsonl" not in got.by[Facet.SOURCE]  # a record without figures counts nowhere


def test_an_error_record_then_a_result_counts_the_result_once(conn: redis.Redis) -> None:
    key = f"{1:032x}"
    ship(conn, [{"key": key, "error": {"class": "transient"}}])
    assert SpecTallies(conn).table(RUN).overall.answers == 0
    ship(conn, [rec(1, "a.jsonl", 20)])
    ship(conn, [rec(1, "a.jsonl", 20), {"key": key, "error": {"class": "transient"}}])
    t = SpecTallies(conn).table(RUN).overall
    assert (t.answers, t.accepted, t.drafted, t.steps) == (1, 20, 30, 10)


def test_rebuilt_from_the_shards_and_deleted_with_the_run(tmp_path: Path, conn: redis.Redis) -> None:
    recs = [rec(i, "a.jsonl" if i % 2 else "b.jsonl", 10 + i) for i in range(30)] + [conversation(40)]
    store = LocalStore(str(tmp_path / "out"))
    for seq, part in ((1, recs[:20]), (2, recs[15:])):  # the second shard repeats five items
        body = b"".join(orjson.dumps(r) + b"\n" for r in part)
        path = tmp_path / f"spool-{seq}.jsonl"
        path.write_bytes(body)
        store.ship(SealedShard(RUN, seq, path, shard_name("w0", seq), len(part), len(body),
                               hashlib.sha256(body).hexdigest(), len(part)))
        ship(conn, part)
    before = SpecTallies(conn).table(RUN)
    assert same(before, table_of(recs)) and before.overall.answers == 32
    conn.flushall()
    assert SpecTallies(conn).table(RUN).overall.answers == 0
    Marks(conn, RUN).rebuild(store)
    assert same(SpecTallies(conn).table(RUN), before)
    Marks(conn, RUN).rebuild(store)  # again: nothing counted twice
    assert same(SpecTallies(conn).table(RUN), before)
    delete_run(conn, RUN)
    assert not conn.exists(SpecTallies.key(RUN))


def test_garbage_fields_are_left_out(conn: redis.Redis) -> None:
    ship(conn, [rec(1, "a.jsonl", 20)])
    conn.hset(SpecTallies.key(RUN), mapping={"source\x1fa.jsonl\x1fanswers_x": 5, "nofacet\x1fa\x1fanswers": 3,
                                             "source\x1fb.jsonl\x1fanswers": "many"})
    t = SpecTallies(conn).table(RUN)
    assert t.overall.answers == 1 and set(t.by[Facet.SOURCE]) == {"a.jsonl"}
