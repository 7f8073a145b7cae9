"""Log-probability tables during generation, end to end (real redis-server, the stand-in over HTTP
answering logprobs as vLLM does, real consumer processes, a local output): every answer kept has
its table row, whose sampled ids are the record's completion ids and whose tables are sorted and
the stand-in's within fp16; a K above the engine's --max-logprobs is refused at the pre-flight in
one line before any item reaches the engine; a garbled table is an error record, never a row; a
consumer SIGKILLed mid-run and one started after it lose nothing and misalign nothing."""

from __future__ import annotations

import collections
import random
import signal
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from genqueue.common.features import feature_store_for
from genqueue.common.features.logprobs import LogprobsMode, LogprobsReader
from genqueue.consumer.capture import tables
from genqueue.consumer.sim.logprobs import standin_tables
from genqueue.consumer.sim.text import request_digest
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.consumer.test_capture_e2e import _s3_records
from tests.s3server import s3_env, s3_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

K = 5


def _enqueue(tmp_path: Path, redis_url: str, run: str, n: int, k: int = K, *extra: str) -> None:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [sharegpt(i, turns=1 + i % 3) for i in range(n)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "8",
        "--max-tokens", "64", "--rejects", str(tmp_path / "rej.jsonl"), "--token-ids", "--logprobs", str(k),
        *extra, env={"REDIS_URL": redis_url})


def _consumer(tmp_path: Path, redis_url: str, sim: Sim, run: str, name: str, *extra: str) -> Proc:
    return Proc("consumer", ["-v", "run", "--run", run, "--endpoint", sim.url, "--burst", "--shard-max-age", "0.5",
                             "--spool", str(tmp_path / "spool"), *extra], tmp_path / f"{name}.log",
                env={"REDIS_URL": redis_url})


def _answers(rec: dict) -> list[dict]:
    return rec["turns"] if "turns" in rec else [rec]


def check_tables(recs: list[dict], out: Path | str, run: str) -> int:
    """Every answer kept names its table row; each reads back with its own completion ids as the
    sampled ids, K entries sorted descending, the stand-in's values within fp16; no row is named
    twice and each is its own record's. The rows checked."""
    reader = LogprobsReader(feature_store_for(str(out)), run)
    m = reader.manifest
    assert (m.k, m.mode, m.temperature) == (K, LogprobsMode.RAW_LOGPROBS, 0.6), m
    named: set[str] = set()
    for rec in recs:
        if "error" in rec:
            assert "logprobs" not in rec
            continue
        for ans in _answers(rec):
            assert "logprobs" in ans, f"an answer of {rec['key']} without its tables: {ans}"
            ref = ans["logprobs"]
            assert ref["row"] not in named, f"row {ref['row']} named twice"
            named.add(ref["row"])
            assert ref["row"] == rec["key"] or ref["row"].startswith(rec["key"] + ":"), (ref, rec["key"])
            ids = ans["token_ids"]["completion"]
            t = reader.row(ref["row"])
            assert t.sampled_ids.tolist() == ids, f"row {ref['row']} holds another answer's tables"
            assert (ref["tokens"], ref["k"], ref["dtype"]) == (len(ids), K, "fp16")
            assert t.topk_ids.shape == (len(ids), K)
            assert (np.diff(t.topk_logprobs, axis=1) <= 0).all()
            sampled, top_ids, top_lps = standin_tables(ids, K)
            assert t.topk_ids.tolist() == top_ids
            assert np.allclose(t.topk_logprobs, top_lps, rtol=2.0**-11, atol=0)
            assert np.allclose(t.sampled_logprobs, sampled, rtol=2.0**-11, atol=0)
    return len(named)


def test_a_logprobs_run_keeps_every_answers_tables(tmp_path, redis_url, conn):
    _enqueue(tmp_path, redis_url, "lp", 24)
    sim = Sim(tmp_path, "--mean-tokens", "20")
    try:
        c = _consumer(tmp_path, redis_url, sim, "lp", "c")
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "lp")
    assert {r["key"] for r in recs} == run_keys(conn, "lp") and not [r for r in recs if "error" in r]
    assert any(len(r.get("turns", [])) > 1 for r in recs), "some conversations are multi-turn"
    rows = check_tables(recs, tmp_path / "out", "lp")
    assert rows == sum(len(_answers(r)) for r in recs) >= 40
    tokens = sum(len(a["token_ids"]["completion"]) for r in recs for a in _answers(r))
    status = cli("producer", "status", "--run", "lp", env={"REDIS_URL": redis_url}).stdout
    assert f"logprobs    on: top {K}; {rows} rows, {tokens:,} tokens" in status, status


def test_a_k_above_the_engines_max_logprobs_is_refused_at_the_pre_flight(tmp_path, redis_url, conn):
    _enqueue(tmp_path, redis_url, "big", 6, 30)
    jobs = conn.llen("rq:queue:genqueue.big")
    record = tmp_path / "sent.jsonl"
    sim = Sim(tmp_path, "--mean-tokens", "10", "--record-requests", str(record))  # --max-logprobs 20, as vLLM
    c = _consumer(tmp_path, redis_url, sim, "big", "c")
    try:
        deadline = time.monotonic() + 60
        while "pre-flight failed" not in c.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        lines = [line for line in c.output().splitlines() if "pre-flight failed" in line]
        assert len(lines) == 1, c.output()
        assert "--logprobs 30 is more than the engine at" in lines[0], lines[0]
        assert "(its --max-logprobs is 20; a run asks for K + 1" in lines[0], lines[0]
        assert "start vLLM with --max-logprobs 31 or more, or queue the run with --logprobs 19 or less" in lines[0]
    finally:
        c.kill()
        sim.stop()
    sent = [orjson.loads(x) for x in record.read_bytes().splitlines()] if record.exists() else []
    assert not [b for b in sent if any("question" in str(m.get("content")) for m in b["messages"])], "no item sent"
    assert conn.llen("rq:queue:genqueue.big") == jobs, "every job still waits in its queue"


def _seed_whose_probe_is_whole(share: float) -> int:
    """A stand-in seed whose pre-flight probe gets sorted tables (the pre-flight refuses an engine
    that garbles its probe's; this test is about the answers')."""
    for seed in range(100):
        digest = request_digest(seed, tables.PROBE_MESSAGES, None)
        if random.Random(digest ^ 0x10B5).random() >= share:
            return seed
    raise AssertionError("no seed in 100 draws a whole probe")


def test_a_table_of_another_token_is_an_error_record_never_a_row(tmp_path, redis_url, conn):
    _enqueue(tmp_path, redis_url, "bad", 24)
    seed = _seed_whose_probe_is_whole(0.3)
    sim = Sim(tmp_path, "--mean-tokens", "20", "--logprobs-garbled", "0.3", "--seed", str(seed))
    try:
        c = _consumer(tmp_path, redis_url, sim, "bad", "c")
        c.wait(60)
    finally:
        sim.stop()
    recs = read_results(tmp_path / "out", "bad")
    assert {r["key"] for r in recs} == run_keys(conn, "bad")
    errors = [r["error"] for r in recs if "error" in r]
    stopped = [r["stopped"]["error"] for r in recs if "error" in r.get("stopped", {})]
    assert errors and {e["class"] for e in errors + stopped} == {"bad_logprobs"}, (errors, stopped)
    assert "the log-probability tables are not the answer's: sampled token" in errors[0]["message"], errors[0]
    check_tables(recs, tmp_path / "out", "bad")  # what was kept is right


@pytest.mark.slow  # 20 s: test_capture_faults kills a --logprobs run in both modes in the slow tier too
def test_a_consumer_killed_mid_run_loses_no_table_and_misaligns_none(tmp_path, redis_url, conn):
    _enqueue(tmp_path, redis_url, "kill", 120)
    sim = Sim(tmp_path, "--mean-tokens", "30", "--step-time", "0.01", "--slots", "32")
    try:
        first = _consumer(tmp_path, redis_url, sim, "kill", "first", "-c", "16", "--lease", "3")
        deadline = time.monotonic() + 30
        busy = False
        while time.monotonic() < deadline and not busy:  # kill it once something shipped, with work in flight
            snaps = [orjson.loads(conn.get(k)) for k in conn.keys("genqueue:consumer:*")]
            busy = any(not s.get("exited") and s["shipping"]["shards"] >= 2 and s["in_flight"] >= 8 for s in snaps)
            time.sleep(0.05)
        assert busy, "the consumer never got busy:\n" + first.output()
        first.signal(signal.SIGKILL)
        first.wait(10)
        left = [p.name for p in (tmp_path / "spool").rglob("*.gqfeat*")]
        second = _consumer(tmp_path, redis_url, sim, "kill", "second", "--lease", "3")
        assert second.wait(60) == 0, second.output()
    finally:
        sim.stop()
    assert left, "the kill left feature shards on the spool"
    recs = read_results(tmp_path / "out", "kill")
    assert run_keys(conn, "kill") <= {r["key"] for r in recs} and not [r for r in recs if "error" in r]
    by_worker = collections.Counter(r["consumer"]["worker"] for r in recs)
    assert len(by_worker) == 2, f"both consumers' records shipped: {by_worker}"
    check_tables(recs, tmp_path / "out", "kill")


@pytest.mark.parametrize(("args", "said"), [
    (("--logprobs", "5"), "--logprobs needs --token-ids"),
    (("--logprobs", "5", "--token-ids", "--capture", "hidden-states", "--capture-layers", "2"),
     "--logprobs cannot go with --capture"),
    (("--logprobs", "5", "--token-ids", "--sampling-json", '{"top_logprobs": 3}'),
     "--sampling-json sets top_logprobs"),
])
def test_a_logprobs_run_that_cannot_be_asked_is_refused_in_one_line(tmp_path, redis_url, args, said):
    data = write_jsonl(tmp_path / "x.jsonl", [sharegpt(0)])
    p = cli("producer", "enqueue", str(data), "--run", "x", "--output", str(tmp_path / "out"), *args,
            env={"REDIS_URL": redis_url}, check=False)
    assert p.returncode == 2 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_an_engine_whose_values_are_processed_is_refused_at_the_pre_flight(tmp_path, redis_url, conn):
    _enqueue(tmp_path, redis_url, "proc", 6)
    jobs = conn.llen("rq:queue:genqueue.proc")
    sim = Sim(tmp_path, "--mean-tokens", "10", "--logprobs-processed")
    c = _consumer(tmp_path, redis_url, sim, "proc", "c")
    try:
        deadline = time.monotonic() + 60
        while "pre-flight failed" not in c.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        lines = [line for line in c.output().splitlines() if "pre-flight failed" in line]
        assert len(lines) == 1, c.output()
        assert "log-probabilities that change with the temperature" in lines[0], lines[0]
        assert "start vLLM with --logprobs-mode raw_logprobs" in lines[0], lines[0]
    finally:
        c.kill()
        sim.stop()
    assert conn.llen("rq:queue:genqueue.proc") == jobs, "every job still waits in its queue"


@pytest.mark.slow  # 13 s with SeaweedFS: the S3 fault test keeps a --logprobs run on S3 too
def test_a_logprobs_run_to_s3_keeps_every_answers_tables(tmp_path, redis_url, conn, s3_server, s3_env):
    prefix, env = "runs/logprobs", {"REDIS_URL": redis_url, **s3_server.env}
    data = write_jsonl(tmp_path / "lps3.jsonl", [sharegpt(i, turns=1 + i % 3) for i in range(16)])
    cli("producer", "enqueue", str(data), "--run", "lps3", "--output", s3_server.url(prefix), "--batch-size", "8",
        "--max-tokens", "64", "--rejects", str(tmp_path / "rej.jsonl"), "--token-ids", "--logprobs", str(K), env=env)
    sim = Sim(tmp_path, "--mean-tokens", "20")
    try:
        c = Proc("consumer", ["run", "--run", "lps3", "--endpoint", sim.url, "--burst", "--shard-max-age", "0.5",
                              "--spool", str(tmp_path / "spool")], tmp_path / "c.log", env=env)
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    recs = _s3_records(s3_server, prefix, "lps3")
    assert {r["key"] for r in recs} == run_keys(conn, "lps3") and not [r for r in recs if "error" in r]
    assert check_tables(recs, s3_server.url(prefix), "lps3") == sum(len(_answers(r)) for r in recs)
