"""Results on their way out: per-run shard writers, sealing, and one ordered shipper.

Sealing and shipping are apart so that a slow or unreachable store (S3 down) never stops
results from being written: sealed shards queue up on local disk, the shipper retries with
backoff, and the consumer pauses admission once the spool passes its size limit. Shards of a
run are shipped in order, so "shipped up to seq N" is one number per run, and a job is
acked once the last shard holding its results is shipped.

A --capture run's feature shards (features.py) ride the same line: a run's open feature shard
is sealed whenever its result shard is, and queued before it, so every feature row a record
names is stored before that record is (and before its job is acked). A feature shard lost from
the spool makes every later result shard of ours that names it lost too: its jobs are redone.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum

from genqueue.common.backoff import store_backoff
from genqueue.common.features import FeatureStore, SealedFeatureShard, ShardIndex, feature_store_for
from genqueue.common.keepers.marks import Place, ShardMarks, marks_of_file
from genqueue.common.keepers.runs import key_digest
from genqueue.common.records import Record
from genqueue.common.redact import redact
from genqueue.common.storage import SealedShard, ShardStore
from genqueue.consumer.shipping.features import FeatureOutputs, FeatureSpool, disk_error_message, feature_shards_of
from genqueue.consumer.shipping.shards import ShardWriter

log = logging.getLogger(__name__)

#: What waits in the shipping line: a result shard, or a feature shard its records may name.
Sealed = SealedShard | SealedFeatureShard


class ShipOutcome(StrEnum):
    """What became of one sealed shard."""

    SHIPPED = "shipped"  # stored at the run's output: its jobs may be acked
    LOST = "lost"  # gone from the spool before shipping: its jobs are redone
    NO_RUN = "no_run"  # its run is gone from Redis: left in the spool, nothing acked


@dataclass(frozen=True, slots=True)
class RunShipping:
    """One run's share of the outbox: shipped, waiting on disk, records not shipped yet."""

    shards: int = 0
    bytes: int = 0
    waiting_shards: int = 0
    unshipped_records: int = 0  # in the open shard and the sealed ones waiting
    last_upload_at: float | None = None
    oldest_waiting_at: float | None = None


@dataclass(frozen=True, slots=True)
class OutboxSnapshot:
    shards: int
    bytes: int
    waiting_shards: int
    spool_bytes: int
    last_upload_at: float | None
    last_error: str | None
    last_error_at: float | None
    oldest_waiting_at: float | None
    failures: int
    lost: int
    disk_error: str | None
    runs: dict[str, RunShipping] = field(default_factory=dict)


class Outbox:
    """Writes records, seals shards when due, ships them in order, reports what shipped."""

    def __init__(self, spool: str, worker: str, *, max_bytes: int, max_age: float, spool_limit: int,
                 store_for: Callable[[str], ShardStore], output_of: Callable[[str], Awaitable[str | None]],
                 on_shipped: Callable[[str, int | None, ShardMarks], Awaitable[object]],
                 on_lost: Callable[[str, int], Awaitable[object]],
                 on_no_run: Callable[[str], Awaitable[object]],
                 feature_store_for: Callable[[str], FeatureStore] = feature_store_for,
                 on_features: Callable[[str, ShardIndex], Awaitable[object]] | None = None) -> None:
        self.spool = spool
        self.worker = worker
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.spool_limit = spool_limit
        self._store_for = store_for
        self._stores: dict[str, ShardStore] = {}
        self._output_of = output_of
        self._on_shipped = on_shipped
        self._on_lost = on_lost
        self._on_no_run = on_no_run
        self.writers: dict[str, ShardWriter] = {}
        self.queue: collections.deque[Sealed] = collections.deque()
        # --capture: the open feature shards, where they ship, and what a lost one takes with it
        self.features = FeatureSpool(spool, worker)
        self._feature_outputs = FeatureOutputs(self.features, feature_store_for)
        self._on_features = on_features
        self._names: dict[tuple[str, int], set[str]] = {}  # (run, seq) of ours -> feature shards its records name
        self._lost_features: set[tuple[str, str]] = set()  # (run, feature shard)
        self.waiting_bytes = 0  # sealed, not yet shipped
        self.shipping = False
        self.stats: collections.Counter[str] = collections.Counter()
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self._disk_error: str | None = None  # the result shards' (the feature rows' is the FeatureSpool's)
        self._disk_error_since: float | None = None
        self.last_upload_at: float | None = None
        self._shipped_by_run: dict[str, tuple[int, int, float]] = {}  # shards, bytes, last upload
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ship")
        self._kick = asyncio.Event()
        self.stopping_hard = False
        self._orphaned: set[str] = set()
        self._queued_at: dict[str, float] = {}
        self._parked: dict[str, list[Sealed]] = {}  # shards of runs gone from Redis
        self._marks: dict[tuple[str, int], ShardMarks] = {}  # (run, seq) of our own shards
        self._read_marks: dict[str, ShardMarks] = {}  # leftover shards, read back from disk
        # run -> item digest -> seq of our shard not shipped yet that holds a result of it
        self._written: dict[str, dict[bytes, int]] = {}

    # --- writing -------------------------------------------------------------------
    def append(self, run: str, record: Record, *, place: Place | None = None) -> int:
        """Append RECORD to RUN's open shard; returns the shard's sequence number. PLACE: its
        item's place, when its job is by reference (marked there when the shard ships)."""
        w = self.writers.get(run)
        if w is None:
            w = self.writers[run] = ShardWriter(self.spool, run, self.worker, max_bytes=self.max_bytes,
                                                max_age=self.max_age)
        seq = w.append(record)
        if names := feature_shards_of(record):
            self._names.setdefault((run, seq), set()).update(names)
        marks = self._marks.get((run, seq))
        if marks is None:
            marks = self._marks[(run, seq)] = ShardMarks()
        marks.add_record(record, place)
        if "error" not in record:
            self._written.setdefault(run, {})[key_digest(record["key"])] = seq
        return seq

    def unshipped_results(self, run: str, keys: list[str]) -> dict[str, int]:
        """Of the item KEYS of RUN, those with a result written here in a shard of ours not shipped
        yet (open, or sealed and waiting), each with the last such shard's sequence number: a job
        taken again here (a Redis rewind or loss) need not generate them again, and is acked once
        that shard ships. Shards parked while their run was gone are left out."""
        written = self._written.get(run)
        if not written:
            return {}
        found: dict[str, int] = {}
        for key in keys:
            seq = written.get(key_digest(key))
            if seq is not None:
                found[key] = seq
        return found

    def _forget_written(self, run: str, seq: int, marks: ShardMarks | None) -> None:
        """Shard SEQ of RUN left the spool's waiting line (shipped, lost or parked)."""
        written = self._written.get(run)
        if written is None or marks is None:
            return
        for digest in marks.done:
            if written.get(digest) == seq:
                del written[digest]
        if not written:
            del self._written[run]

    @property
    def spool_bytes(self) -> int:
        return self.waiting_bytes + sum(w.open_bytes for w in self.writers.values()) + self.features.open_bytes

    def full(self) -> bool:
        """Whether admission should pause: the spool is past its limit, or its disk refuses
        writes (results stay in memory, leases are kept, and writing is retried)."""
        return self.spool_bytes >= self.spool_limit or self.disk_error is not None

    # --- sealing -------------------------------------------------------------------
    def seal_due(self, idle_runs: set[str], *, force: bool = False) -> bool:
        """Write what is new in every open shard (crash recovery), and seal those due by size or
        age, whose run has nothing left in flight (idle_runs), or all of them (force). A disk
        that refuses is a pause, not a stall: reported in disk_error, retried at the next call,
        cleared by itself when writes succeed. Returns whether every write succeeded."""
        for run in [*self.writers, *(r for r in self.features.runs() if force and r not in self.writers)]:
            w = self.writers.get(run)
            try:
                if force or (w is not None and w.records and (run in idle_runs or w.due() or self.features.full(run))):
                    # its feature rows first: every row the records name is in a shard queued before theirs
                    features = self.features.seal(run)
                    if features is not None:
                        self.enqueue(features)
                    shard = w.seal() if w is not None else None
                    if shard is not None:
                        self.enqueue(shard)
                elif w is not None:
                    w.flush()
            except OSError as e:
                self._disk_failed(e)
                return False
        if self._disk_error is not None:
            log.warning("spool %s is writable again after %.1f s: resuming admission", self.spool,
                        time.monotonic() - (self._disk_error_since or time.monotonic()))
            self._disk_error = None
            self._disk_error_since = None
        return True

    @property
    def disk_error(self) -> str | None:
        """Why the spool's disk refuses writes now (None: it takes them): the result shards' or
        the feature rows' (--capture), each a pause of admission until a write succeeds."""
        return self._disk_error or self.features.disk_error

    def _disk_failed(self, e: OSError) -> None:
        msg = disk_error_message(self.spool, e)
        if self._disk_error is None:
            self._disk_error_since = time.monotonic()
            self.stats["disk_errors"] += 1
            log.error("%s; pausing admission, results kept in memory, leases kept; retrying", msg)
        self._disk_error = msg

    def enqueue(self, shard: Sealed) -> None:
        self.queue.append(shard)
        self._queued_at[shard.name] = time.time()
        self.waiting_bytes += shard.bytes
        self._kick.set()

    # --- shipping ------------------------------------------------------------------
    async def shipper(self) -> None:
        """Ship queued shards one at a time, in order, retrying each until it is stored."""
        while True:
            if not self.queue:
                self._kick.clear()
                await self._kick.wait()
                continue
            shard = self.queue[0]
            # busy until the shard's outcome is handled too (its items marked, its jobs acked, its
            # rows counted): a flush that saw the queue empty before that let the consumer exit
            # with the work undone
            self.shipping = True
            try:
                outcome = await (self._ship_features(shard) if isinstance(shard, SealedFeatureShard)
                                 else self._ship(shard))
                await self._shipped(shard, outcome)
            finally:
                self.shipping = False

    async def _shipped(self, shard: Sealed, outcome: ShipOutcome) -> None:
        """SHARD, first in the queue, came out as OUTCOME: it leaves the queue, and its items are
        marked and its jobs acked (or redone, or parked)."""
        self.queue.popleft()
        self._queued_at.pop(shard.name, None)
        self.waiting_bytes -= shard.bytes
        if isinstance(shard, SealedFeatureShard):
            await self._features_done(shard, outcome)
            return
        # A leftover shard of an earlier consumer carries that consumer's sequence numbers:
        # shipped, it marks its items done and acks nothing of ours; lost, it redoes nothing.
        mine = self._mine(shard)
        marks = (self._marks.pop((shard.run, shard.seq), None) if mine else None) \
            or self._read_marks.pop(shard.name, None)
        if mine:
            self._forget_written(shard.run, shard.seq, marks)
            self._names.pop((shard.run, shard.seq), None)
        if outcome is ShipOutcome.SHIPPED:
            await self._on_shipped(shard.run, shard.seq if mine else None, marks or ShardMarks())
        elif outcome is ShipOutcome.LOST:
            if mine:
                await self._on_lost(shard.run, shard.seq)
        else:
            self._parked.setdefault(shard.run, []).append(shard)
            if marks is not None:
                self._read_marks[shard.name] = marks
            await self._on_no_run(shard.run)

    async def _output(self, shard: Sealed) -> str | None:
        """The output SHARD's run ships to; None (said once) while the run is gone from Redis."""
        output = await self._output_of(shard.run)
        if output is None and shard.run not in self._orphaned:
            self._orphaned.add(shard.run)
            log.info("shards of run %s are kept in %s until the run is back in Redis", shard.run, shard.path.parent)
        return output

    async def _put(self, shard: Sealed, put: Callable[[], str]) -> str | None:
        """PUT SHARD (in the shipping thread) until it is stored; where it went, or None when the
        spool lost it (deleted by hand, or a disk problem)."""
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                return await loop.run_in_executor(self._pool, put)
            except FileNotFoundError as e:
                log.error("shard %s vanished from the spool (%s): its jobs will be redone", shard.name, e)
                self.stats["shards_lost"] += 1
                return None
            except Exception as e:
                if self.stopping_hard:
                    raise
                delay = store_backoff(attempt + 1)
                self.last_error = redact(f"{type(e).__name__}: {e}")[:500]
                self.last_error_at = time.time()
                self.stats["ship_failures"] += 1
                log.warning("shipping %s failed (%s); retrying in %.1f s", shard.name, self.last_error, delay)
                attempt += 1
                await asyncio.sleep(delay)

    async def _ship(self, shard: SealedShard) -> ShipOutcome:
        output = await self._output(shard)
        if output is None:
            return ShipOutcome.NO_RUN
        if self._mine(shard):
            lost = {name for name in self._names.get((shard.run, shard.seq), ()) if (shard.run, name) in self._lost_features}
            if lost:  # its records name features that never reached the output: not a result to keep
                log.error("shard %s names feature shard(s) %s the spool lost: its jobs will be redone", shard.name,
                          ", ".join(sorted(lost)))
                self.stats["shards_lost"] += 1
                shard.path.unlink(missing_ok=True)
                return ShipOutcome.LOST

        def put() -> str:
            store = self._stores.get(output)
            if store is None:
                store = self._stores[output] = self._store_for(output)
            return store.ship(shard)

        dest = await self._put(shard, put)
        if dest is None:
            # its results are gone, so its jobs must not be acked: the consumer redoes them
            return ShipOutcome.LOST
        loop = asyncio.get_running_loop()
        if not self._mine(shard):
            self._read_marks[shard.name] = await loop.run_in_executor(self._pool, marks_of_file, shard.path)
        shard.path.unlink(missing_ok=True)
        self.last_error = None
        self.last_upload_at = time.time()
        self.stats["shards"] += 1
        self.stats["bytes"] += shard.bytes
        n, b, _ = self._shipped_by_run.get(shard.run, (0, 0, 0.0))
        self._shipped_by_run[shard.run] = (n + 1, b + shard.bytes, self.last_upload_at)
        log.debug("shipped %s (%d records, %d bytes) to %s", shard.name, shard.records, shard.bytes, redact(dest))
        return ShipOutcome.SHIPPED

    async def _ship_features(self, shard: SealedFeatureShard) -> ShipOutcome:
        """Put a feature shard, its capture's manifest first (once per output), then its index."""
        output = await self._output(shard)
        if output is None:
            return ShipOutcome.NO_RUN
        dest = await self._put(shard, lambda: self._feature_outputs.put(output, shard))
        if dest is None:
            return ShipOutcome.LOST
        self.last_error = None
        self.last_upload_at = time.time()
        self.stats["feature_shards"] += 1
        self.stats["feature_bytes"] += shard.bytes
        log.debug("shipped %s (%d feature rows, %d bytes) to %s", shard.name, len(shard.index.entries), shard.bytes,
                  redact(dest))
        return ShipOutcome.SHIPPED

    async def _features_done(self, shard: SealedFeatureShard, outcome: ShipOutcome) -> None:
        if outcome is ShipOutcome.SHIPPED:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.features.shipped, shard)
            if self._on_features is not None:
                await self._on_features(shard.run, shard.index)
        elif outcome is ShipOutcome.LOST:
            self._lost_features.add((shard.run, shard.name))
        else:
            self._parked.setdefault(shard.run, []).append(shard)
            await self._on_no_run(shard.run)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every sealed shard is shipped; False if TIMEOUT passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.queue or self.shipping:
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def unshipped(self) -> list[Sealed]:
        """Sealed shards still on local disk: queued, or kept for a run gone from Redis. Read at
        exit, after the last flush, so the stop line counts what is truly left."""
        parked = [shard for shards in self._parked.values() for shard in shards]
        return [shard for shard in [*self.queue, *parked] if shard.path.exists()]

    def parked_runs(self) -> list[str]:
        """Runs gone from Redis whose shards wait here until the run is re-created."""
        return [run for run, shards in self._parked.items() if shards]

    def unpark(self, runs: list[str]) -> None:
        """Runs that are (back) in Redis: their shards kept aside while they were gone ship now."""
        for run in runs:
            for shard in self._parked.pop(run, []):
                self._orphaned.discard(run)
                log.warning("run %s is back: shipping %s, kept in the spool while it was gone", run, shard.name)
                self.enqueue(shard)

    def _mine(self, shard: Sealed) -> bool:
        return shard.name.startswith(self.worker + "-")

    def snapshot(self) -> OutboxSnapshot:
        oldest = min(self._queued_at.values(), default=None)
        return OutboxSnapshot(self.stats["shards"], self.stats["bytes"], len(self.queue), self.spool_bytes,
                              self.last_upload_at, self.last_error, self.last_error_at, oldest,
                              self.stats["ship_failures"], self.stats["shards_lost"], self.disk_error,
                              self._runs())

    def _runs(self) -> dict[str, RunShipping]:
        waiting: dict[str, list[SealedShard]] = {}
        for shard in self.queue:
            if isinstance(shard, SealedShard):
                waiting.setdefault(shard.run, []).append(shard)
        out = {}
        for run in sorted(set(self._shipped_by_run) | set(waiting) | set(self.writers)):
            n, b, last = self._shipped_by_run.get(run, (0, 0, 0.0))
            queued = waiting.get(run, [])
            w = self.writers.get(run)
            at = [self._queued_at[s.name] for s in queued if s.name in self._queued_at]
            out[run] = RunShipping(n, b, len(queued), sum(s.records for s in queued) + (w.records if w else 0),
                                   last or None, min(at, default=None))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


