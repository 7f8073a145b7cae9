"""Longest-first ordering: pure parts, and the order jobs land in a real queue."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from rq.job import Job

from genqueue.common.contracts import Item, Mode
from genqueue.common.rqaccess import SERIALIZER, queue_for
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.items import answer_lengths, estimate_cost, make_items
from genqueue.producer.order import LongestFirst, cost_class
from tests.conftest import cli, write_jsonl


def test_estimates_use_the_original_answers() -> None:
    conv = normalize({"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a" * 100},
                                        {"from": "human", "value": "q2"}, {"from": "gpt", "value": "b" * 30}]})
    assert answer_lengths(conv) == [100, 30]
    regen = make_items(conv, Mode.REGENERATE, 0)[0]
    assert estimate_cost(regen, answer_lengths(conv)) == 130
    each = make_items(conv, Mode.EACH, 0)
    assert [estimate_cost(it, answer_lengths(conv)) for it in each] == [100, 30]
    bare = normalize({"conversations": [{"from": "human", "value": "q" * 7}]})
    assert estimate_cost(make_items(bare, Mode.LAST, 0)[0], answer_lengths(bare)) == 7  # no answer: prompt length


def test_classes_and_spill_order(tmp_path: Path) -> None:
    assert cost_class(0) == cost_class(1) == 0 and cost_class(1000) > cost_class(100) > cost_class(2)
    lf = LongestFirst(str(tmp_path))
    for i, cost in enumerate([5, 5000, 50, 5000, 500]):
        item: Item = {"key": str(i), "index": i, "turn": None, "messages": []}
        lf.add(item, cost)
    order = [it["key"] for chunk in lf.longest_first(chunk=2) for it in chunk]
    assert order == ["1", "3", "4", "2", "0"]  # costliest first, input order within a class
    lf.close()
    assert not lf.dir.exists()


@pytest.mark.integration
def test_jobs_land_longest_first(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    records: list[object] = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "x" * (10 * (i % 7) + 1)}]}
               for i in range(70)]
    data = write_jsonl(tmp_path / "lf.jsonl", records)
    cli("producer", "enqueue", str(data), "--batch-size", "10", "--longest-first", "--rejects", str(tmp_path / "r"),
        env={"REDIS_URL": redis_url})
    q = queue_for("lf", conn)
    firsts = []
    for jid in q.job_ids:
        items = Job.fetch(jid, connection=conn, serializer=SERIALIZER).args[0]
        firsts.append(min(i["index"] % 7 for i in items))
    assert firsts[0] == 6 and firsts == sorted(firsts, reverse=True)
    assert sum(len(Job.fetch(j, connection=conn, serializer=SERIALIZER).args[0]) for j in q.job_ids) == 70
