"""What a consumer tells the world: a snapshot in Redis for `producer status`, and
Prometheus metrics on a port.

The snapshot (`genqueue:consumer:<worker>`, refreshed every few seconds, listed in the
`genqueue:consumers` sorted set by last-seen time) carries per-run counters and one-minute
rates, in-flight and paused state, shipping progress, and what the engine's own /metrics say.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge, Histogram, start_http_server

from genqueue.common import __version__
from genqueue.common.runs import CONSUMERS, consumer_key
from genqueue.common.eta import RateWindow, Sample
from genqueue.consumer.engine import engine_view

if TYPE_CHECKING:
    from genqueue.consumer.worker import Consumer

log = logging.getLogger(__name__)

SNAPSHOT_TTL = 24 * 3600

IN_FLIGHT = Gauge("genqueue_in_flight", "Requests in flight to the endpoint")
PENDING = Gauge("genqueue_pending_items", "Items dequeued and waiting for a slot")
PAUSED = Gauge("genqueue_paused", "1 while admission is paused", ["reason"])
COMPLETIONS = PCounter("genqueue_completions", "Items answered", ["run", "outcome"])
TOKENS = PCounter("genqueue_tokens", "Tokens", ["run", "kind"])
ERRORS = PCounter("genqueue_errors", "Error records by class", ["run", "error_class"])
LATENCY = Histogram("genqueue_item_latency_seconds", "Wall time per item (all its turns and retries)",
                    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf")))
SPOOL = Gauge("genqueue_spool_bytes", "Unshipped result bytes on local disk")
SHIPPED = PCounter("genqueue_shards_shipped", "Shards shipped to the output")


class Telemetry:
    """Counts what the consumer does and publishes it."""

    def __init__(self, consumer: Consumer, *, interval: float = 2.0, metrics_port: int | None = None) -> None:
        self.c = consumer
        self.interval = interval
        self.metrics_port = metrics_port
        self.totals: dict[str, Counter[str]] = {}
        self.windows: dict[str, RateWindow] = {}
        self.engine: dict[str, Any] = {"metrics": False}
        self.started_at = time.time()
        self._last_engine = 0.0

    def record(self, run: str, rec: dict[str, Any]) -> None:
        """Count one finished item (called on the hot path: cheap)."""
        t = self.totals.get(run)
        if t is None:
            t = self.totals[run] = Counter()
        t["completions"] += 1
        if "error" in rec:
            t["errors"] += 1
            ERRORS.labels(run, rec["error"].get("class", "unknown")).inc()
            return
        usage = rec.get("usage") or {}
        pt, ct = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        t["prompt_tokens"] += pt
        t["completion_tokens"] += ct
        COMPLETIONS.labels(run, rec.get("outcome") or "unknown").inc()
        TOKENS.labels(run, "prompt").inc(pt)
        TOKENS.labels(run, "completion").inc(ct)
        lat = (rec.get("timings") or {}).get("latency_s")
        if lat is not None:
            LATENCY.observe(lat)

    def start_metrics_server(self) -> None:
        if self.metrics_port is not None:
            start_http_server(self.metrics_port, addr="0.0.0.0")
            log.info("Prometheus metrics on :%d/metrics", self.metrics_port)

    async def loop(self) -> None:
        while True:
            await self.publish()
            await asyncio.sleep(self.interval)

    async def publish(self, *, exited: bool = False) -> None:
        now = time.time()
        for run, t in self.totals.items():
            w = self.windows.get(run)
            if w is None:
                w = self.windows[run] = RateWindow(60.0)
            w.add(Sample(now, t["completions"], t["prompt_tokens"], t["completion_tokens"]))
        if now - self._last_engine >= 5.0 and self.c.client is not None:
            self._last_engine = now
            self.engine = engine_view(await self.c.client.metrics())
        snap = self.snapshot(now)
        snap["exited"] = exited
        IN_FLIGHT.set(snap["in_flight"])
        PENDING.set(snap["pending_items"])
        PAUSED.labels("endpoint_down").set(1 if snap["paused"]["endpoint_down"] else 0)
        PAUSED.labels("spool_full").set(1 if snap["paused"]["spool_full"] else 0)
        SPOOL.set(snap["shipping"]["spool_bytes"])
        await self.c.rq_call(self._write, snap, now)

    def _write(self, snap: dict[str, Any], now: float) -> None:
        with self.c.conn.pipeline() as p:
            p.set(consumer_key(snap["worker"]), orjson.dumps(snap), ex=SNAPSHOT_TTL)
            p.zadd(CONSUMERS, {snap["worker"]: now})
            p.zremrangebyscore(CONSUMERS, 0, now - SNAPSHOT_TTL)
            p.execute()

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        c = self.c
        now = time.time() if now is None else now
        runs = {}
        for run, t in self.totals.items():
            ctx = c.contexts.get(run)
            rates = self.windows[run].rates() if run in self.windows else {}
            runs[run] = {**dict(t), **rates, "fingerprint": ctx.fingerprint if ctx else None,
                         "reasoning_probe": ctx.reasoning_probe if ctx else None}
        for run, ctx in c.contexts.items():
            runs.setdefault(run, {"fingerprint": ctx.fingerprint, "reasoning_probe": ctx.reasoning_probe})
        ob = c.outbox
        return {
            "worker": c.worker.name,
            "host": c.host,
            "gpu": c.cfg.gpu,
            "pid": os.getpid(),
            "endpoint": c.cfg.endpoint,
            "version": __version__,
            "started_at": self.started_at,
            "last_seen": now,
            "concurrency": c.limit,
            "concurrency_mode": "auto" if c.cfg.auto_concurrency else "fixed",
            "in_flight": c.in_flight,
            "pending_items": len(c.pending),
            "held_jobs": len(c.jobs),
            "stopping": c.stopping,
            "paused": {"endpoint_down": c.gate_paused, "spool_full": ob.full()},
            "runs": runs,
            "models": c.served_models,
            "max_model_len": c.model_lens,
            "engine": self.engine,
            "shipping": {
                "shards": ob.stats["shards"],
                "bytes": ob.stats["bytes"],
                "waiting_shards": len(ob.queue),
                "spool_bytes": ob.spool_bytes,
                "last_upload_at": ob.last_upload_at,
                "last_error": ob.last_error,
                "failures": ob.stats["ship_failures"],
            },
        }
