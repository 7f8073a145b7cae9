"""A starting consumer is seen: its first line before any wait, its row in `producer status` with
what it waits on and for how long, and its --metrics-port, while the engine is not there yet
(the stand-in is started after the consumer)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import orjson
import pytest
import redis

from genqueue.producer.status import format_status, run_status
from tests.conftest import cli, free_port, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim


def _metrics(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            return r.read().decode()
    except OSError:
        return None


@pytest.mark.integration
def test_a_consumer_waiting_on_its_engine_is_seen(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i) for i in range(6)])
    cli("producer", "enqueue", str(data), "--run", "st", "--output", str(tmp_path / "out"),
        env={"REDIS_URL": redis_url})
    engine, metrics = free_port(), free_port()
    proc = Proc("consumer", ["run", "--endpoint", f"http://127.0.0.1:{engine}/v1", "--run", "st", "--burst",
                             "--spool", str(tmp_path / "spool"), "--metrics-port", str(metrics),
                             "--endpoint-wait", "120", "--shard-max-age", "1"], tmp_path / "c.log",
                env={"REDIS_URL": redis_url})
    sim = None
    try:
        row, text, served = None, "", None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (row and served):
            r = orjson.loads(orjson.dumps(run_status(conn, "st")))
            row = next(iter(r["starting"]), None)
            if row:
                text = format_status(r, color=False)
            served = _metrics(metrics)
            time.sleep(0.2)
        assert proc.p.poll() is None, proc.output()
        assert row is not None and row["phase"] == "pre-flight: waiting on the engine (/v1/models)", proc.output()
        assert "starting: pre-flight: waiting on the engine (/v1/models) for 0m" in text, text
        assert served is not None and "genqueue_starting 1.0" in served
        log = proc.output()
        # before any wait: only the metrics port's line comes first (bound first, so a taken port is
        # refused before the consumer starts)
        lines = log.splitlines()
        first = [i for i, x in enumerate(lines) if "consumer starting: endpoint" in x][:1]
        assert first and all("Prometheus metrics on" in x for x in lines[:first[0]]), log
        sim = Sim(tmp_path, port=engine)
        assert proc.wait(timeout=90) == 0, proc.output()
        r = run_status(conn, "st")
        assert r["items_done"] == 6 and r["starting"] == [], r["starting"]
    finally:
        if proc.p.poll() is None:
            proc.kill()
        if sim is not None:
            sim.stop()
