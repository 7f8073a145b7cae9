"""The doctor's judgement of speculation end to end: a real consumer against a stand-in whose
speculation costs more than it saves, the verdict read from the consumer's snapshot and from
`producer status` (real redis-server, the stand-in over HTTP, CLIs as subprocesses). Its pair,
speculation that pays, is the `spec` regime of test_doctor_regimes.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.keepers.runs import CONSUMERS, consumer_key
from tests.conftest import RedisServer, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150), pytest.mark.slow]


def _engine(conn: redis.Redis, url: str) -> dict[str, Any]:
    for worker in conn.zrange(CONSUMERS, 0, -1):
        raw = conn.get(consumer_key(worker.decode()))
        snap = orjson.loads(raw) if raw else {}
        if snap.get("endpoint") == url:
            return dict(snap.get("engine") or {})
    return {}


def test_speculation_that_costs_more_than_it_saves_is_told_off_in_the_snapshot_and_status(
        redis_server: RedisServer, tmp_path: Path) -> None:
    env = {"REDIS_URL": redis_server.url}
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    # low acceptance at 64 running, past the stand-in's knee of 64 tokens a step (the doctor's
    # default knee): each verify step computes 5 tokens a request for ~1.4 kept
    sim = Sim(tmp_path, "--max-num-seqs", "64", "--kv-cache-tokens", "10000000", "--step-time", "0.002",
              "--mean-tokens", "300", "--spec-tokens", "4", "--spec-acceptance", "0.3", "--compute-knee", "64")
    data = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i) for i in range(3000)])
    cli("producer", "enqueue", str(data), "--run", "costly", "--output", str(tmp_path / "out"), "--batch-size", "4",
        "--rejects", str(tmp_path / "rej.jsonl"), "--max-tokens", "512", env=env)
    proc = Proc("consumer", ["run", "--run", "costly", "--endpoint", sim.url, "--spool", str(tmp_path / "spool"),
                             "--shard-max-age", "1", "-c", "64"], tmp_path / "consumer.log", env=env)
    try:
        deadline = time.monotonic() + 90
        e: dict[str, Any] = {}
        seen: list[str | None] = []
        while time.monotonic() < deadline and e.get("spec_verdict") != "costs":
            time.sleep(0.5)
            e = _engine(conn, sim.url)
            seen.append(e.get("spec_verdict"))
        assert e.get("spec_verdict") == "costs", (e.get("notes"), proc.output()[-3000:])
        assert "pays" not in seen  # never said the opposite on its way there
        n = e["numbers"]
        assert n["spec_k"] == 4 and n["spec_regime"] == "compute-bound" and n["spec_best_k"] == 0
        assert -0.8 < n["spec_gain"] < -0.6  # ~1.4 tokens a step for 5 knees and 4 drafts at 2%: ~ -72%
        note = e["notes"][-1]
        assert note.startswith("speculation costs ~") and "turn it off or lower num_speculative_tokens" in note, note
        out = cli("producer", "status", "--run", "costly", env=env).stdout
        flat = " ".join(out.split())  # the notes wrap with the advice, never clipped
        assert "speculation costs ~" in flat and "turn it off or lower num_speculative_tokens" in flat, out
        assert max(len(line) for line in out.splitlines()) <= 100
    finally:
        proc.kill()
        sim.stop()
