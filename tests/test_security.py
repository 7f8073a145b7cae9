"""Redis with a password and over TLS works for every command, and secrets never show."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import cli, free_port, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = pytest.mark.integration

SECRET = "s3cret-Pa55word"


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=genqueue-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(crt),
        "-days", "2", "-extfile", str(ext))
    return ca, crt, key


@pytest.fixture
def tls_redis(tmp_path):
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


def test_every_command_over_tls_with_a_password_and_no_secret_leaks(tmp_path, tls_redis):
    env = {"REDIS_URL": tls_redis}
    data = write_jsonl(tmp_path / "sec.jsonl", [sharegpt(i) for i in range(30)])
    outputs = []
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
