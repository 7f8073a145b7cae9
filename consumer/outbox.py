"""Results on their way out: per-run shard writers, sealing, and one ordered shipper.

Sealing and shipping are apart so that a slow or unreachable store (S3 down) never stops
results from being written: sealed shards queue up on local disk, the shipper retries with
backoff, and the consumer pauses admission once the spool passes its size limit. Shards of a
run are shipped in order, so "shipped up to seq N" is one number per run, and a job is
acked once the last shard holding its results is shipped.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from genqueue.common.backoff import compute_backoff
from genqueue.consumer.shards import SealedShard, ShardWriter, Sink

log = logging.getLogger(__name__)


class Outbox:
    """Writes records, seals shards when due, ships them in order, reports what shipped."""

    def __init__(self, spool: str, worker: str, *, max_bytes: int, max_age: float, spool_limit: int,
                 sink_for: Callable[[str], Sink], output_of: Callable[[str], Awaitable[str | None]],
                 on_shipped: Callable[[str, int], Awaitable[None]],
                 on_lost: Callable[[str, int], Awaitable[None]]) -> None:
        self.spool = spool
        self.worker = worker
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.spool_limit = spool_limit
        self._sink_for = sink_for
        self._sinks: dict[str, Sink] = {}
        self._output_of = output_of
        self._on_shipped = on_shipped
        self._on_lost = on_lost
        self.writers: dict[str, ShardWriter] = {}
        self.queue: collections.deque[SealedShard] = collections.deque()
        self.waiting_bytes = 0  # sealed, not yet shipped
        self.shipping = False
        self.stats: collections.Counter[str] = collections.Counter()
        self.last_error: str | None = None
        self.last_upload_at: float | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ship")
        self._kick = asyncio.Event()
        self.stopping_hard = False

    # --- writing -------------------------------------------------------------------
    def append(self, run: str, record: dict[str, Any]) -> int:
        """Append RECORD to RUN's open shard; returns the shard's sequence number."""
        w = self.writers.get(run)
        if w is None:
            w = self.writers[run] = ShardWriter(self.spool, run, self.worker, max_bytes=self.max_bytes,
                                                max_age=self.max_age)
        return w.append(record)

    @property
    def spool_bytes(self) -> int:
        return self.waiting_bytes + sum(w.open_bytes for w in self.writers.values())

    def full(self) -> bool:
        """Whether the local spool is past its limit (admission should pause)."""
        return self.spool_bytes >= self.spool_limit

    # --- sealing -------------------------------------------------------------------
    def seal_due(self, idle_runs: set[str], *, force: bool = False) -> None:
        """Seal every open shard that is due by size or age, whose run has nothing left in
        flight (idle_runs), or all of them (force)."""
        for run, w in self.writers.items():
            if w.records and (force or run in idle_runs or w.due()):
                shard = w.seal()
                if shard is not None:
                    self.enqueue(shard)

    def enqueue(self, shard: SealedShard) -> None:
        self.queue.append(shard)
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
            self.shipping = True
            try:
                await self._ship(shard)
            finally:
                self.shipping = False
            self.queue.popleft()
            self.waiting_bytes -= shard.bytes
            await self._on_shipped(shard.run, shard.seq)

    async def _ship(self, shard: SealedShard) -> None:
        output = await self._output_of(shard.run)
        if output is None:
            log.error("shard %s belongs to an unknown run %s; left in the spool", shard.path, shard.run)
            return
        sink = self._sinks.get(output)
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                if sink is None:
                    sink = self._sinks[output] = await loop.run_in_executor(self._pool, self._sink_for, output)
                dest = await loop.run_in_executor(self._pool, sink.ship, shard)
                break
            except FileNotFoundError as e:
                # The spool lost the shard (deleted by hand, or a disk problem): its results
                # are gone, so its jobs must not be acked. Say so and let the consumer redo them.
                log.error("shard %s vanished from the spool (%s): its jobs will be redone", shard.name, e)
                self.stats["shards_lost"] += 1
                await self._on_lost(shard.run, shard.seq)
                return
            except Exception as e:  # noqa: BLE001 - any storage failure: keep the shard, wait, retry
                if self.stopping_hard:
                    raise
                delay = compute_backoff(min(attempt, 6), base=0.5, cap=15.0)
                self.last_error = f"{type(e).__name__}: {e}"
                self.stats["ship_failures"] += 1
                log.warning("shipping %s failed (%s); retrying in %.1f s", shard.name, self.last_error, delay)
                attempt += 1
                await asyncio.sleep(delay)
        shard.path.unlink(missing_ok=True)
        self.last_error = None
        self.last_upload_at = time.time()
        self.stats["shards"] += 1
        self.stats["bytes"] += shard.bytes
        log.info("shipped %s (%d records, %d bytes) to %s", shard.name, shard.records, shard.bytes, dest)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every sealed shard is shipped; False if TIMEOUT passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.queue or self.shipping:
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
