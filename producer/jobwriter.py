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
The next `producer enqueue` of the run closes the window: once the claim set is older than
CLAIM_GRACE it takes it over and queues its items like any item with no result and no job
(producer/reconcile.py).

Re-queueing (`requeue`): items already in the run with no result and no live job (lost from
rq, or failed with --retry-failed) go through the same two steps, under the run's lock
(common/runlock.py): a re-claim script puts the ones still in that state in a claim set of
this producer, fenced by the lock's token, then the same transaction enqueues them, WATCHing the
lock too. A producer that lost its lock re-queues nothing; a re-claim that did not end in its
transaction is dropped (the items stay in the run, for a later reconcile).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from enum import IntEnum
from itertools import count

import redis
from rq import Retry

from genqueue.common import defaults
from genqueue.common.contracts import Item
from genqueue.common.marks import done_key, failed_key
from genqueue.common.redact import redact
from genqueue.common.rqaccess import TASK, job_description, job_id, queue_for, use_fast_job_compression
from genqueue.common.runlock import RunLock
from genqueue.common.runs import LUA_CALL_IN_PARTS, RunLockedError, RunStore, claim_key, key_digest, lock_key, run_key

log = logging.getLogger(__name__)

#: A transaction whose reply was lost is checked (did its DEL of the claim set land?) and sent
#: again at most this many times in all.
COMMIT_ATTEMPTS = 3


class Requeue(IntEnum):
    """What a re-queue did with one item (the re-claim script's answer)."""

    SKIPPED = 0  # not in the run any more, or repeated in the slice
    QUEUED = 1  # this producer put it in a job
    DONE = 2  # a shipped shard holds its result by now
    FAILED = 3  # it has an error record and failed items are not retried


class JobWriter:
    """Claims and enqueues the items of one producer invocation."""

    def __init__(self, run: str, conn: redis.Redis, *, batch_size: int, retries: int = defaults.JOB_RETRIES,
                 lock: RunLock | None = None) -> None:
        self.run = run
        self.conn = conn
        self.store = RunStore(conn)
        self.queue = queue_for(run, conn)
        self.batch_size = batch_size
        self.retries = retries
        self.lock = lock if lock is not None else RunLock(conn, run)
        # One id per invocation, one claim set per slice: a slice's claim set is deleted by the
        # transaction that enqueues it, so its absence proves the transaction landed.
        self._claim_prefix = uuid.uuid4().hex
        self._seq = count()
        self._reclaim = conn.register_script(_RECLAIM)
        use_fast_job_compression()

    @property
    def claim_prefix(self) -> str:
        """The start of every claim id of this writer (its claim sets are its own)."""
        return self._claim_prefix

    def write(self, items: Sequence[Item]) -> tuple[list[bool], int]:
        """Claim ITEMS and enqueue the ones won. Returns, per item, whether it is this
        producer's (now in a job), and the number of jobs enqueued. Waits while another
        producer holds the run's lock."""
        claim_id = f"{self._claim_prefix}:{next(self._seq)}"
        digests = [key_digest(it["key"]) for it in items]
        try:
            while True:
                try:
                    won = self.store.claim(self.run, claim_id, digests,
                                           token=self.lock.token if self.lock.held else None)
                    break
                except RunLockedError:
                    self.lock.wait_free()
            mine = [it for it, ok in zip(items, won, strict=True) if ok]
            batches = [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
            if batches:
                self._commit(claim_id, batches)
        except BaseException:
            self._release(claim_id)  # the claim may have landed even if its reply did not
            raise
        return won, len(batches)

    def requeue(self, items: Sequence[Item], *, retry_failed: bool) -> tuple[list[Requeue], int]:
        """Put ITEMS, already in the run, in jobs again: those that are still without a result
        (and, unless RETRY_FAILED, without an error record). The caller holds the run's lock and
        has checked that none of them is in a live job. Returns, per item, what happened, and
        the number of jobs enqueued."""
        if not self.lock.held:
            raise RuntimeError("requeue needs the run's lock")
        self.lock.check()
        claim_id = f"{self._claim_prefix}:{next(self._seq)}"
        keys = [run_key(self.run, "keys"), claim_key(self.run, claim_id), done_key(self.run),
                failed_key(self.run), lock_key(self.run)]
        try:
            try:
                raw = self._reclaim(keys=keys, args=[defaults.CLAIM_TTL, self.lock.token, int(retry_failed),
                                                     *(key_digest(it["key"]) for it in items)])
            except redis.exceptions.ResponseError as e:
                if str(e).startswith(LOCK_LOST):
                    self.lock.lost = True
                    self.lock.check()
                raise
            codes = [Requeue(int(c)) for c in raw]
            mine = [it for it, c in zip(items, codes, strict=True) if c is Requeue.QUEUED]
            batches = [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
            if batches:
                self._commit(claim_id, batches, fenced=True)
        except BaseException:
            self._drop(claim_id)
            raise
        return codes, len(batches)

    def _commit(self, claim_id: str, batches: list[list[Item]], *, fenced: bool = False) -> None:
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
                # which would queue every job twice. Fenced (a re-queue): the lock is WATCHed
                # too, and must still be this producer's.
                with self.conn.pipeline(transaction=True) as pipe:
                    if fenced:
                        pipe.watch(ckey, lock_key(self.run))  # type: ignore[no-untyped-call]
                        if _text(pipe.get(lock_key(self.run))) != self.lock.token:
                            self.lock.lost = True
                            self.lock.check()
                    else:
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

    def _drop(self, claim_id: str) -> None:
        """Drop a re-claim that did not end in its transaction: its items stay in the run (they
        were before) and in no job, for a later reconcile; best effort (it expires)."""
        try:
            self.conn.delete(claim_key(self.run, claim_id))
        except redis.exceptions.RedisError as e:
            log.warning("could not drop re-claim %s of run %s (%s): a reconcile takes it over after %d s",
                        claim_id, self.run, redact(str(e)), defaults.CLAIM_GRACE)

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


def _text(value: object) -> str | None:
    return None if value is None else value.decode() if isinstance(value, bytes) else str(value)


#: The error the re-claim script answers when the caller's token no longer holds the lock.
LOCK_LOST = "GENQUEUE_LOCK_LOST"

# KEYS: the run's keys set, this re-claim's claim set, the done set, the failed set, the lock.
# ARGV: the claim set's TTL, the lock token, 1 to take items with an error record, the digests.
# Refused, before any write, unless the lock holds the token. A digest is this re-claim's
# (1) when an earlier send of it took it, or when it is in the run, not done and (unless
# retried) not failed; else 0 (not in the run, or repeated), 2 (done) or 3 (failed).
_RECLAIM = """
if redis.call('GET', KEYS[5]) ~= ARGV[2] then
  return redis.error_reply('GENQUEUE_LOCK_LOST')
end
""" + LUA_CALL_IN_PARTS + """local digests = {}
for i = 4, #ARGV do digests[#digests + 1] = ARGV[i] end
local in_run = call('SMISMEMBER', KEYS[1], digests)
local done = call('SMISMEMBER', KEYS[3], digests)
local failed = call('SMISMEMBER', KEYS[4], digests)
local mine = {}
if redis.call('EXISTS', KEYS[2]) == 1 then mine = call('SMISMEMBER', KEYS[2], digests) end
local out, add, seen = {}, {}, {}
for i, d in ipairs(digests) do
  local code = 0
  if seen[d] then
    code = 0
  elseif mine[i] == 1 then
    code = 1
  elseif in_run[i] == 0 then
    code = 0
  elseif done[i] == 1 then
    code = 2
  elseif failed[i] == 1 and ARGV[3] ~= '1' then
    code = 3
  else
    code = 1
    add[#add + 1] = d
  end
  seen[d] = true
  out[i] = code
end
if #add > 0 then call('SADD', KEYS[2], add) end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return out
"""
