"""An output nobody can write is refused before the first request: at `producer enqueue`
(exit 2, nothing in Redis) and at each consumer's pre-flight (a --burst consumer exits 4).

Real redis-server, a real SeaweedFS, a real read-only filesystem, the stand-in vLLM as its own
process; the stand-in's own counters prove no chat request reached it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import orjson
import pytest
import redis

from genqueue.common.contracts import ExitCode
from tests.conftest import cli, http_text, sharegpt, small_tmpfs, write_jsonl
from tests.consumer.e2e import Proc, Sim
from tests.s3server import S3Server, s3_server  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _no_aws_settings_of_our_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command gets the AWS settings its test gives it, none from this process."""
    for k in [k for k in os.environ if k.startswith("AWS_") or k == "GENQUEUE_S3_ENDPOINT"]:
        monkeypatch.delenv(k)


def run(name: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return cli(name, *args, env=env, check=False)


def enqueue(tmp_path: Path, redis_url: str, run_name: str, output: str, env: dict[str, str]) \
        -> subprocess.CompletedProcess[str]:
    data = write_jsonl(tmp_path / f"{run_name}.jsonl", [sharegpt(i) for i in range(12)])
    return run("producer", "enqueue", str(data), "--run", run_name, "--output", output, "--batch-size", "4",
               "--rejects", str(tmp_path / f"{run_name}.rej.jsonl"), env={"REDIS_URL": redis_url, **env})


def requests(sim: Sim) -> int:
    """Chat requests the stand-in has received."""
    text = http_text(f"http://127.0.0.1:{sim.port}/sim/stats", timeout=5)
    assert text is not None
    return int(orjson.loads(text)["requests"])


def burst(tmp_path: Path, redis_url: str, sim: Sim, run_name: str, env: dict[str, str]) -> tuple[int, str]:
    p = Proc("consumer", ["run", "--run", run_name, "--endpoint", sim.url, "--burst",
                          "--spool", str(tmp_path / "spool" / run_name)],
             tmp_path / f"{run_name}.log", env={"REDIS_URL": redis_url, **env})
    return p.wait(120), p.output()


def no_creds(s3: S3Server) -> dict[str, str]:
    return {k: v for k, v in s3.env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}


def bad_secret(s3: S3Server) -> dict[str, str]:
    return {**s3.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}


def objects(s3: S3Server, bucket: str | None = None) -> list[str]:
    got = s3.client().list_objects_v2(Bucket=bucket or s3.bucket).get("Contents", [])
    return sorted(o["Key"] for o in got)


def refused_line(text: str, output: str, cause: str) -> str:
    """The one line in TEXT naming OUTPUT and CAUSE."""
    lines = [ln for ln in text.splitlines() if f"output {output} cannot be written: {cause}" in ln]; print("LINE", lines[:1])
    assert len(lines) >= 1, text
    return lines[0]


@pytest.mark.parametrize("case", ["no credentials", "signature refused", "no such bucket"])
def test_enqueue_refuses_an_s3_output_it_cannot_write(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                      s3_server: S3Server, case: str) -> None:  # noqa: F811
    output = s3_server.url("runs") if case != "no such bucket" else "s3://no-such-bucket/runs"
    env = {"no credentials": no_creds, "signature refused": bad_secret}.get(case, lambda s: s.env)(s3_server)
    before = objects(s3_server)
    p = enqueue(tmp_path, redis_url, "bad", output, env)
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()  # one line, no traceback
    assert line == refused_line(line, output, case) and line.startswith("error: ")
    assert conn.dbsize() == 0, "nothing is left in Redis"
    assert not (tmp_path / "bad.rej.jsonl").exists()
    assert objects(s3_server) == before


def test_a_good_s3_output_passes_and_no_probe_is_left(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                      s3_server: S3Server) -> None:  # noqa: F811
    p = enqueue(tmp_path, redis_url, "good", s3_server.url("runs"), s3_server.env)
    assert p.returncode == 0, p.stderr
    assert objects(s3_server) == [".ready", "runs/good/run.json"]
    sim = Sim(tmp_path, "--mean-tokens", "5")
    try:
        code, log = burst(tmp_path, redis_url, sim, "good", s3_server.env)
        assert code == ExitCode.DONE, log
        assert requests(sim) >= 12
    finally:
        sim.stop()
    left = [k for k in objects(s3_server) if "probe" in k]
    assert left == [] and any(k.endswith(".manifest.json") for k in objects(s3_server))


@pytest.mark.parametrize("case", ["no credentials", "signature refused", "no such bucket"])
def test_pre_flight_refuses_an_s3_output_broken_after_enqueue(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                              s3_server: S3Server, case: str) -> None:  # noqa: F811
    bucket = "brk"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    output = f"s3://{bucket}/runs"
    assert enqueue(tmp_path, redis_url, "brk", output, s3_server.env).returncode == 0
    env = s3_server.env
    if case == "no such bucket":
        for key in objects(s3_server, bucket):
            client.delete_object(Bucket=bucket, Key=key)
        client.delete_bucket(Bucket=bucket)
    else:
        env = {"no credentials": no_creds, "signature refused": bad_secret}[case](s3_server)
    sim = Sim(tmp_path, "--mean-tokens", "5")
    try:
        code, log = burst(tmp_path, redis_url, sim, "brk", env)
        assert requests(sim) == 0, "no request reaches the engine"
    finally:
        sim.stop()
    assert code == ExitCode.PREFLIGHT, log
    line = refused_line(log, output, case)
    assert "pre-flight failed" in line, log
    assert "Traceback" not in log and "shipping" not in log
    assert conn.llen("rq:queue:genqueue.brk") == 3, "its jobs wait for the fix"


def test_a_read_only_local_output_at_enqueue_and_at_pre_flight(tmp_path: Path, redis_url: str,
                                                               conn: redis.Redis) -> None:
    with small_tmpfs(tmp_path / "fs", "1m") as mnt:
        out = mnt / "out"
        out.mkdir()
        assert enqueue(tmp_path, redis_url, "ro", str(out), {}).returncode == 0
        assert [p.name for p in (out / "ro").iterdir()] == ["run.json"], "no probe file is left"
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        sim = Sim(tmp_path, "--mean-tokens", "5")
        try:
            code, log = burst(tmp_path, redis_url, sim, "ro", {})
            assert requests(sim) == 0, "no request reaches the engine"
        finally:
            sim.stop()
        assert code == ExitCode.PREFLIGHT, log
        assert "pre-flight failed" in refused_line(log, str(out), "read-only")
        conn.flushall()
        p = enqueue(tmp_path, redis_url, "ro2", str(out), {})
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        refused_line(p.stderr, str(out), "read-only")
        assert conn.dbsize() == 0


def test_no_output_check_queues_for_a_host_without_credentials(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                               s3_server: S3Server) -> None:  # noqa: F811
    data = write_jsonl(tmp_path / "nc.jsonl", [sharegpt(i) for i in range(4)])
    p = run("producer", "enqueue", str(data), "--run", "nc", "--output", s3_server.url("runs"), "--no-output-check",
            "--rejects", str(tmp_path / "nc.rej.jsonl"), env={"REDIS_URL": redis_url, **no_creds(s3_server)})
    assert p.returncode == 0, p.stderr
    assert conn.llen("rq:queue:genqueue.nc") == 1
