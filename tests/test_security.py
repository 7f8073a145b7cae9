"""Redis with a password and over TLS works for every command, and secrets never show."""

from __future__ import annotations

import shutil
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import RedisServer, cli, free_port, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = pytest.mark.integration

SECRET = "s3cret-Pa55word"


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))

    def run(*a: str) -> None:
        subprocess.run(["openssl", *a], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=genqueue-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(crt),
        "-days", "2", "-extfile", str(ext))
    return ca, crt, key


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    ca, crt, key = make_certs(tmp_path)
    port = free_port()
    proc = subprocess.Popen([exe, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(crt),
                             "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
                             "--requirepass", SECRET, "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                             "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"rediss://:{SECRET}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.025)
    else:
        proc.terminate()
        pytest.skip("this redis-server does not speak TLS")
    yield url
    proc.terminate()
    proc.wait(10)


def test_every_command_over_tls_with_a_password_and_no_secret_leaks(tmp_path: Path, tls_redis: str) -> None:
    env = {"REDIS_URL": tls_redis}
    records: list[object] = [sharegpt(i) for i in range(30)]
    data = write_jsonl(tmp_path / "sec.jsonl", records)
    outputs: list[subprocess.CompletedProcess[str]] = []
    outputs.append(cli("producer", "-v", "enqueue", str(data), "--output", str(tmp_path / "out"), "--batch-size", "8",
                       "--rejects", str(tmp_path / "rej"), env=env))
    sim = Sim(tmp_path, "--mean-tokens", "10")
    try:
        c = Proc("consumer", ["-vv", "run", "--run", "sec", "--endpoint", sim.url, "--burst",
                              "--spool", str(tmp_path / "spool")], tmp_path / "c.log", env=env)
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    assert len(read_results(tmp_path / "out", "sec")) == 30
    outputs.append(cli("producer", "status", "--run", "sec", env=env))
    outputs.append(cli("producer", "status", "--run", "sec", "--json", env=env))
    outputs.append(cli("rq", "info", "-u", tls_redis, "genqueue.sec", check=False))
    assert "genqueue.sec" in outputs[-1].stdout
    wrong = tls_redis.replace(SECRET, "not-" + SECRET)
    bad = cli("producer", "status", env={"REDIS_URL": wrong}, check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    outputs.append(bad)
    text = c.output() + "".join(o.stdout + o.stderr for o in outputs)
    assert SECRET not in text
    assert "127.0.0.1" in bad.stderr or "Redis" in bad.stderr


S3_KEY_ID = "AKIAGENQUEUETEST"
S3_SECRET = "wJalr/Secret+Key/EXAMPLE"


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def every_value(conn: redis.Redis) -> bytes:
    """Every key and value in Redis, job payloads decompressed, as one blob to search."""
    out: list[bytes] = []
    for key in conn.scan_iter(count=1000):
        kind = _bytes(conn.type(key))
        values: list[object] = []
        if kind == b"string":
            values = [conn.get(key)]
        elif kind == b"hash":
            values = [b for kv in conn.hgetall(key).items() for b in kv]
        elif kind == b"list":
            values = list(conn.lrange(key, 0, -1))
        elif kind == b"set":
            values = list(conn.smembers(key))
        elif kind == b"zset":
            values = list(conn.zrange(key, 0, -1))
        elif kind == b"stream":
            values = [b for _, fields in conn.xrange(key) or [] for kv in (fields or {}).items() for b in kv]
        out.append(_bytes(key))
        for v in map(_bytes, values):
            out.append(v)
            try:
                out.append(zlib.decompress(v))
            except zlib.error:
                pass
    return b"\n".join(out)


def test_secrets_stay_out_of_output_logs_rejects_and_redis(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, password=SECRET)
    server.start()
    try:
        env = {"REDIS_URL": server.url}
        conn = redis.Redis.from_url(server.url)
        records: list[object] = [sharegpt(i) for i in range(20)]
        data = write_jsonl(tmp_path / "leak.jsonl", [*records, {"bad": 1}])
        rejects = tmp_path / "leak.rejects.jsonl"
        refused = cli("producer", "-vv", "enqueue", str(data), "--output", f"s3://{S3_KEY_ID}:{S3_SECRET}@bucket/p",
                      "--rejects", str(rejects), env=env, check=False)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
        assert "credentials" in refused.stderr and "AWS_ACCESS_KEY_ID" in refused.stderr
        assert conn.dbsize() == 0 and not rejects.exists()
        wrong = cli("producer", "-vv", "enqueue", str(data), "--rejects", str(rejects),
                    env={"REDIS_URL": server.url.replace(SECRET, "x" + SECRET)}, check=False)
        assert wrong.returncode != 0 and "Traceback" not in wrong.stderr
        accepted = cli("producer", "-vv", "enqueue", str(data), "--output", "s3://bucket/p", "--rejects", str(rejects),
                       "--sampling-json", '{"top_k": 20}', "--no-output-check", env=env)  # no S3 server here
        assert "enqueued" in accepted.stdout and rejects.exists()
        stored = every_value(conn)
        assert b"s3://bucket/p" in stored  # the search does see the settings
        text = "".join(p.stdout + p.stderr for p in (refused, wrong, accepted)) + rejects.read_text()
        for secret in (SECRET, S3_SECRET, S3_KEY_ID):
            assert secret not in text
            assert secret.encode() not in stored
    finally:
        server.stop()
