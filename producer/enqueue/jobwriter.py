"""Put items into a run's queue exactly once, however many producers race on the run.

For each slice of new items: claim them (`Claims.claim`, one atomic script), cut the items this
producer won into jobs, and enqueue those jobs in one MULTI/EXEC that also deletes the claim set:
racing producers split the items, each lands in exactly one job. A job ends where a record's
items end when the next record's would not fit (a conversation's turns, a prompt's samples share
a prompt prefix, which one engine's prefix cache then serves, sent in order); a record with more
items than a job holds fills jobs of its own. Under a race a slice's last job may be short.

The one window: a producer killed after its claim and before its transaction leaves its won
items in the run and in no job; their claim set (kept CLAIM_TTL: common/keepers/claims.py) names
them, and the next `producer enqueue` takes it over once older than CLAIM_GRACE (reconcile.py).
An error or Ctrl-C in that window gives the claim back instead.

`requeue`: items in the run with no result and no live job (lost, or failed with --retry-failed)
take the same two steps under the run's lock: a re-claim script fenced by the lock's token, then
the transaction, WATCHing the lock (a producer that lost its lock re-queues nothing). By
reference (a PACK_STORE given), a slice's items are first written as one pack, one block a job,
and the transaction also names the pack in the run's pack table (common/keepers/packs.py); each
job's `meta` names its pack and block. Job ids and descriptions are the same in both modes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from itertools import count

import redis
from redis.client import Pipeline
from rq import Retry
from rq.queue import EnqueueData

from genqueue.common.contracts import Item
from genqueue.common.keepers.claims import CLAIM_GRACE, CLAIM_TTL, Claims, ReclaimLockLostError, Requeue
from genqueue.common.keepers.itemlayout import PACK_SLOTS
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.rqaccess import (
    JOB_RETRIES,
    TASK,
    PackRef,
    job_description,
    job_id,
    queue_for,
    reference_meta,
    use_fast_job_compression,
)
from genqueue.common.keepers.runlock import RunLock
from genqueue.common.keepers.runs import RunLockedError, RunStore, key_digest
from genqueue.common.packs import PackWriter
from genqueue.common.redact import redact
from genqueue.common.storage import PackStore, pack_name
from genqueue.common.storage.names import pack_tag

log = logging.getLogger(__name__)

# Requeue is the re-claim script's answer (common/keepers/claims.py); named here too for slices.py.
__all__ = ["COMMIT_ATTEMPTS", "JobWriter", "Requeue"]

#: Tries, in all, of a transaction whose reply was lost (did its DEL of the claim set land?).
COMMIT_ATTEMPTS = 3
#: Seconds rq keeps a finished job (docs/decisions.md, "rq keeps a finished job ten minutes").
RESULT_TTL = 600


def same_record(a: Item, b: Item) -> bool:
    """A and B come from one input record (a conversation's turns, a prompt's samples)."""
    return a["index"] == b["index"] and a.get("source_seq", 0) == b.get("source_seq", 0)


def record_batches(items: Sequence[Item], size: int) -> list[list[Item]]:
    """ITEMS in jobs of at most SIZE, a record's items kept in one job where they fit (see the
    module docstring); order kept."""
    batches: list[list[Item]] = []
    cur: list[Item] = []
    i, n = 0, len(items)
    while i < n:
        j = i + 1
        while j < n and same_record(items[j], items[i]):
            j += 1
        group = items[i:j]
        if cur and len(cur) + len(group) > size:
            batches.append(cur)
            cur = []
        while len(group) > size:  # longer than a job: jobs of its own
            batches.append(list(group[:size]))
            group = group[size:]
        cur.extend(group)
        i = j
    if cur:
        batches.append(cur)
    return batches


def pack_parts(items: Sequence[Item], size: int = PACK_SLOTS) -> list[Sequence[Item]]:
    """ITEMS in parts of at most SIZE (a pack's), each cut where a record ends when one ends in
    it (a record longer than SIZE is cut where it must); order kept."""
    parts: list[Sequence[Item]] = []
    lo, n = 0, len(items)
    while lo < n:
        hi = min(lo + size, n)
        if hi < n:
            cut = hi
            while cut > lo + 1 and same_record(items[cut], items[cut - 1]):
                cut -= 1
            if cut > lo + 1 or not same_record(items[cut], items[cut - 1]):
                hi = cut
        parts.append(items[lo:hi])
        lo = hi
    return parts


def _by_slot(items: Sequence[Item], slots: Sequence[int]) -> list[Item]:
    """The ITEMS whose slot is not -1, in slot order (inline every slot is 0: their order)."""
    return [it for _, _, it in sorted((s, i, it) for i, (it, s) in enumerate(zip(items, slots, strict=True)) if s >= 0)]


class JobWriter:
    """Claims and enqueues the items of one producer invocation."""

    def __init__(self, run: str, conn: redis.Redis, *, batch_size: int, retries: int = JOB_RETRIES,
                 lock: RunLock | None = None, pack_store: PackStore | None = None) -> None:
        self.run = run
        # By reference when given: where the slices' packs go (the run's output store).
        self.pack_store = pack_store
        self.packs = PackTable(conn, run)
        self.pack_names: dict[int, str] = {}  # the packs this writer wrote and named, by number
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
        self.claims = Claims(conn)
        use_fast_job_compression()

    @property
    def claim_prefix(self) -> str:
        """The start of every claim id of this writer (its claim sets are its own)."""
        return self._claim_prefix

    def write(self, items: Sequence[Item], *, turn: Callable[[], None] | None = None) -> tuple[list[bool], int]:
        """Claim ITEMS and enqueue the ones won. Returns, per item, whether it is this
        producer's (now in a job), and the number of jobs enqueued. Waits while another
        producer holds the run's lock. TURN, when given, is called right before the enqueue
        transaction (after the pack's PUT): the caller's writers, several at once, queue their
        slices' jobs in the order it handed the slices out. By reference a pack holds at most
        PACK_SLOTS items: a longer ITEMS is claimed and queued a pack at a time."""
        if self.pack_store is not None and len(items) > PACK_SLOTS:
            won_all: list[bool] = []
            jobs = 0
            for k, part in enumerate(pack_parts(items)):
                won, n = self.write(part, turn=turn if k == 0 else None)
                won_all += won
                jobs += n
            return won_all, jobs
        claim_id = f"{self._claim_prefix}:{next(self._seq)}"
        digests = [key_digest(it["key"]) for it in items]
        # By reference the pack's number is given out first: the claim writes each item's place
        # (the pack, its slot) in its entry, where the consumers' marks find it.
        number = self.packs.allocate() if self.pack_store is not None else 0
        try:
            while True:
                try:
                    slots = self.claims.claim_slots(self.run, claim_id, digests, pack=number,
                                                    token=self.lock.token if self.lock.held else None)
                    break
                except RunLockedError:
                    self.lock.wait_free()
            batches = record_batches(_by_slot(items, slots), self.batch_size)
            if batches:
                self._commit(claim_id, batches, turn=turn, number=number)
        except BaseException:
            self._release(claim_id)  # the claim may have landed even if its reply did not
            raise
        return [x >= 0 for x in slots], len(batches)

    def requeue(self, items: Sequence[Item], *, retry_failed: bool) -> tuple[list[Requeue], int]:
        """Put ITEMS, already in the run, in jobs again: those that are still without a result
        (and, unless RETRY_FAILED, without an error record). The caller holds the run's lock and
        has checked that none of them is in a live job. Returns, per item, what happened, and
        the number of jobs enqueued."""
        if not self.lock.held:
            raise RuntimeError("requeue needs the run's lock")
        if self.pack_store is not None and len(items) > PACK_SLOTS:
            codes_all: list[Requeue] = []
            jobs = 0
            for part in pack_parts(items):
                codes, n = self.requeue(part, retry_failed=retry_failed)
                codes_all += codes
                jobs += n
            return codes_all, jobs
        self.lock.check()
        claim_id = f"{self._claim_prefix}:{next(self._seq)}"
        number = self.packs.allocate() if self.pack_store is not None else 0
        try:
            try:
                codes, slots = self.claims.reclaim(self.run, claim_id, ttl=CLAIM_TTL, token=self.lock.token,
                                                   retry_failed=retry_failed, pack=number,
                                                   digests=[key_digest(it["key"]) for it in items])
            except ReclaimLockLostError:
                self.lock.lost = True
                self.lock.check()
                raise
            taken = [s if c is Requeue.QUEUED else -1 for c, s in zip(codes, slots, strict=True)]
            batches = record_batches(_by_slot(items, taken), self.batch_size)
            if batches:
                self._commit(claim_id, batches, fenced=True, number=number)
        except BaseException:
            self._drop(claim_id)
            raise
        return codes, len(batches)

    def _commit(self, claim_id: str, batches: list[list[Item]], *, fenced: bool = False,
                turn: Callable[[], None] | None = None, number: int = 0) -> None:
        if self.pack_store is None:
            datas = [
                self.queue.prepare_data(
                    TASK,
                    args=[items],
                    job_id=job_id(self.run, [it["key"] for it in items]),
                    description=job_description(self.run, items),
                    retry=Retry(max=self.retries),
                    result_ttl=RESULT_TTL,
                    timeout=-1,
                    meta={"items": len(items)},
                )
                for items in batches
            ]
            self._transact(claim_id, datas, fenced=fenced, turn=turn)
            return
        name = self._write_pack(self.pack_store, batches, number)
        datas = [
            self.queue.prepare_data(
                TASK,
                args=[],
                job_id=job_id(self.run, [it["key"] for it in items]),
                description=job_description(self.run, items),
                retry=Retry(max=self.retries),
                result_ttl=RESULT_TTL,
                timeout=-1,
                meta=reference_meta(len(items), PackRef(number, block, pack_tag(name))),
            )
            for block, items in enumerate(batches)
        ]
        self._transact(claim_id, datas, fenced=fenced, turn=turn,
                       also=lambda pipe: self.packs.stage(pipe, number, name))
        self.pack_names[number] = name

    def _write_pack(self, store: PackStore, batches: list[list[Item]], number: int) -> str:
        """BATCHES as one pack in STORE (the run's output), a block per job, as pack number NUMBER
        (the items in slot order: a block's first item is at the slot the index says); returns
        the pack's name. Raises StoreError."""
        writer = PackWriter()
        for items in batches:
            writer.add_block(items)
        name = pack_name(self._claim_prefix, number)
        store.put_pack(self.run, name, writer.finish())
        return name

    def _transact(self, claim_id: str, datas: list[EnqueueData], *, fenced: bool,
                  also: Callable[[Pipeline], None] | None = None, turn: Callable[[], None] | None = None) -> None:
        if turn is not None:  # the slices handed out before this one queue their jobs first
            turn()
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                # Fenced (a re-queue): the lock is WATCHed too, and must still be this producer's.
                if not self.claims.enqueue(self.queue, datas, self.run, claim_id,
                                          token=self.lock.token if fenced else None, also=also):
                    self.lock.lost = True
                    self.lock.check()  # raises: a re-queue holds the lock, and it is lost now
                return
            except (redis.exceptions.WatchError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if not self.claims.exists(self.run, claim_id):
                    return  # it landed: the reply was lost, not the transaction
                if attempt == COMMIT_ATTEMPTS:
                    raise
                log.warning("enqueue transaction of claim %s of run %s not applied; sending it again", claim_id, self.run)

    def _drop(self, claim_id: str) -> None:
        """Drop a re-claim that did not end in its transaction: its items stay in the run (they
        were before) and in no job, for a later reconcile; best effort (it expires)."""
        try:
            self.claims.drop(self.run, claim_id)
        except redis.exceptions.RedisError as e:
            log.warning("could not drop re-claim %s of run %s (%s): a reconcile takes it over after %d s",
                        claim_id, self.run, redact(str(e)), CLAIM_GRACE)

    def _release(self, claim_id: str) -> None:
        """Give a failed slice's claim back, if its transaction did not land; best effort."""
        try:
            if self.claims.exists(self.run, claim_id):
                n = self.claims.release(self.run, claim_id)
                log.warning("released %d claimed items of run %s that were not enqueued", n, self.run)
        except redis.exceptions.RedisError as e:
            log.warning(
                "could not release claim %s of run %s (%s): its items stay claimed and unqueued until a "
                "reconcile", claim_id, self.run, redact(str(e)),
            )

