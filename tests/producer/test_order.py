"""Longest-first ordering: pure parts, and the order jobs land in a real queue."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from rq.job import Job

from genqueue.common.contracts import Item, Mode
from genqueue.common.keepers.rqaccess import SERIALIZER, queue_for
from genqueue.producer.enqueue.jobwriter import record_batches
from genqueue.producer.enqueue.order import LongestFirst, cost_class
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.items import answer_lengths, estimate_cost, make_items
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


def test_a_records_items_are_ordered_together_at_their_summed_cost(tmp_path: Path) -> None:
    lf = LongestFirst(str(tmp_path))
    turns: list[Item] = [{"key": f"c{t}", "index": 0, "turn": t, "messages": []} for t in range(3)]
    lf.add_group(turns, 300 + 20 + 20)  # one long turn, two short: the conversation goes first, whole
    lf.add({"key": "x", "index": 1, "turn": 0, "messages": []}, 200)
    lf.add_group([{"key": "y", "index": 2, "turn": 0, "messages": []}], 20)
    order = [it["key"] for chunk in lf.longest_first(chunk=2) for it in chunk]
    assert order == ["c0", "c1", "c2", "x", "y"] and lf.count == 5
    lf.close()


def test_jobs_end_where_a_records_items_end() -> None:
    def recs(*sizes: int) -> list[Item]:
        return [{"key": f"{r}.{t}", "index": r, "turn": t, "messages": []} for r, n in enumerate(sizes) for t in range(n)]

    def shape(batches: list[list[Item]]) -> list[list[str]]:
        return [[it["key"] for it in b] for b in batches]

    assert shape(record_batches(recs(2, 2, 2), 4)) == [["0.0", "0.1", "1.0", "1.1"], ["2.0", "2.1"]]
    assert shape(record_batches(recs(3, 2), 4)) == [["0.0", "0.1", "0.2"], ["1.0", "1.1"]]  # not cut in two
    # longer than a job: jobs of its own, in order; the next record starts a job
    assert shape(record_batches(recs(1, 5, 1), 2)) == [["0.0"], ["1.0", "1.1"], ["1.2", "1.3"], ["1.4", "2.0"]]
    # single-item records fill jobs as before; another source's record 0 is another record
    assert [len(b) for b in record_batches(recs(*[1] * 7), 3)] == [3, 3, 1]
    a: Item = {"key": "a", "index": 0, "turn": 0, "messages": [], "source_seq": 0}
    b: Item = {"key": "b", "index": 0, "turn": 1, "messages": [], "source_seq": 1}
    assert shape(record_batches([a, b], 1)) == [["a"], ["b"]]


@pytest.mark.integration
def test_each_mode_conversations_stay_whole_and_in_order_under_longest_first(
        tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    records: list[object] = []
    for i in range(30):  # 1-4 turns; one turn of every third conversation is long
        conv = []
        for t in range(1 + i % 4):
            conv += [{"from": "human", "value": f"c{i} q{t}"},
                     {"from": "gpt", "value": "y" * (2000 if t == 1 and i % 3 == 0 else 10 + t)}]
        records.append({"conversations": conv})
    data = write_jsonl(tmp_path / "each.jsonl", records)
    cli("producer", "enqueue", str(data), "--run", "loc", "--multi-turn", "each", "--batch-size", "5",
        "--longest-first", "--rejects", str(tmp_path / "r"), env={"REDIS_URL": redis_url})
    seen: list[tuple[int, int | None]] = []
    for jid in queue_for("loc", conn).job_ids:
        items = Job.fetch(jid, connection=conn, serializer=SERIALIZER).args[0]
        assert len(items) <= 5
        seen += [(it["index"], it["turn"]) for it in items]
        for r in {it["index"] for it in items}:  # every conversation lies whole in one job, its turns in order
            assert [it["turn"] for it in items if it["index"] == r] == list(range(1 + r % 4))
    assert len(seen) == sum(1 + i % 4 for i in range(30))
    firsts = list(dict.fromkeys(r for r, _ in seen))
    long = [r for r in firsts if r % 3 == 0 and r % 4 >= 1]  # the conversations with a long turn go first
    assert firsts[: len(long)] == long
