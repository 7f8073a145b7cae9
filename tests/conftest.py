"""Shared fixtures: a real redis-server on a free port, the stand-in vLLM, CLI helpers."""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from genqueue.common.contracts import PromptMode
from tests import inproc

BIN = Path(sys.executable).parent
#: The checkout: the working directory of a command that imports its own modules (bench, scripts, tests).
ROOT = Path(__file__).resolve().parent.parent

# A suite started in the background by a non-interactive shell (`.ci/run &`) inherits SIGINT
# ignored, and so would every process it starts: Python then installs no KeyboardInterrupt, and
# the tests that press Ctrl-C (`producer status --watch`, `consumer dashboard`) wait in vain.
# A handler here is reset to the default in each child at exec, where Python installs its own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The consumers the suite starts share one pack cache of this session's (not the user's
# ~/.cache/genqueue/packs, which a suite would fill with packs of runs that no longer exist).
if "GENQUEUE_PACK_CACHE" not in os.environ:
    os.environ["GENQUEUE_PACK_CACHE"] = tempfile.mkdtemp(prefix="gq-test-packs-")


# Hypothesis keeps no example database, and its caches go to a temporary folder: the suite
# writes nothing into the checkout (./.hypothesis would be one more folder a test run leaves).
settings.register_profile("genqueue", database=None)
settings.load_profile("genqueue")
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="gq-test-hypothesis-"))


#: What a developer's tools leave in a checkout; anything else a test run adds there is a test
#: writing into the checkout (tests/conftest.py's working folder is where they should write).
_DEV_LEFTOVERS = (".venv", ".mypy_cache/", ".ruff_cache/", "genqueue.egg-info/", "__pycache__/")

def _checkout_leftovers() -> set[str] | None:
    """Untracked and ignored paths in the checkout (ignored folders as one entry), less the
    developer's own tools'; None outside a git checkout."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--ignored=matching", "--untracked-files=normal"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    paths = {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")}
    return {p for p in paths if not any(p.startswith(d) or f"/{d}" in p for d in _DEV_LEFTOVERS)}


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        session.config.stash[_LEFTOVERS] = _checkout_leftovers()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that wrote into the checkout fails, naming what it wrote (tests are isolated: their
    files go to tmp paths, so the suite runs in parallel and a second run finds nothing)."""
    before = session.config.stash.get(_LEFTOVERS, None)
    after = _checkout_leftovers() if before is not None else None
    if before is None or after is None:
        return
    new = sorted(after - before)
    if new:
        session.config.get_terminal_writer().line(
            f"\nerror: the test run wrote into the checkout: {', '.join(new)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_LEFTOVERS = pytest.StashKey[set[str] | None]()


#: Fixtures shared across tests that cost nothing to make again on another xdist worker.
_CHEAP_SHARED = frozenset({"redis_server"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share an expensive fixture (a stand-in run made once a module or a session, a
    Prometheus, a compose file) run on one xdist worker (`--dist loadgroup`, as scripts/test
    runs them): spread over several, each worker would make the fixture again."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        group = None
        for name, defs in info.name2fixturedefs.items():
            for fdef in defs:
                if name in _CHEAP_SHARED or not fdef.baseid.startswith("tests"):
                    continue
                if fdef.scope == "session":
                    group = f"session-{name}"
                elif fdef.scope in ("module", "package") and group is None:
                    group = f"module-{item.nodeid.split('::')[0]}"
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker with --dist loadgroup, xdist has suffixed each grouped test's id with
    its group by now (that suffix is how the controller schedules groups). pytest 9.2 keeps ids
    where xdist 3.8 no longer writes (pytest-xdist #1386): nothing failed, every group was
    spread over every worker and the trainers' session run was made on each. Say so, loudly."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid.rsplit("]", 1)[-1]]
    if lost:
        msg = (f"pytest-xdist's --dist loadgroup does not group with this pytest ({len(lost)} tests lost their "
               f"group, e.g. {lost[0]}): pytest 9.2 and xdist 3.8 disagree on node ids (pytest-xdist #1386); "
               "pyproject.toml pins pytest below 9.2")
        os.write(2, f"\nerror: {msg}\n".encode())  # a worker's own stderr: xdist shows its exit as an INTERNALERROR
        pytest.exit(msg, returncode=pytest.ExitCode.USAGE_ERROR)


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of SIZE mounted at MNT for the block (root only: skips the test elsewhere), so a
    test can fill a real filesystem; unmounted after it."""
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def free_gpu() -> int:
    """A GPU number N whose port 8000+N is free here (the README's `consumer run --gpu N`)."""
    start = random.randrange(1, 1000)
    for n in [*range(start, 1024), *range(1, start)]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 8000 + n))
            except OSError:
                continue
        return n
    raise RuntimeError("no free port in 8001..9023")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORT_RANGE = (10_000, max(10_001, _ephemeral_low()))


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral range: a port bind(0) hands out
    comes from that range, where the outgoing connections of tests on other xdist workers take
    theirs too, so a server started on it a moment later could find it taken."""
    for _ in range(200):
        port = random.randrange(*_PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server process of the tests' own, which tests may stop and start again."""

    def __init__(self, workdir: Path, *, appendonly: bool = False, password: str | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.appendonly = appendonly
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.025)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def kill(self) -> None:
        """A crash: SIGKILL, nothing saved at exit (what start() loads is the last dump.rdb)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in its own folder, and so does every command it starts without a cwd of
    its own: what a command writes by default (./genqueue-out, where a run's first enqueue writes
    its run.json; ./genqueue-spool; a rejects file) lands there, never in the checkout nor where
    another test reads it. A command that imports the checkout's own modules (bench, scripts,
    tests) is given cwd=ROOT."""
    monkeypatch.chdir(tmp_path)


#: Every background process tests.consumer.e2e.Proc started (stand-ins, consumers): the ones a
#: test leaves running are killed after it (_no_leftover_processes).
LIVE_PROCS: list[Any] = []  # strong references: a test's local Sim is gone before its teardown


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    """A test that fails before its own cleanup (a stand-in that did not start, an assertion
    between a consumer's start and its stop) left the process running for the rest of the run,
    taking CPU from the tests after it: a loaded run of the suite kept six such for 20 minutes.
    What a test started is killed when it ends; what a module's or session's fixture started (it
    was running before the test) is left to that fixture."""
    before = {id(p) for p in LIVE_PROCS}
    yield
    for proc in LIVE_PROCS:
        if id(proc) not in before and proc.p.poll() is None:
            proc.kill()
    LIVE_PROCS[:] = [p for p in LIVE_PROCS if p.p.poll() is None]  # the ended ones are let go


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture
def conn(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def cli(name: str, *args: str, env: dict[str, str] | None = None, check: bool = True, timeout: float = 120,
        input: bytes | None = None, cwd: Path | None = None, subprocess_: bool = False) -> subprocess.CompletedProcess[str]:
    """Run a genqueue command as a user runs it, in CWD (default: this process's). A `producer`
    command runs in this process, isolated as a fresh process (tests/inproc.py: a subprocess costs
    ~0.3 s of CPU to start); every other command, and any with SUBPROCESS_ (a test about the
    process itself: signals, a terminal, a timeout that must stop it) or while
    GENQUEUE_TEST_CLI=subprocess, is a subprocess of the installed script."""
    if inproc.wanted(name, subprocess_, env):
        proc = inproc.run(name, args, env=env, timeout=timeout, input=input, cwd=cwd)
    else:
        exe = BIN / name
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", name]
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.run([*cmd, *args], check=False, capture_output=True, timeout=timeout, env=full_env, cwd=cwd,
                              input=input.decode() if input is not None else None, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def http_text(url: str, timeout: float) -> str | None:
    """The body at URL, or None when it cannot be read whole: refused, timed out, or cut off
    (a process that ends while it answers leaves headers without their body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode()
    except (OSError, http.client.HTTPException):
        return None


def wait_for(pred: Callable[[], object], timeout: float, what: str, *, every: float = 0.1) -> None:
    """Poll PRED until it is true; AssertionError naming WHAT after TIMEOUT seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def sharegpt(i: int, turns: int = 1, system: str | None = None) -> dict[str, object]:
    conv: list[dict[str, str]] = []
    for t in range(turns):
        conv.append({"from": "human", "value": f"question {i} turn {t}: explain item {i * 7 + t}"})
        conv.append({"from": "gpt", "value": f"old answer {i}.{t}"})
    rec: dict[str, object] = {"id": f"r{i}", "conversations": conv}
    if system is not None:
        rec["system"] = system
    return rec


@dataclass(frozen=True)
class Prompts:
    """Where a test's enqueue puts the items (issue 34: every fault test passes in both modes):
    ARGS go to `producer enqueue`; the mode is named explicitly, whatever the default is."""

    mode: PromptMode

    @property
    def args(self) -> tuple[str, ...]:
        return ("--prompts", self.mode.value)

    @property
    def by_reference(self) -> bool:
        return self.mode is PromptMode.REFERENCE

    def __str__(self) -> str:
        return self.mode.value


INLINE, BY_REFERENCE = Prompts(PromptMode.INLINE), Prompts(PromptMode.REFERENCE)


@pytest.fixture(params=[INLINE, BY_REFERENCE], ids=str)
def prompts_mode(request: pytest.FixtureRequest) -> Prompts:
    """Both modes, for a test quick enough to run twice in the default suite."""
    mode: Prompts = request.param
    return mode


#: Both modes, the by-reference variant in the slow tier (`scripts/test -m slow`): for a test that
#: takes more than a few seconds, so the default suite stays as long as it is.
both_modes_reference_slow = pytest.mark.parametrize(
    "prompts_mode", [INLINE, pytest.param(BY_REFERENCE, marks=pytest.mark.slow)], ids=str)


def items_of_job(conn: redis.Redis, run: str, output: str | Path, job: Any, packs: Any = None) -> list[dict[str, Any]]:
    """The items of rq JOB of RUN in either mode: its argument inline, its block of its pack in
    the run's OUTPUT by reference (read as the producer's readers read it; PACKS, a PackItems of
    the run, to keep its indexes over many jobs)."""
    from genqueue.common.keepers.rqaccess import job_items, job_reference
    from genqueue.producer.packitems import PackItems

    ref = job_reference(job.args, job.kwargs, job.meta)
    if ref is None:
        return [dict(it) for it in job_items(job.args)]
    items = (packs if packs is not None else PackItems(conn, run, str(output))).items_of(ref)
    return [dict(it) for it in items]
