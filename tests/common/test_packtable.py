"""common/keepers/packs.py against a real Redis: pack numbers unique under a race, the table
written only by the transaction that queues the pack's jobs, read back by number; and the job
shapes rqaccess.job_reference tells apart."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from genqueue.common.keepers.claims import Claims
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import TASK, PackRef, job_reference, queue_for, reference_meta
from genqueue.common.keepers.rundelete import delete_run

pytestmark = pytest.mark.integration


def test_numbers_are_unique_however_many_producers_race(conn: redis.Redis) -> None:
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: PackTable(conn, "r").allocate(), range(200)))
    assert sorted(got) == list(range(1, 201))
    assert PackTable(conn, "other").allocate() == 1  # per run


def test_restore_names_the_packs_again_and_numbers_go_on_past_them(conn: redis.Redis) -> None:
    table = PackTable(conn, "r")
    assert table.put_back({}) == 0 and table.count() == 0
    assert table.put_back({1: "a-000001.gqpack", 3: "b-000001.gqpack"}) == 2
    assert table.names() == {1: "a-000001.gqpack", 3: "b-000001.gqpack"} and table.allocate() == 4
    # what the table holds wins, and the numbers never go back
    assert table.put_back({1: "other.gqpack", 2: "c-000001.gqpack"}) == 1
    assert table.name_of(1) == "a-000001.gqpack" and table.name_of(2) == "c-000001.gqpack"
    assert table.allocate() == 5


def test_the_table_is_written_by_the_enqueue_transaction_and_read_by_number(conn: redis.Redis) -> None:
    table = PackTable(conn, "r")
    n = table.allocate()
    q = queue_for("r", conn)
    claims = Claims(conn)
    assert claims.claim("r", "c1", [b"\x01" * 16], token=None) == [True]
    data = q.prepare_data(TASK, args=[], job_id="gq-1", meta=reference_meta(3, PackRef(n, 0)))
    assert table.name_of(n) is None and table.count() == 0
    assert claims.enqueue(q, [data], "r", "c1", also=lambda pipe: table.stage(pipe, n, "w-000001.gqpack"))
    assert table.name_of(n) == "w-000001.gqpack" and table.names() == {n: "w-000001.gqpack"}
    assert table.count() == 1 and q.count == 1
    conn.hset(table.key("r"), "junk", "x")  # not a number: left out of names()
    assert table.names() == {n: "w-000001.gqpack"}
    delete_run(conn, "r")
    assert not conn.exists(table.key("r"), table.seq_key("r"))


def test_job_shapes() -> None:
    assert job_reference([[{"key": "k"}]], {}, {"items": 1}) is None  # inline: one argument
    assert job_reference(["garbage"], {}, {}) is None  # still inline's to judge (parse_items refuses it)
    assert job_reference([], {}, reference_meta(32, PackRef(7, 3))) == PackRef(7, 3)
    assert job_reference((), None, {"pack": 1, "block": 0}) == PackRef(1, 0)
    for meta in ({}, {"pack": 0, "block": 0}, {"pack": 1, "block": -1}, {"pack": True, "block": 0},
                 {"pack": "1", "block": 0}, None):
        with pytest.raises(ValueError, match="no usable reference"):
            job_reference([], {}, meta)
    assert job_reference([], {"x": 1}, reference_meta(1, PackRef(1, 0))) is None  # kwargs: not a reference


def test_rqjobs_reads_a_job_by_reference_only_through_items_of(conn: redis.Redis) -> None:
    from genqueue.common.keepers.rqaccess import JobPlace
    from genqueue.common.keepers.rqjobs import Depth, JobScan, read_jobs

    q = queue_for("r", conn)
    good = [{"key": f"{i:032x}", "index": i, "messages": [{"role": "user", "content": "q"}]} for i in range(2)]
    q.enqueue_many([q.prepare_data(TASK, args=[], job_id="gq-ref", meta=reference_meta(2, PackRef(1, 0))),
                    q.prepare_data(TASK, args=[], job_id="gq-nometa", meta={"items": 2})])
    asked: list[PackRef] = []

    def items_of(ref: PackRef) -> list:
        asked.append(ref)
        return good

    scan = JobScan()
    jobs = list(read_jobs(conn, "r", [JobPlace.QUEUED], scan=scan, items_of=items_of))
    assert [(j.id, j.items, j.ref) for j in jobs] == [("gq-ref", good, PackRef(1, 0))] and asked == [PackRef(1, 0)]
    assert "no usable reference" in scan.bad["gq-nometa"].reason
    scan = JobScan()
    assert list(read_jobs(conn, "r", [JobPlace.QUEUED], scan=scan)) == []  # no items_of: noted, never empty
    assert "a job by reference (pack 1, block 0)" in scan.bad["gq-ref"].reason
    scan = JobScan()  # headers only: both load as rq jobs
    assert len(list(read_jobs(conn, "r", [JobPlace.QUEUED], scan=scan, depth=Depth.HEADERS))) == 2
    assert not scan.bad
    scan = JobScan()  # an item the pack holds that no reader can use
    assert list(read_jobs(conn, "r", [JobPlace.QUEUED], scan=scan, items_of=lambda ref: [{"key": "x"}])) == []
    assert "item 0 of pack 1 block 0" in scan.bad["gq-ref"].reason
