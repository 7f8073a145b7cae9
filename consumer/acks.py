"""Acking: a job is finished in rq only once the last shard holding its results is shipped;
a shard lost before shipping sends its jobs back; an earlier consumer's leftovers ship first.
A mixin of Consumer."""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from genqueue.common.runs import run_key
from genqueue.consumer.checkpoints import clear as clear_checkpoints
from genqueue.consumer.shards import leftover_shards

if TYPE_CHECKING:
    from genqueue.consumer.worker import JobState

log = logging.getLogger("genqueue.consumer.worker")


class AckMixin:
    """Consumer's shipping callbacks (self is a Consumer)."""

    async def _output_of(self, run: str) -> str | None:
        ctx = self.contexts.get(run)
        if ctx is not None:
            return ctx.settings.output
        info = await self._rq(self.store.get, run)
        return info.settings.output if info is not None else None

    async def _ack_shipped(self, run: str, shipped_seq: int) -> None:
        """Ack every complete job of RUN whose last result is in a shard shipped by now."""
        ready = [js for js in self.jobs.values()
                 if js.ctx.run == run and js.complete and js.max_seq <= shipped_seq]
        for js in ready:
            manifest = {"items": len(js.items), **dict(js.counts), "shard_seq": js.max_seq,
                        "worker": self.worker.name}
            acked = await self._rq(self._ack, js, manifest)
            del self.jobs[js.held.id]
            if acked:
                self.stats["jobs_acked"] += 1
                log.info("job %s done: %d items in %.2f s", js.held.id, len(js.items), time.monotonic() - js.started)
        if ready:
            self._wake.set()

    async def _redo_lost(self, run: str, lost_seq: int) -> None:
        """A shard of RUN was lost before shipping: every job that may have results in it goes
        back to the queue (spending a retry), and its items still waiting here are dropped."""
        lost = [js for js in self.jobs.values() if js.ctx.run == run and js.max_seq >= lost_seq]
        for js in lost:
            js.abandoned = True
            await self._rq(self.worker.fail, js.held, f"results lost from the spool (shard {lost_seq})", True)
            del self.jobs[js.held.id]
        self.pending = collections.deque(p for p in self.pending if not p[0].abandoned)
        self._wake.set()

    def _ack(self, js: JobState, manifest: dict[str, Any]) -> bool:
        acked = self.worker.finish(js.held, manifest)
        if acked:
            with self.conn.pipeline() as p:
                for k, v in js.counts.items():
                    p.hincrby(run_key(js.ctx.run, "stats"), k, v)
                p.hsetnx(run_key(js.ctx.run), "started_at", repr(js.held.job.started_at.timestamp()
                                                                 if js.held.job.started_at else time.time()))
                if js.ctx.settings.multi_turn == "regenerate":
                    multi = [it["key"] for it in js.items if sum(m["role"] == "user" for m in it["messages"]) > 1]
                    clear_checkpoints(p, js.ctx.run, multi)
                p.execute()
        return acked

    async def _ship_leftovers(self) -> None:
        """Ship what an earlier consumer left in this spool. The spool's lock (held since start)
        proves that consumer is dead: every shard here not of our own making is a leftover."""
        mine = self.worker.name
        shards = await self._rq(leftover_shards, self.cfg.spool, lambda worker: worker != mine)
        for shard in shards:
            log.warning("shipping %s left in the spool by an earlier consumer", shard.name)
            self.outbox.enqueue(shard)
