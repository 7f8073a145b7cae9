"""The consumer's snapshot writer has a Redis connection and thread of its own: a snapshot
never waits behind rq work (real Redis). Under load snapshots landed up to ~8 s apart."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from genqueue.common import defaults
from genqueue.common.keepers.redisconn import connect
from genqueue.common.keepers.snapshots import Snapshots
from genqueue.consumer.config import ConsumerConfig
from genqueue.consumer.engine.admission import AdmissionSnapshot
from genqueue.consumer.served import ServedSnapshot
from genqueue.consumer.telemetry import Parts
from genqueue.consumer.work.leases import LeaseSnapshot
from genqueue.consumer.worker import Consumer

pytestmark = pytest.mark.integration

HOLD = 3.0  # seconds the rq thread (and a connection of its pool) is kept busy


def test_a_snapshot_lands_while_the_rq_thread_is_held(tmp_path: Path, redis_url: str) -> None:
    conn = connect(redis_url)  # as `consumer run` connects
    c = Consumer(ConsumerConfig(endpoint="http://127.0.0.1:9/v1", redis_url=redis_url,
                                spool=str(tmp_path / "spool")), conn)
    parts = Parts(book=c.book.snapshot, acker=c.acker.snapshot, leases=lambda: LeaseSnapshot(0, 0, None),
                  served=lambda: ServedSnapshot([], {}, {}, {}), outbox=c.outbox.snapshot,
                  admission=lambda: AdmissionSnapshot("fixed", 8, {"metrics": False}), rq=c.rq.snapshot,
                  paused=dict, stopping=lambda: False, retries=dict)

    async def main() -> tuple[float, bool]:
        telemetry = c._new_telemetry(parts)  # as the consumer builds it
        # a slow rq call in flight: a blocking pop on the rq connection, in the rq thread
        held = asyncio.ensure_future(c.rq.call(conn.blpop, ["gq-test:never"], HOLD))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await asyncio.wait_for(telemetry.publish(), timeout=HOLD)
        took = time.monotonic() - t0
        still_held = not held.done()
        await held
        return took, still_held

    try:
        took, still_held = asyncio.run(main())
    finally:
        c.rq.close()
        c._snap_rq.close()
        c.outbox.close()
    assert took < 1.0 and still_held, f"the snapshot waited {took:.1f} s behind the rq call"
    assert c.worker.name in {r["worker"] for r in Snapshots(conn).reports(time.time())}
    # its own pool, to the same Redis, with genqueue's settings (common/keepers/redisconn.py)
    snap_pool, rq_pool = c._snap_conn.connection_pool, conn.connection_pool
    assert snap_pool is not rq_pool
    same = ("host", "port", "db", "socket_connect_timeout", "health_check_interval", "socket_keepalive")
    assert {k: snap_pool.connection_kwargs.get(k) for k in same} == {k: rq_pool.connection_kwargs.get(k) for k in same}
    assert snap_pool.connection_kwargs["socket_timeout"] == defaults.REDIS_SOCKET_TIMEOUT
