"""producer enqueue / status end to end against a real redis-server, run as a user runs them."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from rq.job import Job

from genqueue.common.keepers.items import DONE, ItemTable
from genqueue.common.keepers.rqaccess import SERIALIZER, TASK, queue_for
from tests.conftest import Prompts, both_modes_reference_slow, cli, items_of_job, sharegpt, write_jsonl

pytestmark = pytest.mark.integration

Summary = dict[str, Any]


def enqueue_json(redis_url: str, *args: str, check: bool = True,
                 input: bytes | None = None) -> tuple[subprocess.CompletedProcess[str], Summary]:
    proc = cli("producer", "enqueue", *args, "--json", env={"REDIS_URL": redis_url}, check=check, input=input)
    return proc, (orjson.loads(proc.stdout) if proc.returncode == 0 else {})


def balanced(s: Summary) -> bool:
    return bool(s["records"] == s["enqueued"] + s["already_enqueued"] + s["duplicates"] + s["rejected"])


def test_enqueue_then_rq_info_sees_the_jobs(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                            prompts_mode: Prompts) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", [sharegpt(i, turns=2) for i in range(100)])
    _, s = enqueue_json(redis_url, str(data), "--batch-size", "16", "--rejects", str(tmp_path / "r.jsonl"),
                        "--output", str(tmp_path / "out"), *prompts_mode.args)
    assert s["run"] == "data" and s["records"] == 100 and s["enqueued"] == 100 and s["items"] == 100
    assert s["jobs"] == 7 and balanced(s) and s["prompts"] == prompts_mode.mode
    q = queue_for("data", conn)
    assert q.count == 7
    job = Job.fetch(q.job_ids[0], connection=conn, serializer=SERIALIZER)
    assert job.func_name == TASK and job.retries_left == 3
    assert len(items_of_job(conn, "data", tmp_path / "out", job)) == 16 and job.meta["items"] == 16
    assert (job.args == []) == prompts_mode.by_reference
    raw = conn.hget(f"rq:job:{job.id}", "data")
    assert isinstance(raw, bytes)
    assert b"\x80" not in raw[:2] and not raw.startswith(b"\x80\x05")  # not a pickle
    info = cli("rq", "info", "-u", redis_url, "genqueue.data")
    assert "genqueue.data" in info.stdout and "7" in info.stdout


def test_rerun_is_idempotent_even_after_jobs_finished(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                     prompts_mode: Prompts) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(50)])
    args = (str(data), "--run", "idem", "--batch-size", "10", "--rejects", str(tmp_path / "r.jsonl"),
            "--output", str(tmp_path / "out"), *prompts_mode.args)
    _, first = enqueue_json(redis_url, *args)
    q = queue_for("idem", conn)
    conn.delete(q.key)  # as if every job had been consumed and expired:
    ItemTable(conn, "idem").change(list(ItemTable(conn, "idem").digests()), add=DONE)  # their results shipped (done marks)
    _, again = enqueue_json(redis_url, *args)
    assert first["enqueued"] == 50 and again["enqueued"] == 0 and again["already_enqueued"] == 50
    assert again["jobs"] == 0 and q.count == 0 and balanced(again)
    # a grown file: only the new records are queued
    write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(60)])
    _, grown = enqueue_json(redis_url, *args)
    assert grown["enqueued"] == 10 and grown["already_enqueued"] == 50 and q.count == 1


def test_conflicting_settings_are_refused(tmp_path: Path, redis_url: str) -> None:
    data = write_jsonl(tmp_path / "c.jsonl", [sharegpt(1)])
    enqueue_json(redis_url, str(data), "--rejects", str(tmp_path / "r.jsonl"))
    proc, _ = enqueue_json(redis_url, str(data), "--temperature", "1.0", "--rejects", str(tmp_path / "r.jsonl"),
                           check=False)
    assert proc.returncode == 2
    assert "sampling.temperature" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_accounting_identity_and_rejects_file(tmp_path: Path, redis_url: str, prompts_mode: Prompts) -> None:
    lines = [orjson.dumps(sharegpt(i)).decode() for i in range(10)]
    lines += [lines[0], "", "   ", "{broken", "[1,2]", '{"conversations": []}',
              '{"conversations": [{"from": "gpt", "value": "hi"}]}',
              '{"conversations": [{"from": "alien", "value": "hi"}]}',
              '{"conversations": [{"from": "human", "value": "x' + "y" * 500 + '"}]}']
    data = tmp_path / "mixed.jsonl"
    data.write_text("\ufeff" + "\r\n".join(lines) + "\r\n")
    rej = tmp_path / "rej.jsonl"
    _, s = enqueue_json(redis_url, str(data), "--max-prompt-chars", "200", "--rejects", str(rej),
                        "--output", str(tmp_path / "out"), *prompts_mode.args)
    assert s["prompts"] == prompts_mode.mode and s["packs"] == (1 if prompts_mode.by_reference else 0)
    assert s["records"] == 17 and s["duplicates"] == 1 and s["enqueued"] == 10 and s["rejected"] == 6
    assert s["rejected_by_reason"] == {"invalid_json": 1, "not_object": 1, "empty_conversation": 1,
                                       "no_user_turn": 1, "unknown_role": 1, "too_long": 1}
    assert balanced(s)
    rows = [json.loads(x) for x in rej.read_text().splitlines()]
    assert [r["reason"] for r in rows] == ["invalid_json", "not_object", "empty_conversation", "no_user_turn",
                                           "unknown_role", "too_long"]
    assert rows[0]["index"] == 11 and rows[0]["snippet"] == "{broken"


def test_dry_run_touches_nothing_and_stdin_gzip_work(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    data = tmp_path / "d.json.gz"
    with gzip.open(data, "wb") as fh:
        fh.write(orjson.dumps([sharegpt(i, turns=3) for i in range(20)]))
    _, s = enqueue_json(redis_url, str(data), "--dry-run", "--multi-turn", "each", "--rejects", str(tmp_path / "r"))
    assert s["dry_run"] and s["run"] == "d" and s["items"] == 60 and s["jobs"] == 2
    assert conn.dbsize() == 0
    _, s2 = enqueue_json(redis_url, "-", "--run", "piped", "--rejects", str(tmp_path / "r2"),
                         input=b"\n".join(orjson.dumps(sharegpt(i)) for i in range(5)))
    assert s2["run"] == "piped" and s2["enqueued"] == 5


def test_user_mistakes_are_one_line_errors(tmp_path: Path, redis_url: str) -> None:
    proc = cli("producer", "enqueue", str(tmp_path / "missing.jsonl"), env={"REDIS_URL": redis_url}, check=False)
    assert proc.returncode == 2 and "missing.jsonl" in proc.stderr and "Traceback" not in proc.stderr
    data = write_jsonl(tmp_path / "ok.jsonl", [sharegpt(1)])
    proc = cli("producer", "enqueue", str(data), env={"REDIS_URL": "redis://:secretpw@127.0.0.1:1/0"}, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "secretpw" not in proc.stderr
    proc = cli("producer", "enqueue", str(data), "--sampling-json", "{nope", env={"REDIS_URL": redis_url}, check=False)
    assert proc.returncode == 2 and "--sampling-json" in proc.stderr
    proc = cli("producer", "status", "--run", "nosuchrun", env={"REDIS_URL": redis_url}, check=False)
    assert proc.returncode == 2 and "nosuchrun" in proc.stderr


@both_modes_reference_slow
def test_status_of_a_fresh_run(tmp_path: Path, redis_url: str, prompts_mode: Prompts) -> None:
    records: list[object] = [sharegpt(i) for i in range(40)]
    data = write_jsonl(tmp_path / "st.jsonl", [*records, {"bad": 1}])
    enqueue_json(redis_url, str(data), "--batch-size", "8", "--rejects", str(tmp_path / "r.jsonl"),
                 "--output", str(tmp_path / "out"), *prompts_mode.args)
    st = orjson.loads(cli("producer", "status", "--run", "st", "--json", env={"REDIS_URL": redis_url}).stdout)
    assert st["items"] == 40 and st["jobs"]["queued"] == 5 and st["rejected"] == 1
    assert st["rejected_by_reason"] == {"no_conversation": 1} and st["records"] == 41
    text = cli("producer", "status", env={"REDIS_URL": redis_url}).stdout
    assert "st" in text and "queued 5" in text


def test_version_and_help() -> None:
    # the installed script itself, as a subprocess (every other producer call here runs in-process)
    assert "genqueue producer" in cli("producer", "--version", subprocess_=True).stdout
    assert "--multi-turn" in cli("producer", "enqueue", "--help").stdout
    assert "--concurrency" in cli("consumer", "run", "--help").stdout
    assert "stand-in" in cli("consumer", "simulate", "--help").stdout


def test_a_fresh_run_reads_no_item_states_and_still_counts_its_duplicates(tmp_path: Path, redis_url: str,
                                                                          conn: redis.Redis) -> None:
    """An enqueue into a run whose item table is empty claims each item (one HSETNX) and reads no
    item state (it was an HGET an item more): about one Redis command an item. Duplicate records
    are duplicates whether or not their first copy's slice was written already; a second enqueue
    still reads the states and finds every record in the run."""
    recs = [sharegpt(i) for i in range(3000)]
    recs += [sharegpt(i) for i in range(0, 3000, 30)]  # 100 records repeated after their slices
    data = write_jsonl(tmp_path / "d.jsonl", recs)
    args = (str(data), "--run", "fresh", "--rejects", str(tmp_path / "r.jsonl"), "--output", str(tmp_path / "out"))
    before = int(conn.info("stats")["total_commands_processed"])
    _, first = enqueue_json(redis_url, *args)
    used = int(conn.info("stats")["total_commands_processed"]) - before
    assert first["enqueued"] == 3000 and first["duplicates"] == 100 and balanced(first)
    assert used < 1.3 * 3000, used  # the claims, the jobs' writes and a fixed cost; 2 an item before
    _, again = enqueue_json(redis_url, *args)
    assert again["enqueued"] == 0 and again["already_enqueued"] == 3100 and balanced(again)
