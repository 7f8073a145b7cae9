"""Recovery end to end: real redis-server, real consumer processes (`consumer run --burst`), the
stand-in vLLM over HTTP, a real S3 server where the output is S3, and `producer export` at the
end. What rq or Redis loses, `producer enqueue` (the same command) brings back:

- the queue emptied mid-run (`rq empty`): the lost items are queued again, and no item that had
  already shipped is generated twice;
- Redis flushed mid-run: the run comes back from its output (run.json and the shipped shards),
  and only what was not shipped is generated again (duplicates bounded by what was in flight);
- items failed for good (a context too short): `--retry-failed` once the endpoint is fixed;
- a run whose max_tokens no engine accepts: `--update-settings`, and its results record the new
  fingerprint.
"""

from __future__ import annotations

import collections
import os
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.runs import RunStore
from tests.conftest import Prompts, both_modes_reference_slow, cli, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.s3server import S3Server, s3_server  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


def enqueue(redis_url: str, data: Path, run: str, output: str, *extra: str,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = cli("producer", "enqueue", str(data), "--run", run, "--output", output, "--batch-size", "8", "--json",
               "--rejects", os.devnull, *extra, env={"REDIS_URL": redis_url, **(env or {})})
    s: dict[str, Any] = orjson.loads(proc.stdout)
    s["stderr"] = proc.stderr
    return s


def consumer(tmp_path: Path, redis_url: str, sim: Sim, run: str, name: str, *extra: str,
             env: dict[str, str] | None = None, spool: str = "spool") -> Proc:
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url, "-c", "16", "--lease", "5",
                             "--shard-max-age", "0.5", "--spool", str(tmp_path / spool), *extra],
                tmp_path / f"{name}.log", env={"REDIS_URL": redis_url, **(env or {})})


def export(redis_url: str, run: str, out: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = cli("producer", "export", "--run", run, "-o", str(out), "--include-outcomes", "all", "--json",
               env={"REDIS_URL": redis_url, **(env or {})}, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = orjson.loads(proc.stdout)
    return result


@pytest.mark.slow
def test_rq_empty_mid_run_then_enqueue(tmp_path: Path, redis_url: str, conn: redis.Redis, prompts_mode: Prompts) -> None:
    out = tmp_path / "out"
    out.mkdir()
    data = write_jsonl(tmp_path / "emp.jsonl", [sharegpt(i) for i in range(600)])
    enqueue(redis_url, data, "emp", str(out), "--max-tokens", "64", *prompts_mode.args)
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.01", "--mean-tokens", "20")
    try:
        c1 = consumer(tmp_path, redis_url, sim, "emp", "c1", "--burst")
        wait_for(lambda: ItemTable(conn, "emp").counts().done >= 100, 120, "nothing shipped")
        assert sim.proc is not None
        sim.proc.p.send_signal(signal.SIGSTOP)  # c1's jobs stay held (its requests wait) while the
        try:                                    # producer runs, however slowly it starts
            cli("rq", "empty", "-u", redis_url, "genqueue.emp")  # while c1 still holds jobs
            shipped_before = {r["key"] for r in read_results(out, "emp")}
            s = enqueue(redis_url, data, "emp", str(out), "--max-tokens", "64", *prompts_mode.args)
        finally:
            sim.proc.p.send_signal(signal.SIGCONT)
        assert s["records"] == 600 and s["already_done"] >= len(shipped_before) - 16
        assert s["enqueued"] == s["requeued"] > 0 and s["already_queued"] > 0, s  # c1's held jobs are live
        assert c1.wait(180) == 0, c1.output()
        c2 = consumer(tmp_path, redis_url, sim, "emp", "c2", "--burst")
        assert c2.wait(180) == 0, c2.output()
    finally:
        sim.stop()
    counts = collections.Counter(r["key"] for r in read_results(out, "emp"))
    assert set(counts) == run_keys(conn, "emp") and len(counts) == 600
    twice = [k for k, n in counts.items() if n > 1]
    print(f"rq empty mid-run ({prompts_mode}): {len(shipped_before)} items shipped before it, {s['requeued']} re-queued, "
          f"{s['already_queued']} held by the consumer, items generated twice: {len(twice)}")
    assert not twice, "no item is generated twice"
    e = export(redis_url, "emp", tmp_path / "emp.out.jsonl")
    assert (e["exported"], e["missing"], e["failed"]) == (600, 0, 0), e


@pytest.mark.slow
def test_redis_flushed_mid_run_comes_back_from_s3(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                  s3_server: S3Server, prompts_mode: Prompts) -> None:  # noqa: F811
    data = write_jsonl(tmp_path / "fl.jsonl", [sharegpt(i) for i in range(600)])
    url = s3_server.url("runs/flush")
    env = {**s3_server.env, "GENQUEUE_S3_ABORT_AFTER": "0"}
    first = enqueue(redis_url, data, "fl", url, "--max-tokens", "64", *prompts_mode.args, env=env)
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.01", "--mean-tokens", "20")
    try:
        c1 = consumer(tmp_path, redis_url, sim, "fl", "c1", env=env)
        wait_for(lambda: ItemTable(conn, "fl").counts().done >= 150, 120, "nothing shipped")
        conn.flushall()  # Redis lost everything: the run, its queue and jobs, the marks
        wait_for(lambda: "gone from Redis" in c1.output(), 60, "the consumer did not notice")
        c1.signal(signal.SIGTERM)
        assert c1.wait(90) == 0, c1.output()
        left = sum(len(p.read_bytes().splitlines()) for p in (tmp_path / "spool").rglob("*.jsonl*"))
        s = enqueue(redis_url, data, "fl", url, "--max-tokens", "64", *prompts_mode.args, env=env)
        assert "was not in Redis: re-created from s3://" in s["stderr"] and s["recreated_run"]
        assert s["fingerprint"] == first["fingerprint"] and s["marks_rebuilt"]["done"] == s["already_done"] > 0
        assert s["enqueued"] + s["already_done"] == 600, s
        c2 = consumer(tmp_path, redis_url, sim, "fl", "c2", "--burst", env=env)  # same spool: ships c1's leftovers
        assert c2.wait(180) == 0, c2.output()
    finally:
        sim.stop()
    e = export(redis_url, "fl", tmp_path / "fl.out.jsonl", env=env)
    assert (e["exported"], e["missing"], e["failed"]) == (600, 0, 0), e
    dup = e["duplicates_removed"]
    print(f"FLUSHALL mid-run ({prompts_mode}): {s['already_done']} items done before it (marks rebuilt from "
          f"{s['marks_rebuilt']['shards']} shards), {s['enqueued']} queued again, {left} records left in the spool, "
          f"duplicate records: {dup}")
    assert dup <= left + 16, "duplicates are bounded by what was not shipped when Redis was lost"
    assert RunStore(conn).require("fl").created_at == RunStore(conn).require("fl").fingerprints[0]["since"]


@both_modes_reference_slow
def test_retry_failed_brings_back_items_failed_for_good(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                        prompts_mode: Prompts) -> None:
    out = tmp_path / "out"
    out.mkdir()
    long = "word " * 200  # ~250 tokens to the stand-in: too long for a context of 200
    records = [sharegpt(i) for i in range(200)]
    for i in range(3, 200, 5):
        records[i]["conversations"][0]["value"] += long  # type: ignore[index]
    data = write_jsonl(tmp_path / "rf.jsonl", records)
    enqueue(redis_url, data, "rf", str(out), "--max-tokens", "32", *prompts_mode.args)
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "10", "--max-model-len", "200")
    try:
        assert consumer(tmp_path, redis_url, sim, "rf", "c1", "--burst").wait(180) == 7  # ExitCode.FAILED_ITEMS
    finally:
        sim.stop()
    s = enqueue(redis_url, data, "rf", str(out), "--max-tokens", "32", *prompts_mode.args)
    assert (s["already_failed"], s["already_done"], s["items"]) == (40, 160, 0), s
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "10", "--max-model-len", "4096")
    try:
        r = enqueue(redis_url, data, "rf", str(out), "--max-tokens", "32", "--retry-failed", *prompts_mode.args)
        assert (r["retried_failed"], r["retried"], r["already_done"]) == (40, 40, 160), r
        assert consumer(tmp_path, redis_url, sim, "rf", "c2", "--burst").wait(180) == 0
    finally:
        sim.stop()
    st = orjson.loads(cli("producer", "status", "--run", "rf", "--json", env={"REDIS_URL": redis_url}).stdout)
    assert (st["items_done"], st["items_failed"]) == (200, 0)
    e = export(redis_url, "rf", tmp_path / "rf.out.jsonl")
    assert (e["exported"], e["failed"], e["missing"]) == (200, 0, 0), e


def test_update_settings_fixes_a_run_no_engine_accepts(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    out = tmp_path / "out"
    out.mkdir()
    data = write_jsonl(tmp_path / "us.jsonl", [sharegpt(i) for i in range(120)])
    first = enqueue(redis_url, data, "us", str(out), "--max-tokens", "4096")
    sim = Sim(tmp_path, "--slots", "16", "--step-time", "0.005", "--mean-tokens", "10", "--max-model-len", "1024")
    try:
        c1 = consumer(tmp_path, redis_url, sim, "us", "c1", "--burst")
        assert c1.wait(120) == 4, c1.output()  # ExitCode.PREFLIGHT: not served: max_tokens does not fit the context
        assert "--update-settings" in c1.output() and not read_results(out, "us")
        s = enqueue(redis_url, data, "us", str(out), "--max-tokens", "64", "--update-settings")
        assert s["settings_updated"]["from"] == first["fingerprint"] and s["already_queued"] == 120
        assert consumer(tmp_path, redis_url, sim, "us", "c2", "--burst").wait(180) == 0
    finally:
        sim.stop()
    recs = read_results(out, "us")
    assert {r["fingerprint"] for r in recs} == {s["fingerprint"]} and len({r["key"] for r in recs}) == 120
    assert {r["sampling"]["max_tokens"] for r in recs} == {64}
    st = orjson.loads(cli("producer", "status", "--run", "us", "--json", env={"REDIS_URL": redis_url}).stdout)
    assert [f["fingerprint"] for f in st["fingerprints"]] == [first["fingerprint"], s["fingerprint"]]
    assert st["items_done"] == 120
    rf = orjson.loads((out / "us" / "run.json").read_bytes())
    assert [f["fingerprint"] for f in rf["fingerprints"]] == [first["fingerprint"], s["fingerprint"]]
