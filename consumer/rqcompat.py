"""Every touch of rq's internals lives here (rq 3.0, pinned in pyproject.toml).

`GenWorker` is an rq worker that holds many jobs at once (rq 3.0 executions), driven from
the consumer's asyncio loop. Its methods are synchronous Redis work; the consumer calls them
from one dedicated thread, so they never block the event loop and never run concurrently.
tests/consumer/test_rqcompat.py is the contract test for the rq behaviour relied on here.

Lease times are Redis's (common/keepers/clock.py), not this node's: rq writes a lease's score with the
local clock, and each place it does is followed, in the same MULTI, by our score in Redis time;
sweeps compare with Redis time too. A node whose clock is off neither loses its live jobs to
others' sweeps nor sweeps theirs.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import redis
import rq.utils
from rq import Queue, worker_registration
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.worker import BaseWorker, WorkerStatus
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from genqueue.common.keepers.clock import RedisClock
from genqueue.common.keepers.keeper import KEY_PREFIX
from genqueue.common.keepers.rqaccess import JOB_RETRIES, SERIALIZER, TASK, TASKS, refused_key

log = logging.getLogger(__name__)

#: rq's worker_ttl is the lease, but never under this (seconds): rq refuses very short ones.
RQ_WORKER_TTL_MIN = 10
#: A clock off Redis's by more than this share of the lease would lose leases: it is warned about.
LEASE_CLOCK_WARN_FRACTION = 1 / 4
#: Seconds rq keeps an execution and the worker's heartbeat past the lease: rq's tools list a consumer through a miss.
LEASE_RQ_SLACK = 60

#: A field of the rq job's hash: how many times the job was given back to its queue (a drain,
#: a pause, the end of a run). A give-back spends no retry, but the next take is another
#: attempt at the job, and `attempt` says so.
GIVEN_BACK_FIELD = "genqueue_given_back"
#: A field of the rq job's hash: how many times a consumer took the job (one HINCRBY in the
#: MULTI that starts it). It survives rq's requeue, which clears `started_at`: a job whose count
#: was 0 at its take never ran before, so in a run whose marks were never rebuilt none of its
#: items can be done and the consumer skips their look-up (consumer/work/intake.py).
TAKEN_FIELD = "genqueue_taken"


class Held:
    """A job this worker has started and not yet finished: its rq objects and lease."""

    __slots__ = ("execution", "given_back", "job", "queue", "started_before", "taken")

    def __init__(self, job: Job, queue: Queue, execution: Execution, *, given_back: int = 0, taken: int = 0,
                 started_before: bool = False) -> None:
        self.job = job
        self.queue = queue
        self.execution = execution
        self.given_back = given_back  # times given back before this take
        self.taken = taken  # times a consumer took the job before this take (TAKEN_FIELD)
        self.started_before = started_before  # rq's started_at was set when the job was fetched

    @property
    def first_take(self) -> bool:
        """Whether no consumer ever took the job before: by genqueue's count, and by rq's own
        traces (a start time, a retry spent), which a job taken by an earlier genqueue that did
        not count takes has too."""
        return self.taken == 0 and not self.started_before and self.attempt == 1

    @property
    def id(self) -> str:
        return str(self.job.id)

    @property
    def attempt(self) -> int:
        """Which take of the job this is, from 1: the retries rq spent (a failure, a swept
        lease) and the give-backs before it each count one."""
        left = self.job.retries_left
        spent = JOB_RETRIES - left if left is not None else 0
        return 1 + max(spent, 0) + self.given_back


class GenWorker(BaseWorker):
    """An rq worker whose jobs are run by genqueue's asyncio consumer, many at a time."""

    def __init__(self, queues: list[Queue], conn: redis.Redis, *, lease: int, name: str | None = None) -> None:
        # A fresh name per process start: a killed worker's name stays "busy" until its hash
        # expires, and a restart must not collide with it.
        name = name or f"gq-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        _skew_for_tests()
        super().__init__(queues, name=name, connection=conn, serializer=SERIALIZER, worker_ttl=max(lease, RQ_WORKER_TTL_MIN))
        self.lease = lease
        # A clock off by more than a quarter lease would already lose leases without this.
        self.clock = RedisClock(conn, warn_above=lease * LEASE_CLOCK_WARN_FRACTION, name=name)
        # Whether a job of the queue named may be taken now (consumer/guards/rewind.py holds a run back
        # while its marks are rebuilt).
        self.gate: Callable[[str], bool] = lambda queue_name: True
        self.log_result_lifespan = False
        self.log_job_description = False
        # Between start and stop: only then is this worker in rq's worker sets.
        self._registered = False

    # rq sizes leases from the job timeout; ours are a consumer setting.
    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.lease

    def set_queues(self, queues: list[Queue]) -> None:
        """Serve QUEUES from now on (runs come and go while a consumer lives): in the worker's
        hash and in rq's per-queue worker sets, which `rq info <queue>`, rq-dashboard and
        Worker.all(queue=...) read; a queue no longer served loses it. Before start and after
        stop only the local list changes: rq's sets hold live workers only."""
        before = set(self.queue_names())
        self.queues = queues
        self._ordered_queues = queues[:]
        if not self._registered:
            return
        with self.connection.pipeline() as p:
            p.hset(self.key, "queues", ",".join(self.queue_names()))
            for name in before - set(self.queue_names()):
                p.srem(WORKERS_BY_QUEUE_KEY % name, self.key)
            worker_registration.register(self, pipeline=p)
            p.execute()

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self.clock.measure()
        self.register_birth()  # type: ignore[no-untyped-call]
        self._registered = True
        self.set_state(WorkerStatus.IDLE)

    def stop(self) -> None:
        """Leave rq's worker sets of every queue served (rq's register_death reads them from
        self.queues, which set_queues keeps current)."""
        self._registered = False
        self.register_death()  # type: ignore[no-untyped-call]

    # --- dequeue -------------------------------------------------------------------
    def dequeue(self, queue: Queue) -> tuple[Held | None, str | None]:
        """Take the next job of QUEUE and start it. Returns (held, None), (None, None) when the
        queue is empty, or (None, reason) when the job found cannot be run by genqueue: it is
        failed in rq (a foreign function, a pickle, garbage) or, when rq itself cannot load
        it (a hash gone or without data, a status or date rq does not parse), dropped from
        the queue; either way the reason is logged and kept under genqueue:refused:<queue>.
        A queue the gate holds back reads as empty."""
        if not self.gate(queue.name):
            return None, None
        moved = Queue.lmove(self.connection, queue.key, None)
        if moved is None:
            return None, None
        job_id = moved[1].decode() if isinstance(moved[1], bytes) else str(moved[1])
        try:
            job = Job.fetch(job_id, connection=self.connection, serializer=self.serializer)
            status = job.get_status(refresh=False)
        except Exception as e:  # noqa: BLE001 - whatever rq cannot load must not stop the consumer
            reason = f"refused: rq cannot load the job ({type(e).__name__}: {str(e)[:200]})"
            self._drop_unloadable(queue, job_id, reason)
            return None, f"job {job_id}: {reason}"
        if status != JobStatus.QUEUED:
            # Two sweeps can push one id twice; the second copy must not run it again.
            queue.intermediate_queue.remove(job.id)
            return None, None
        try:
            func = job.func_name
            _ = job.args, job.kwargs
        except Exception as e:  # noqa: BLE001 - a pickle or garbage: never unpickled, never run
            reason = f"refused: undecodable job payload ({type(e).__name__}); genqueue jobs are JSON"
            self._fail_foreign(queue, job, reason)
            return None, f"job {job.id}: {reason}"
        if not isinstance(func, str) or func not in TASKS:  # a list is unhashable: test the type first
            reason = f"refused: job names {str(func)[:200]!r}; genqueue runs only {TASK}"
            self._fail_foreign(queue, job, reason)
            return None, f"job {job.id}: {reason}"
        started_before = job.started_at is not None  # as fetched: the start is written next
        execution, given_back, taken = self._prepare_execution(job, queue)
        return Held(job, queue, execution, given_back=given_back, taken=taken, started_before=started_before), None

    def _now(self) -> datetime:
        """Now in Redis time: a job's start and end are read beside other consumers' (status)."""
        return datetime.fromtimestamp(self.clock.now(), UTC)

    def _prepare_execution(self, job: Job, queue: Queue) -> tuple[Execution, int, int]:
        """rq's prepare_execution and prepare_job_execution in one MULTI, the lease scored and the
        start written in Redis time: no sweeper ever sees the local clock's score, and no one a job
        both started and still between dequeue and start. Also counts this take (TAKEN_FIELD) and
        reads how often the job was given back and taken before. rq's worker heartbeat there is
        left to the renewals (every lease/3), and the job's own, which the start's fields hold:
        17 commands a take instead of 24 (two MULTIs)."""
        ts = self._now()
        with self.connection.pipeline() as p:
            execution = Execution.create(job, self.lease, pipeline=p, worker_name=self.name)
            self._score_lease(p, job, execution)
            self.executions[execution.id] = execution
            self.set_state(WorkerStatus.BUSY, pipeline=p)
            # rq's Job.prepare_for_execution, in Redis time
            job.worker_name, job.last_heartbeat, job.started_at = self.name, ts, ts
            job._status = JobStatus.STARTED
            p.hset(job.key, mapping={"last_heartbeat": rq.utils.utcformat(ts), "status": JobStatus.STARTED.value,
                                     "started_at": rq.utils.utcformat(ts), "worker_name": self.name})
            p.persist(job.key)
            p.lrem(queue.intermediate_queue_key, 1, job.id)
            p.hincrby(job.key, TAKEN_FIELD, 1)
            p.hget(job.key, GIVEN_BACK_FIELD)
            replies = p.execute(raise_on_error=False)
        *others, taken, given_back = replies
        for reply in others:
            if isinstance(reply, Exception):
                raise reply
        # A count someone overwrote with garbage (HINCRBY refuses it): taken before, to be safe.
        return execution, _count(given_back), taken - 1 if isinstance(taken, int) else 1

    def _score_lease(self, p: redis.client.Pipeline, job: Job, execution: Execution) -> None:
        """Queue (in P, after rq's own ZADDs) the lease's expiry in Redis time: the started
        registry's score, and the job's execution registry's (rq keeps it a minute longer)."""
        expiry = self.clock.now() + self.lease
        p.zadd(job.started_job_registry.key, {execution.composite_key: expiry}, xx=True)
        p.zadd(ExecutionRegistry.key_template.format(job.id), {execution.id: expiry + LEASE_RQ_SLACK}, xx=True)

    def _fail_foreign(self, queue: Queue, job: Job, reason: str) -> None:
        log.warning("job %s on %s: %s", job.id, queue.name, reason)
        with self.connection.pipeline() as p:
            p.lrem(queue.intermediate_queue_key, 1, job.id)
            job.set_status(JobStatus.FAILED, pipeline=p)
            job._handle_failure(reason, pipeline=p, worker_name=self.name)
            p.hset(refused_key(queue.name), job.id, reason)
            p.execute()

    def _drop_unloadable(self, queue: Queue, job_id: str, reason: str) -> None:
        log.warning("job %s on %s: %s; dropped from the queue", job_id, queue.name, reason)
        with self.connection.pipeline() as p:
            p.lrem(queue.intermediate_queue_key, 0, job_id)
            p.hset(refused_key(queue.name), job_id, reason)
            p.execute()

# --- leases --------------------------------------------------------------------
    def renew(self, held: list[Held]) -> list[Held]:
        """Extend the lease of every held job that is still ours, and the worker's heartbeat.
        Returns the jobs whose lease was lost (swept while Redis was out of reach, or while
        this process stood still): they are someone else's now and are not renewed, since
        renewing would put a swept lease back. A job whose lease was lost but that waits in its
        queue again, taken by no one, is taken back first (take_back) and stays ours. Three round
        trips, whatever the count (one re-measures the offset to Redis's clock), and one more
        transaction a lost lease."""
        self.clock.measure()
        with self.connection.pipeline() as p:
            for h in held:
                p.zscore(h.queue.started_job_registry.key, h.execution.composite_key)
            scores = p.execute() if held else []
        missing = [h for h, score in zip(held, scores, strict=True) if score is None]
        lost = [h for h in missing if not self.take_back(h)]
        kept = [h for h, score in zip(held, scores, strict=True) if score is not None or h not in lost]
        if len(missing) > len(lost):
            log.warning("%d job(s) whose lease was lost waited in their queue again, taken by no one (a Redis "
                        "back from an older snapshot, a sweep while this consumer stood still): taken back",
                        len(missing) - len(lost))
        with self.connection.pipeline() as p:
            self.heartbeat(self.lease + LEASE_RQ_SLACK, pipeline=p)
            # Put back what a cleaner took while this worker's hash had expired (Redis out of
            # reach for a lease and a minute): a live consumer stays listed by rq's tools.
            if self._registered:
                worker_registration.register(self, pipeline=p)
            ts = self._now()
            for h in kept:
                h.execution.heartbeat(h.queue.started_job_registry, self.lease, pipeline=p)
                self._score_lease(p, h.job, h.execution)
                h.job.heartbeat(ts, self.lease, pipeline=p, xx=True)
            p.execute()
        for h in lost:
            self.executions.pop(h.execution.id, None)
        if lost:
            self._idle_if_empty()
        return lost

    def take_back(self, held: Held) -> bool:
        """Start HELD again here, with an execution of its own, when its lease was lost but the job
        waits in its queue, taken by no one: a Redis that went back in time (restarted from an
        older snapshot, a failover) restores the jobs taken since to their queue, and a sweep puts
        a stopped consumer's jobs there. What it has in flight here and its records in this spool
        stay ours, where another consumer taking the job would make them again. One transaction
        (WATCH on the job's hash and its queue, which a take or a sweep changes); False, and
        nothing changed, when the job is not queued there (taken, acked, failed, deleted)."""
        job, queue = held.job, held.queue
        for _ in range(5):  # the queue moves under a busy fleet: look again a few times
            with self.connection.pipeline() as p:
                try:
                    p.watch(job.key, queue.key)  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
                    status = p.hget(job.key, "status")
                    # a job restored by a rewind was among the next to go: near the head (a queue of
                    # millions is not read whole; a job not found there stays lost)
                    if status != JobStatus.QUEUED.value.encode() or p.lpos(queue.key, job.id, maxlen=10_000) is None:
                        return False
                    ts = self._now()
                    p.multi()
                    p.lrem(queue.key, 1, job.id)
                    execution = Execution.create(job, self.lease, pipeline=p, worker_name=self.name)
                    self._score_lease(p, job, execution)
                    p.hset(job.key, mapping={"last_heartbeat": rq.utils.utcformat(ts), "status": JobStatus.STARTED.value,
                                             "started_at": rq.utils.utcformat(ts), "worker_name": self.name})
                    p.persist(job.key)
                    p.execute()
                except redis.WatchError:
                    continue
            self.executions.pop(held.execution.id, None)
            self.executions[execution.id] = execution
            held.execution = execution
            # as Redis has it now (a sweep spent a retry): the ack writes the job whole
            job.refresh()  # type: ignore[no-untyped-call]
            return True
        return False

    def still_ours(self, held: Held) -> bool:
        """Whether our execution of the job is still registered (a swept lease is not ours)."""
        score = self.connection.zscore(held.queue.started_job_registry.key, held.execution.composite_key)
        return score is not None

    # --- endings -------------------------------------------------------------------
    def finish(self, held: Held, manifest: dict[str, Any]) -> bool:
        """Ack: move the job to rq's finished registry with a small manifest as its result.
        Returns False (and does nothing) when the lease was lost to a sweep meanwhile and the
        job is not waiting in its queue again for this worker to take back (take_back)."""
        if not self.still_ours(held) and not self.take_back(held):
            log.warning("job %s: lease lost before ack; leaving it to its new owner", held.id)
            self.executions.pop(held.execution.id, None)
            return False
        job = held.job
        job.ended_at = self._now()
        job._result = manifest
        job._status = JobStatus.FINISHED
        self.handle_job_success(job, held.queue, held.queue.started_job_registry, held.execution)
        self._idle_if_empty()
        return True

    def fail(self, held: Held, reason: str, *, retry: bool) -> None:
        """The job failed as a whole; with retry it goes back to the queue while its budget lasts."""
        job = held.job
        job.ended_at = self._now()
        if not retry:
            job.retries_left = 0
        self.handle_job_failure(job, held.queue, held.queue.started_job_registry, exc_string=reason,
                                execution=held.execution)
        self._idle_if_empty()

    def give_back(self, held: Held) -> bool:
        """Put an unfinished job back at the front of its queue without spending a retry (the
        give-back is counted in the job's hash: the next take is its next attempt), while it is
        still ours: our execution in the started registry, checked and given back in one
        transaction (WATCH on the job's hash and executions, which an ack or a sweep changes).
        A job acked meanwhile (a stop's give-back queued in this thread behind the job's ack) or
        swept to another consumer is left as it is, never finished and queued at once: False."""
        job = held.job
        watched = (job.key, ExecutionRegistry.key_template.format(job.id))
        with self.connection.pipeline() as p:
            while True:
                try:
                    p.watch(*watched)  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
                    if p.zscore(held.queue.started_job_registry.key, held.execution.composite_key) is None:
                        log.info("job %s: no longer ours (acked or swept meanwhile); not given back", held.id)
                        self.executions.pop(held.execution.id, None)
                        self._idle_if_empty()
                        return False
                    p.multi()
                    self.cleanup_execution(job, pipeline=p, execution=held.execution)
                    job.set_status(JobStatus.QUEUED, pipeline=p)
                    p.hincrby(job.key, GIVEN_BACK_FIELD, 1)
                    held.queue.push_job_id(job.id, pipeline=p, at_front=True)
                    p.execute()
                    break
                except redis.WatchError:  # a sweep moved it meanwhile: look again
                    continue
        self._idle_if_empty()
        return True

    def _idle_if_empty(self) -> None:
        if not self.executions:
            self.set_state(WorkerStatus.IDLE)

    # --- maintenance ---------------------------------------------------------------
    def sweep(self, queue: Queue) -> int:
        """Re-queue jobs whose lease expired (their consumer died). Returns how many were swept.

        Holds the queue's maintenance lock (rq's key, with a short expiry so a sweeper killed
        mid-sweep does not stall the next one for rq's 15 minutes): two sweeps never race.
        """
        if not self.connection.set(queue.registry_cleaning_key, self.name, nx=True, ex=max(self.lease, 10)):
            return 0
        try:
            registry: StartedJobRegistry = queue.started_job_registry
            # One cutoff for the query and the cleanup: a lease renewed in between is not swept.
            cutoff = self.clock.now()
            expired = registry.get_expired_job_ids(cutoff)
            if expired:
                log.warning("queue %s: %d abandoned job(s) past their lease; re-queueing", queue.name, len(expired))
                registry.cleanup(cutoff)
            # As rq's own workers do under this lock: a dead (SIGKILLed) consumer leaves rq's
            # worker sets once its hash has expired (a lease and a minute without a heartbeat).
            worker_registration.clean_worker_registry(queue)
            # and the finished registry's entries of jobs expired after RESULT_TTL (rq's workers
            # clean it in their maintenance; a finished run's zset would keep a member a job)
            queue.finished_job_registry.cleanup(cutoff)
            return len(expired) + self._reclaim_intermediate(queue)
        finally:
            self.connection.delete(queue.registry_cleaning_key)

    def _reclaim_intermediate(self, queue: Queue) -> int:
        """Jobs stuck between dequeue and start (their consumer died, or lost Redis, between the
        two) go back to the front of the queue once seen stuck for a lease, without spending a
        retry: they never ran. rq's own cleanup waits a minute and then spends one."""
        stuck = [j for j in queue.intermediate_queue.get_job_ids() if j not in queue.started_job_registry]
        back = 0
        now_ts = self.clock.now()  # the marks are compared by every consumer: Redis time
        for job_id in stuck:
            if not self.connection.hexists(Job.key_for(job_id), "data"):
                # rq cannot load it: pushing it back would only move it here again.
                self._drop_unloadable(queue, job_id, "refused: the job's hash is gone or holds no data")
                continue
            mark = f"{KEY_PREFIX}:intermediate:{queue.name}:{job_id}"
            self.connection.set(mark, now_ts, nx=True, ex=24 * 3600)
            seen = float(self.connection.get(mark) or now_ts)
            if now_ts - seen < self.lease:
                continue
            with self.connection.pipeline() as p:
                p.lrem(queue.intermediate_queue_key, 1, job_id)
                p.hset(Job.key_for(job_id), "status", JobStatus.QUEUED.value)
                queue.push_job_id(job_id, pipeline=p, at_front=True)
                p.delete(mark)
                p.execute()
            log.warning("queue %s: job %s was stuck between dequeue and start; back to the queue", queue.name,
                        job_id)
            back += 1
        return back


def _count(raw: object) -> int:
    """A counter field's value (absent, or not a count someone wrote by hand: 0)."""
    try:
        return max(int(raw), 0) if isinstance(raw, bytes | str | int) else 0
    except ValueError:
        return 0


#: A test hook: seconds to set this process's wall clock behind (tests/consumer/test_lease_clock.py).
#: libfaketime would be the real thing, but under it Python 3.11's time.sleep fails (EINVAL)
#: when the monotonic clock is left alone, and timed thread waits hang when it is not.
TEST_CLOCK_BEHIND = "GENQUEUE_TEST_CLOCK_BEHIND"


def _skew_for_tests() -> None:
    """With TEST_CLOCK_BEHIND set, this process's time.time and rq's clock (every lease score
    rq writes) run that many seconds behind, as on a node without NTP. Never set otherwise."""
    behind = float(os.environ.get(TEST_CLOCK_BEHIND) or 0)
    if not behind or getattr(time.time, "skewed", False):
        return
    real = time.time

    def skewed() -> float:
        return real() - behind

    skewed.skewed = True  # type: ignore[attr-defined]
    time.time = skewed
    rq.utils.now = lambda: datetime.fromtimestamp(time.time(), UTC)
    log.warning("test hook: this process's clock runs %.0f s behind (%s)", behind, TEST_CLOCK_BEHIND)


def sweep_in_redis_time() -> None:
    """Make rq's `StartedJobRegistry.cleanup`, in this process, sweep by Redis's clock when it
    is given no timestamp. rq's cleanup sweeps the leases expired by this host's clock;
    genqueue scores leases in Redis's clock (common/keepers/clock.py), so a reader of registries on a
    host whose clock runs ahead (rq-dashboard counts and lists them through cleanup: `consumer
    dashboard` calls this) would re-queue live jobs. Idempotent."""
    from genqueue.common.keepers.clock import redis_time

    if getattr(StartedJobRegistry.cleanup, "redis_time", False):
        return
    local = StartedJobRegistry.cleanup

    def cleanup(self: Any, timestamp: float | None = None, exception_handlers: list[Any] | None = None) -> Any:
        if timestamp is None:
            timestamp = redis_time(self.connection)
        return local(self, timestamp, exception_handlers)

    cleanup.redis_time = True  # type: ignore[attr-defined]
    setattr(StartedJobRegistry, "cleanup", cleanup)  # noqa: B010
