"""The genqueue pipeline against a real vLLM: `producer enqueue`, then `consumer run --burst`."""

from __future__ import annotations

from pathlib import Path

import orjson

from genqueue.common.contracts import ExitCode
from genqueue.common.keepers.rqaccess import queue_for
from tests.conftest import cli, write_jsonl
from tests.consumer.e2e import Proc, read_results, run_keys

__all__ = ["assert_all_done", "consume", "enqueue", "results", "rq_counts", "run_keys"]


def enqueue(tmp: Path, redis_url: str, run: str, records: list[object], *extra: str) -> dict:
    """`producer enqueue` of RECORDS as run RUN (batch 8, max_tokens 128 unless EXTRA says otherwise)."""
    data = write_jsonl(tmp / f"{run}.jsonl", records)
    args = ["enqueue", str(data), "--run", run, "--output", str(tmp / "out"),
            "--rejects", str(tmp / f"{run}.rejects.jsonl"), "--json"]
    for opt, default in (("--batch-size", "8"), ("--max-tokens", "128")):
        if opt not in extra:
            args += [opt, default]
    proc = cli("producer", *args, *extra, env={"REDIS_URL": redis_url})
    return orjson.loads(proc.stdout)


def consume(tmp: Path, redis_url: str, endpoint: str, run: str, *extra: str, timeout: float = 180,
            code: int = ExitCode.DONE) -> Proc:
    """`consumer run --burst` against ENDPOINT until the run is drained; returns the finished Proc
    (CODE: its exit; FAILED_ITEMS where an item is meant to end as an error)."""
    conc = [] if "-c" in extra else ["-c", "16"]
    c = Proc("consumer", ["-vv", "run", "--run", run, "--endpoint", endpoint, "--burst", *conc,
                          "--spool", str(tmp / "spool" / run), "--shard-max-age", "1", *extra],
             tmp / f"consumer-{run}.log", env={"REDIS_URL": redis_url})
    rc = c.wait(timeout)
    assert rc == code, f"consumer exited {rc}:\n{c.output()}"
    return c


def results(tmp: Path, run: str) -> list[dict]:
    return read_results(tmp / "out", run)


def rq_counts(conn, run: str) -> dict[str, int]:
    q = queue_for(run, conn)
    return {"queued": q.count, "started": q.started_job_registry.count,
            "finished": q.finished_job_registry.count, "failed": q.failed_job_registry.count}


def assert_all_done(conn, run: str, recs: list[dict], jobs: int) -> None:
    """Every enqueued item has exactly one record; every job finished, none failed."""
    keys = run_keys(conn, run)
    assert keys and {r["key"] for r in recs} == keys
    assert len(recs) == len(keys), "duplicates without a crash"
    assert rq_counts(conn, run) == {"queued": 0, "started": 0, "finished": jobs, "failed": 0}
