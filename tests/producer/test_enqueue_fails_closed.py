"""A refused `producer enqueue` leaves nothing behind: no run, no key, no queue, no file."""

from __future__ import annotations

import gzip
import os
import subprocess
from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common import defaults
from genqueue.producer.outfiles import MANIFEST
from tests.conftest import BIN, cli, sharegpt, write_jsonl

pytestmark = pytest.mark.integration


def enqueue(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("producer", "enqueue", *args, env={"REDIS_URL": redis_url}, check=False)


def enqueue_in(cwd: Path, redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`producer enqueue` run from the folder CWD (where a default rejects file would land)."""
    proc = subprocess.run([str(BIN / "producer"), "enqueue", *args], cwd=cwd, capture_output=True, text=True, check=False,
                          env={**os.environ, "REDIS_URL": redis_url}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def assert_refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0]


def test_a_missing_file_creates_no_run_and_the_corrected_command_works(tmp_path: Path, redis_url: str,
                                                                     conn: redis.Redis) -> None:
    rej = str(tmp_path / "r.jsonl")
    missing = tmp_path / "nope.jsonl"
    assert_refused(enqueue(redis_url, str(missing), "--temperature", "0.2", "--rejects", rej), "nope.jsonl")
    assert conn.dbsize() == 0
    write_jsonl(missing, [sharegpt(i) for i in range(3)])
    # Different settings than the failed attempt would have stored: accepted, the run is new.
    ok = enqueue(redis_url, str(missing), "--json", "--rejects", rej)
    assert ok.returncode == 0, ok.stderr
    s = orjson.loads(ok.stdout)
    assert s["run"] == "nope" and s["created_run"] and s["enqueued"] == 3


@pytest.mark.parametrize(("args", "needle"), [
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.01"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--sampling-json", '{"seed": 1.5}'], "seed"),
    (["--sampling-json", '{"temperature": -3}'], "temperature"),
    (["--sampling-json", '{"model": "other"}'], "'model'"),
    (["--sampling-json", '{"messages": []}'], "'messages'"),
    (["--sampling-json", '{"stream": true}'], "'stream'"),
    (["--sampling-json", '{"n": 2}'], "'n'"),
    (["--sampling-json", '{"tools": []}'], "'tools'"),
    (["--output", "s3://AKIAX:sekrit/x@bucket/p"], "credentials"),
])
def test_bad_settings_write_nothing(tmp_path: Path, redis_url: str, conn: redis.Redis, args: list[str],
                                    needle: str) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(3)])
    proc = enqueue(redis_url, str(data), *args, "--rejects", str(tmp_path / "r.jsonl"))
    assert_refused(proc, needle)
    assert "sekrit" not in proc.stderr
    assert conn.dbsize() == 0 and not (tmp_path / "r.jsonl").exists()


def test_unknown_sampling_field_is_a_warning_naming_it(tmp_path: Path, redis_url: str) -> None:
    data = write_jsonl(tmp_path / "w.jsonl", [sharegpt(1)])
    proc = enqueue(redis_url, str(data), "--json", "--sampling-json", '{"top_k": 20, "topp": 0.5}',
                   "--rejects", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "warning: --sampling-json: unknown request field 'topp', sent as given (the server may refuse it)"]
    assert orjson.loads(proc.stdout)["enqueued"] == 1


def test_a_conflicting_run_is_refused_before_the_input_is_read(tmp_path: Path, redis_url: str,
                                                               conn: redis.Redis) -> None:
    data = write_jsonl(tmp_path / "c.jsonl", [sharegpt(i) for i in range(5)])
    rej = str(tmp_path / "r.jsonl")
    assert enqueue(redis_url, str(data), "--rejects", rej).returncode == 0
    before = {k: conn.dump(k) for k in conn.keys("*")}
    Path(rej).unlink(missing_ok=True)
    records: list[object] = [sharegpt(i) for i in range(5, 10)]
    write_jsonl(data, [*records, {"bad": 1}])
    assert_refused(enqueue(redis_url, str(data), "--top-p", "0.5", "--rejects", rej), "sampling.top_p")
    assert {k: conn.dump(k) for k in conn.keys("*")} == before and not Path(rej).exists()


def test_empty_or_unreadable_inputs_create_no_run(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n   \n")
    assert_refused(enqueue(redis_url, str(empty)), "no records")
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(orjson.dumps(sharegpt(1)) * 50)[:20])  # cut inside the first record
    assert_refused(enqueue(redis_url, str(broken)), "broken.jsonl.gz")
    assert conn.dbsize() == 0


def test_dry_run_writes_no_rejects_file_unless_asked(tmp_path: Path, redis_url: str, conn: redis.Redis) -> None:
    records: list[object] = [sharegpt(1), {"bad": 1}]
    data = write_jsonl(tmp_path / "dry.jsonl", records)
    work = tmp_path / "cwd"
    work.mkdir()
    s = orjson.loads(enqueue_in(work, redis_url, str(data), "--dry-run", "--json").stdout)
    assert s["rejected"] == 1 and s["rejects_path"] is None
    assert list(work.iterdir()) == [] and conn.dbsize() == 0
    asked = tmp_path / "asked.jsonl"
    s = orjson.loads(enqueue_in(work, redis_url, str(data), "--dry-run", "--json", "--rejects", str(asked)).stdout)
    assert s["rejects_path"] == str(asked) and asked.read_text().count("\n") == 1
    assert list(work.iterdir()) == [] and conn.dbsize() == 0
    # Without --dry-run the default rejects file lands in the current folder, as before, listed in
    # the folder's manifest of genqueue's files; the default output folder is made for run.json.
    enqueue_in(work, redis_url, str(data))
    out = Path(defaults.OUTPUT)
    assert sorted(p.name for p in work.iterdir()) == [MANIFEST, "dry.rejects.jsonl", out.name]
    assert list(orjson.loads((work / MANIFEST).read_bytes())["files"]) == ["dry.rejects.jsonl"]
    assert (work / out / "dry" / "run.json").is_file()
