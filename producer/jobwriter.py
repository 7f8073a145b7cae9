"""Put items into a run's queue exactly once, however many producers race on the run.

For each slice of new items: claim them (`RunStore.claim`, one atomic script), cut the items
this producer won into jobs, and enqueue those jobs in one MULTI/EXEC that also deletes the
claim set. Racing producers split the items between them; each item lands in exactly one
job. Under a race a slice's last job may be short, so a run fed by N racing producers can
have up to N-1 short jobs per slice more than one fed once.

The one window: a producer killed (SIGKILL, power loss) after its claim and before its
transaction leaves the slice's won items in the run's keys set and in no job. Their claim set
(`genqueue:run:<run>:claim:<id>`, kept CLAIM_TTL) still names them; see runs.py. An error or
Ctrl-C in that window releases the claim instead, so running the command again queues them.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from itertools import count

import redis
from rq import Retry

from genqueue.common import defaults
from genqueue.common.contracts import Item
from genqueue.common.redact import redact
from genqueue.common.rqaccess import TASK, job_description, job_id, queue_for, use_fast_job_compression
from genqueue.common.runs import RunStore, claim_key, key_digest

log = logging.getLogger(__name__)

#: A transaction whose reply was lost is checked (did its DEL of the claim set land?) and sent
#: again at most this many times in all.
COMMIT_ATTEMPTS = 3


class JobWriter:
    """Claims and enqueues the items of one producer invocation."""

    def __init__(self, run: str, conn: redis.Redis, *, batch_size: int, retries: int = defaults.JOB_RETRIES) -> None:
        self.run = run
        self.conn = conn
        self.store = RunStore(conn)
        self.queue = queue_for(run, conn)
        self.batch_size = batch_size
        self.retries = retries
        # One id per invocation, one claim set per slice: a slice's claim set is deleted by the
        # transaction that enqueues it, so its absence proves the transaction landed.
        self._claim_prefix = uuid.uuid4().hex
        self._seq = count()
        use_fast_job_compression()

    def write(self, items: Sequence[Item]) -> tuple[list[bool], int]:
        """Claim ITEMS and enqueue the ones won. Returns, per item, whether it is this
        producer's (now in a job), and the number of jobs enqueued."""
        claim_id = f"{self._claim_prefix}:{next(self._seq)}"
        try:
            won = self.store.claim(self.run, claim_id, [key_digest(it["key"]) for it in items])
            mine = [it for it, ok in zip(items, won, strict=True) if ok]
            batches = [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
            if batches:
                self._commit(claim_id, batches)
        except BaseException:
            self._release(claim_id)  # the claim may have landed even if its reply did not
            raise
        return won, len(batches)

    def _commit(self, claim_id: str, batches: list[list[Item]]) -> None:
        datas = [
            self.queue.prepare_data(
                TASK,
                args=[items],
                job_id=job_id(self.run, [it["key"] for it in items]),
                description=job_description(self.run, items),
                retry=Retry(max=self.retries),
                result_ttl=defaults.RESULT_TTL,
                timeout=-1,
                meta={"items": len(items)},
            )
            for items in batches
        ]
        ckey = claim_key(self.run, claim_id)
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                # WATCH: should the client be set to retry (a URL option, another default),
                # redis-py raises instead of re-sending a transaction whose reply it lost,
                # which would queue every job twice.
                with self.conn.pipeline(transaction=True) as pipe:
                    pipe.watch(ckey)  # type: ignore[no-untyped-call]
                    pipe.multi()
                    self.queue.enqueue_many(datas, pipeline=pipe)
                    pipe.delete(ckey)
                    pipe.execute()
                return
            except (redis.exceptions.WatchError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if not self.conn.exists(ckey):
                    return  # it landed: the reply was lost, not the transaction
                if attempt == COMMIT_ATTEMPTS:
                    raise
                log.warning("enqueue transaction of %s not applied; sending it again", ckey)

    def _release(self, claim_id: str) -> None:
        """Give a failed slice's claim back, if its transaction did not land; best effort."""
        try:
            if self.conn.exists(claim_key(self.run, claim_id)):
                n = self.store.release(self.run, claim_id)
                log.warning("released %d claimed items of run %s that were not enqueued", n, self.run)
        except redis.exceptions.RedisError as e:
            log.warning(
                "could not release claim %s of run %s (%s): its items stay claimed and unqueued until a "
                "reconcile", claim_id, self.run, redact(str(e)),
            )
