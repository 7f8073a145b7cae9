"""A consumer whose lease was lost takes its job back when the job waits in its queue again, taken
by no one (consumer/rqcompat.py GenWorker.take_back): a Redis back from an older snapshot restores
the jobs taken since to their queue, and a sweep puts a stopped consumer's jobs there. Another
consumer taking such a job made again what the first had in flight and in its spool: after a
rewind, most of the records made twice. Real Redis, rq's own keys."""

import time

import pytest
from rq import Retry
from rq.job import Job, JobStatus

from genqueue.common.keepers.rqaccess import SERIALIZER, TASK, queue_for
from genqueue.consumer.rqcompat import GenWorker

pytestmark = pytest.mark.integration


def _one_job(conn):
    q = queue_for("tb", conn)
    data = q.prepare_data(TASK, args=[[{"key": "0" * 32, "index": 0, "messages": []}]], job_id="gq-tb-0",
                          retry=Retry(max=3))
    (job,) = q.enqueue_many([data])
    return q, job


def _rewound(conn, q, job_id):
    """The keys a take changes, as they were now: restore() puts them back (a Redis restarted from
    a snapshot taken now)."""
    keys = [q.key, Job.key_for(job_id), q.started_job_registry.key, q.intermediate_queue_key]
    saved = {k: conn.dump(k) for k in keys}

    def restore() -> None:
        for k, raw in saved.items():
            conn.delete(k)
            if raw is not None:
                conn.restore(k, 0, raw)

    return restore


def test_a_job_restored_to_its_queue_by_a_rewind_is_taken_back_by_its_holder(conn):
    # was: renew() called the lease lost and the holder dropped the job; the other consumer took it
    # from the restored queue and made again what the holder had in flight and in its spool
    q, job = _one_job(conn)
    restore = _rewound(conn, q, job.id)  # the snapshot: the job queued
    a, b = GenWorker([q], conn, lease=30), GenWorker([q], conn, lease=30)
    a.start()
    b.start()
    h, _ = a.dequeue(q)
    restore()  # Redis back from the snapshot: the job queued again, a's lease gone
    assert q.job_ids == [h.id] and a.still_ours(h) is False
    assert a.renew([h]) == []  # not lost: taken back
    assert q.job_ids == [] and a.still_ours(h)
    assert Job.fetch(h.id, connection=conn, serializer=SERIALIZER).get_status() == JobStatus.STARTED
    assert b.dequeue(q) == (None, None)  # nothing for the other to make again
    assert a.finish(h, {"items": 1})
    assert q.finished_job_registry.get_job_ids() == [h.id]


def test_a_job_another_consumer_took_first_stays_lost(conn):
    q, job = _one_job(conn)
    restore = _rewound(conn, q, job.id)
    a, b = GenWorker([q], conn, lease=30), GenWorker([q], conn, lease=30)
    a.start()
    b.start()
    h, _ = a.dequeue(q)
    restore()
    theirs, _ = b.dequeue(q)
    assert theirs is not None and theirs.id == h.id
    assert a.renew([h]) == [h]  # b's now: never two holders
    assert b.still_ours(theirs) and not a.still_ours(h)
    assert a.finish(h, {"items": 1}) is False and b.finish(theirs, {"items": 1})


def test_a_stopped_consumer_takes_back_its_swept_job_that_no_one_took(conn):
    # a consumer that stood still past its lease (SIGSTOP, a long GC pause) and goes on: its job,
    # swept back to the queue and not taken yet, is its own again (the retry the sweep spent stays spent)
    q, _ = _one_job(conn)
    a = GenWorker([q], conn, lease=2)
    a.start()
    h, _ = a.dequeue(q)
    time.sleep(2.3)
    sweeper = GenWorker([q], conn, lease=2)
    sweeper.start()
    assert sweeper.sweep(q) == 1 and q.job_ids == [h.id]
    assert a.renew([h]) == []
    assert q.job_ids == [] and sweeper.dequeue(q) == (None, None)
    assert a.finish(h, {"items": 1})
    assert Job.fetch(h.id, connection=conn, serializer=SERIALIZER).retries_left == 2


def test_a_finished_job_whose_lease_was_lost_is_acked_when_no_one_took_it(conn):
    # was: "job gq-...: lease lost before ack; leaving it to its new owner": its records shipped, and
    # the consumer that took it from the restored queue made them all again
    q, job = _one_job(conn)
    restore = _rewound(conn, q, job.id)
    a, b = GenWorker([q], conn, lease=30), GenWorker([q], conn, lease=30)
    a.start()
    b.start()
    h, _ = a.dequeue(q)
    restore()
    assert a.finish(h, {"items": 1})
    assert q.finished_job_registry.get_job_ids() == [h.id] and q.job_ids == []
    assert b.dequeue(q) == (None, None)
