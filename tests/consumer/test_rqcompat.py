"""Contract tests for the rq 3.0 behaviour consumer/rqcompat.py relies on (real Redis)."""

import time

import pytest
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.worker import Worker

from genqueue.common.keepers.rqaccess import SERIALIZER, TASK, job_failure, job_result, queue_for
from genqueue.consumer.rqcompat import GenWorker

pytestmark = pytest.mark.integration


def enqueue(conn, n=1, retries=3, run="r"):
    q = queue_for(run, conn)
    datas = [q.prepare_data(TASK, args=[[{"key": f"{i:032x}", "index": i, "messages": []}]],
                            job_id=f"gq-{run}-{i}", retry=Retry(max=retries)) for i in range(n)]
    return q, q.enqueue_many(datas)


def test_many_jobs_held_at_once_and_finished(conn):
    q, jobs = enqueue(conn, 3)
    w = GenWorker([q], conn, lease=30)
    w.start()
    held = [w.dequeue(q)[0] for _ in range(3)]
    assert all(h is not None for h in held)
    assert w.dequeue(q) == (None, None)
    assert q.started_job_registry.count == 3
    assert len(w.get_current_executions(refresh=True)) == 3
    # rq's own view: the worker is registered and busy
    workers = Worker.all(queue=q, connection=conn)
    assert [x.name for x in workers] == [w.name]
    w.renew(held)
    assert w.finish(held[0], {"items": 1})
    assert q.finished_job_registry.get_job_ids() == [held[0].id]
    assert job_result(Job.fetch(held[0].id, connection=conn, serializer=SERIALIZER)) == {"items": 1}
    w.stop()


def test_give_back_goes_to_front_without_spending_a_retry(conn):
    q, jobs = enqueue(conn, 2)
    w = GenWorker([q], conn, lease=30)
    w.start()
    h, _ = w.dequeue(q)
    w.give_back(h)
    assert q.job_ids[0] == h.id
    job = Job.fetch(h.id, connection=conn, serializer=SERIALIZER)
    assert job.get_status() == JobStatus.QUEUED and job.retries_left == 3
    assert q.started_job_registry.count == 0


def test_a_job_taken_again_after_a_give_back_is_its_next_attempt(conn):
    """A give-back spends no retry, yet the next take is another attempt: it logged "attempt 1"."""
    from genqueue.common.keepers.rqaccess import JOB_RETRIES

    q, _ = enqueue(conn, 1, retries=JOB_RETRIES)
    w = GenWorker([q], conn, lease=30)
    w.start()
    h, _ = w.dequeue(q)
    assert h.attempt == 1
    w.give_back(h)
    h, _ = w.dequeue(q)
    assert h.attempt == 2 and h.job.retries_left == JOB_RETRIES  # counted, and no retry spent
    w.give_back(h)
    other = GenWorker([q], conn, lease=30)  # another consumer reads the same count from Redis
    other.start()
    h, _ = other.dequeue(q)
    assert h.attempt == 3
    other.fail(h, "boom", retry=True)  # a failure spends a retry: one more
    h, _ = other.dequeue(q)
    assert h.attempt == 4
    other.stop()
    w.stop()


def test_fail_with_and_without_retry(conn):
    q, _ = enqueue(conn, 2)
    w = GenWorker([q], conn, lease=30)
    w.start()
    h1, _ = w.dequeue(q)
    w.fail(h1, "boom", retry=True)
    assert h1.id in q.job_ids
    h2, _ = w.dequeue(q)
    w.fail(h2, "bad job", retry=False)
    assert h2.id in q.failed_job_registry.get_job_ids()


def test_sweep_requeues_an_abandoned_lease_once(conn):
    q, _ = enqueue(conn, 1)
    dead = GenWorker([q], conn, lease=2)
    dead.start()
    h, _ = dead.dequeue(q)  # then the process "dies": no renewals
    survivor = GenWorker([q], conn, lease=2)
    survivor.start()
    assert survivor.sweep(q) == 0  # lease still valid
    time.sleep(2.3)
    other = GenWorker([q], conn, lease=2)
    # a second sweeper holding the lock at the same time does nothing
    conn.set(q.registry_cleaning_key, "someone", ex=5)
    assert other.sweep(q) == 0
    conn.delete(q.registry_cleaning_key)
    assert survivor.sweep(q) == 1
    assert q.job_ids == [h.id]
    assert Job.fetch(h.id, connection=conn, serializer=SERIALIZER).retries_left == 2
    again, _ = survivor.dequeue(q)
    assert again is not None and again.id == h.id
    # the zombie's late ack is refused: the job is another's now (before anyone took it, the
    # zombie takes it back: tests/consumer/test_take_back.py)
    assert dead.finish(h, {"items": 1}) is False


def test_foreign_function_is_refused_never_run(conn, tmp_path):
    q = queue_for("r", conn)
    marker = tmp_path / "ran"
    job = q.enqueue("os.system", f"touch {marker}")
    w = GenWorker([q], conn, lease=30)
    w.start()
    held, reason = w.dequeue(q)
    assert held is None and "os.system" in reason
    assert not marker.exists()
    assert job.id in q.failed_job_registry.get_job_ids()
    assert "os.system" in job_failure(Job.fetch(job.id, connection=conn, serializer=SERIALIZER))


def test_pickled_payload_is_refused(conn):
    pq = Queue("genqueue.r", connection=conn)  # rq's default serializer: pickle
    job = pq.enqueue("os.getcwd")
    q = queue_for("r", conn)
    w = GenWorker([q], conn, lease=30)
    w.start()
    held, reason = w.dequeue(q)
    assert held is None and "undecodable" in reason
    assert job.id in q.failed_job_registry.get_job_ids()


def test_a_job_stuck_between_dequeue_and_start_comes_back_without_spending_a_retry(conn):
    q, _ = enqueue(conn, 1)
    # a consumer LMOVEs the job to the intermediate list, then dies before registering it
    job_id = conn.lmove(q.key, q.intermediate_queue_key).decode()
    w = GenWorker([q], conn, lease=2)
    w.start()
    assert w.sweep(q) == 0  # first seen now
    time.sleep(2.2)
    assert w.sweep(q) == 1
    assert q.job_ids == [job_id] and conn.llen(q.intermediate_queue_key) == 0
    assert Job.fetch(job_id, connection=conn, serializer=SERIALIZER).retries_left == 3
    held, _ = w.dequeue(q)
    assert held is not None and held.id == job_id


def test_rqs_worker_sets_follow_the_queues_served_and_the_state_held(conn):
    qa, _ = enqueue(conn, 1, run="a")
    qb, _ = enqueue(conn, 1, run="b")
    qc = queue_for("c", conn)
    w = GenWorker([queue_for("_idle", conn)], conn, lease=30)
    w.start()
    w.set_queues([qa, qb])

    def listed() -> dict[str, str]:
        return {q.name: ",".join(x.get_state() for x in Worker.all(queue=q, connection=conn)) for q in (qa, qb, qc)}

    assert listed() == {qa.name: "idle", qb.name: "idle", qc.name: ""}
    assert Worker.all(queue=queue_for("_idle", conn), connection=conn) == []
    held, _ = w.dequeue(qb)
    assert listed() == {qa.name: "busy", qb.name: "busy", qc.name: ""}
    w.set_queues([qb, qc])  # run a ended
    assert listed() == {qa.name: "", qb.name: "busy", qc.name: "busy"}
    w.finish(held, {"items": 1})
    assert listed() == {qa.name: "", qb.name: "idle", qc.name: "idle"}
    w.stop()
    assert listed() == {qa.name: "", qb.name: "", qc.name: ""} and Worker.all(connection=conn) == []


def test_a_killed_consumer_leaves_rqs_worker_sets_when_its_hash_expires(conn):
    qa, _ = enqueue(conn, 1, run="a")
    qb, _ = enqueue(conn, 1, run="b")
    dead = GenWorker([qa], conn, lease=30)
    dead.start()
    dead.set_queues([qa, qb])
    dead.renew([])
    # rq's worker TTL: the hash outlives the last heartbeat by a lease and a minute, no more
    assert 0 < conn.ttl(dead.key) <= 30 + 60
    conn.delete(dead.key)  # SIGKILLed, and that long has passed
    survivor = GenWorker([qb], conn, lease=30)
    survivor.start()
    assert survivor.sweep(qb) == 0
    assert conn.smembers(f"rq:workers:{qb.name}") == {survivor.key.encode()}
    assert dead.key.encode() in conn.smembers(f"rq:workers:{qa.name}")  # nobody swept a yet
    survivor.set_queues([qa, qb])
    survivor.sweep(qa)
    assert [x.name for x in Worker.all(queue=qa, connection=conn)] == [survivor.name]
    assert conn.smembers(f"rq:workers:{qa.name}") == {survivor.key.encode()}


def test_a_take_counts_in_the_jobs_hash_and_rqs_requeue_keeps_the_count(conn):
    """Held.taken is how often a consumer took the job before (consumer/work/intake.py reads no
    item's mark on a first take). rq's requeue of a failed job clears its started_at but not
    genqueue's count; a count someone overwrote with garbage reads as taken before."""
    from rq.registry import FailedJobRegistry

    from genqueue.consumer.rqcompat import TAKEN_FIELD

    q, _ = enqueue(conn, 2)
    w = GenWorker([q], conn, lease=30)
    w.start()
    h, _ = w.dequeue(q)
    assert h.taken == 0 and h.first_take
    w.give_back(h)
    h, _ = w.dequeue(q)
    assert h.taken == 1 and not h.first_take
    w.fail(h, "bad job", retry=False)
    FailedJobRegistry(queue=q).requeue(h.id)
    assert Job.fetch(h.id, connection=conn, serializer=SERIALIZER).started_at is None
    other, _ = w.dequeue(q)  # the requeued job went to the end of the queue
    assert other.id != h.id and other.taken == 0
    again, _ = w.dequeue(q)
    assert again.id == h.id and again.taken == 2
    w.give_back(other)
    conn.hset(other.job.key, TAKEN_FIELD, "garbage")
    again, _ = w.dequeue(q)
    assert again.id == other.id and again.taken == 1 and not again.first_take
    w.give_back(again)
    # a job an earlier genqueue took (rq's start time set, no count): not a first take either
    conn.hdel(again.job.key, TAKEN_FIELD, "genqueue_given_back")
    old, _ = w.dequeue(q)
    assert old.id == other.id and old.taken == 0 and old.started_before and not old.first_take
    w.stop()
