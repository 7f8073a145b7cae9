"""Producers racing on one run and one input queue each item exactly once."""

from __future__ import annotations

import math
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from rq.job import Job

from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.rqaccess import SERIALIZER, queue_for
from genqueue.producer.enqueue.slices import SLICE_ITEMS
from genqueue.producer.packitems import PackItems
from tests.conftest import BIN, Prompts, items_of_job, sharegpt

pytestmark = pytest.mark.integration

PRODUCERS = 4
ROUNDS = 5
RECORDS = 12_000
BATCH = 4


def dataset() -> tuple[bytes, int]:
    """RECORDS lines: distinct conversations, some repeated (duplicates), some broken (rejected)."""
    lines: list[bytes] = []
    distinct = 0
    for i in range(RECORDS):
        if i % 500 == 499:
            lines.append(b"{broken")
        elif i % 97 == 96:
            lines.append(orjson.dumps(sharegpt(i - 90)))
        else:
            lines.append(orjson.dumps(sharegpt(i)))
            distinct += 1
    return b"\n".join(lines) + b"\n", distinct


def race(redis_url: str, conn: redis.Redis, data: bytes, run: str, *extra: str) -> list[dict[str, Any]]:
    """Start PRODUCERS `producer enqueue -` on RUN; once every one is connected to Redis (and so
    waiting on its stdin), give them all the same input at once."""
    env = {**os.environ, "REDIS_URL": redis_url}
    procs = [
        subprocess.Popen([str(BIN / "producer"), "enqueue", "-", "--run", run, "--batch-size", str(BATCH), "--json",
                          "--rejects", os.devnull, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
        for _ in range(PRODUCERS)
    ]
    deadline = time.monotonic() + 120
    while len(conn.client_list()) < PRODUCERS + 1:
        assert time.monotonic() < deadline, "producers did not connect"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)

    def feed(p: subprocess.Popen[bytes]) -> None:
        assert p.stdin is not None
        p.stdin.write(data)
        p.stdin.close()
        p.stdin = None  # communicate() below must not flush it

    feeders = [threading.Thread(target=feed, args=(p,)) for p in procs]
    for t in feeders:
        t.start()
    for t in feeders:
        t.join()
    summaries = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
        summaries.append(orjson.loads(out))
    return summaries


@pytest.mark.slow
def test_racing_producers_enqueue_each_item_exactly_once(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                         prompts_mode: Prompts) -> None:
    data, distinct = dataset()
    slice_items = max(BATCH, SLICE_ITEMS - SLICE_ITEMS % BATCH)
    winners_per_round: list[list[int]] = []
    for round_ in range(ROUNDS):
        conn.flushall()
        run = f"race{round_}"
        started = time.monotonic()
        summaries = race(redis_url, conn, data, run, "--output", str(tmp_path / "out"), *prompts_mode.args)
        elapsed = time.monotonic() - started
        for s in summaries:
            assert s["records"] == RECORDS
            assert s["records"] == s["enqueued"] + s["already_enqueued"] + s["duplicates"] + s["rejected"]
            assert s["rejected"] == RECORDS // 500
        assert sum(s["enqueued"] for s in summaries) == distinct
        assert sum(s["items"] for s in summaries) == distinct
        assert sum(bool(s["created_run"]) for s in summaries) == 1

        q = queue_for(run, conn)
        ids = [i.decode() if isinstance(i, bytes) else i for i in conn.lrange(q.key, 0, -1)]
        assert len(ids) == len(set(ids)) == sum(s["jobs"] for s in summaries)
        keys: list[str] = []
        sizes: list[int] = []
        packs = PackItems(conn, run, str(tmp_path / "out"))
        for job in Job.fetch_many(ids, connection=conn, serializer=SERIALIZER):
            assert job is not None
            items = items_of_job(conn, run, tmp_path / "out", job, packs)
            sizes.append(len(items))
            keys += [it["key"] for it in items]
        assert len(keys) == len(set(keys)) == distinct == ItemTable(conn, run).counts().in_run
        # Batching as one producer does it, except that a slice a producer only partly won ends in
        # a short job: at most one per slice each producer wrote.
        assert all(n <= BATCH for n in sizes) and len(ids) >= math.ceil(distinct / BATCH)
        slices = sum(math.ceil(s["items"] / slice_items) + 1 for s in summaries)
        assert sum(n < BATCH for n in sizes) <= slices
        assert conn.keys(f"genqueue:run:{run}:claim:*") == []  # every claim ended in its jobs
        winners_per_round.append(sorted(s["items"] for s in summaries))
        print(f"round {round_} ({prompts_mode}): items per producer {winners_per_round[-1]}, jobs {len(ids)} "
              f"(one producer alone: {math.ceil(distinct / BATCH)}), {elapsed:.1f} s")
    # The producers did race: in some round more than one of them won items.
    assert any(sum(n > 0 for n in w) > 1 for w in winners_per_round), winners_per_round
