"""docs/operations.md's rq section, as a user runs it: rq's own tools on genqueue queues (its
lines run verbatim by bash), the dashboard's install line (from a checkout and from a wheel),
and the small truths: every environment variable an option reads is in the --help of that
option and paired with it in docs/environment.md (tests/test_docs_reference.py checks the page
against every variable the code reads)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import click
import pytest

from genqueue.common.keepers.rqaccess import queue_for
from genqueue.consumer.cli import main as consumer_main
from genqueue.consumer.rqcompat import GenWorker
from genqueue.producer.cli import main as producer_main
from tests.conftest import BIN, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys

ROOT = Path(__file__).resolve().parent.parent
OPERATIONS = ROOT / "docs" / "operations.md"
ENVIRONMENT = ROOT / "docs" / "environment.md"
INSTALL_LINE = "pip install -e '.[dashboard]'"


def operations_block() -> list[str]:
    """The command lines (comments dropped) of docs/operations.md's rq code block."""
    text = OPERATIONS.read_text()
    section = text[text.index("## Operating with rq's own tools"):]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line]


def readme_line(prefix: str) -> str:
    found = [line for line in operations_block() if line.startswith(prefix)]
    assert len(found) == 1, f"docs/operations.md's rq block should show one `{prefix}` line: {found}"
    return found[0]


def run_as_written(line: str, redis_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": redis_url, "PATH": f"{BIN}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.integration
def test_requeue_failures_with_rq_then_resume_and_empty(tmp_path, redis_url, conn):
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "data.jsonl", [sharegpt(i) for i in range(40)])
    cli("producer", "enqueue", str(data), "--batch-size", "10", "--output", str(tmp_path / "out"),
        "--rejects", str(tmp_path / "r"), env=env)
    q = queue_for("data", conn)
    # a job that failed for good (say, its retries were spent while consumers kept dying)
    w = GenWorker([q], conn, lease=30)
    w.start()
    held, _ = w.dequeue(q)
    w.fail(held, "gave up", retry=False)
    w.stop()
    assert q.failed_job_registry.get_job_ids() == [held.id]
    info = run_as_written(readme_line("rq info"), redis_url).stdout
    assert "genqueue.data" in info
    # docs/operations.md: rq requeue with the JSON serializer puts it back
    run_as_written(readme_line("rq requeue"), redis_url)
    assert q.failed_job_registry.count == 0 and held.id in q.job_ids
    # resume: every consumer had stopped; starting one again is all it takes
    sim = Sim(tmp_path, "--mean-tokens", "10")
    try:
        c = Proc("consumer", ["run", "--run", "data", "--endpoint", sim.url, "--burst", "--spool", str(tmp_path / "s")],
                 tmp_path / "c.log", env=env)
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    assert {r["key"] for r in read_results(tmp_path / "out", "data")} == run_keys(conn, "data")
    # docs/operations.md: emptying a queue drops what is queued
    more = write_jsonl(tmp_path / "more.jsonl", [sharegpt(i) for i in range(100, 140)])
    cli("producer", "enqueue", str(more), "--run", "data", "--batch-size", "10", "--output", str(tmp_path / "out"),
        "--rejects", str(tmp_path / "r2"), env=env)
    assert q.count == 4
    run_as_written(readme_line("rq empty"), redis_url)
    assert q.count == 0


def dashboard_requirements(requires_dist: list[str]) -> set[str]:
    """Names required by the `dashboard` extra, from Requires-Dist lines."""
    names = set()
    for req in requires_dist:
        if re.search(r"""extra\s*==\s*["']dashboard["']""", req):
            names.add(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower())
    return names


@pytest.mark.slow  # pip resolves every dependency: ~30 CPU-s, on a 2-core machine whose default tier is CPU-bound
def test_dashboard_install_line_from_a_checkout(tmp_path):
    line = readme_line("pip install")
    assert line == INSTALL_LINE, "the dashboard's install line must work from a checkout (genqueue is on no index)"
    assert any(x.startswith("consumer dashboard") for x in operations_block()), "and say how to start it"
    report = tmp_path / "report.json"
    argv = [*shlex.split(line), "--dry-run", "--quiet", "--disable-pip-version-check", "--report", str(report)]
    done = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    (me,) = [i for i in json.loads(report.read_text())["install"] if i["metadata"]["name"] == "genqueue"]
    # rq-dashboard 0.9 imports six without declaring it
    assert {"rq-dashboard", "six"} <= dashboard_requirements(me["metadata"]["requires_dist"])


@pytest.mark.slow  # builds the wheel and resolves it with pip: ~30 CPU-s
def test_the_wheel_carries_the_dashboard_extra_and_command(tmp_path):
    # built from what the Dockerfile copies, in a scratch folder (setuptools writes build/ beside the sources)
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("common", "producer", "consumer"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    shutil.copytree(ROOT / "genqueue", src / "genqueue", symlinks=True, ignore=skip)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--disable-pip-version-check",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("genqueue-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
    assert "genqueue/consumer/dashboard/command.py" in names and "genqueue/consumer/launch/command.py" in names
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert {"rq-dashboard", "six"} <= dashboard_requirements(requires)
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
                           "--report", str(report), f"{wheel}[dashboard]"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr


# --- small truths --------------------------------------------------------------------------
def commands(group: click.Command, path: str) -> list[tuple[str, click.Command]]:
    out = [(path, group)]
    if isinstance(group, click.Group):
        for name, sub in group.commands.items():
            out += commands(sub, f"{path} {name}")
    return out


def environment_options() -> list[tuple[str, click.Command, click.Option, str]]:
    found = []
    for root, name in ((producer_main, "producer"), (consumer_main, "consumer")):
        for path, cmd in commands(root, name):
            for param in cmd.params:
                if isinstance(param, click.Option) and param.envvar:
                    envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
                    found += [(path, cmd, param, e) for e in envvars]
    return found


def test_every_environment_variable_is_in_the_help_of_its_option():
    options = environment_options()
    assert {e for *_, e in options} >= {"REDIS_URL", "GENQUEUE_OUTPUT", "GENQUEUE_ENDPOINT", "GENQUEUE_METRICS_PORT",
                                        "GENQUEUE_GPUS", "GENQUEUE_MODEL", "GENQUEUE_VLLM_CMD",
                                        "GENQUEUE_METRICS_BASE_PORT"}
    silent = []
    for path, cmd, param, envvar in options:
        with click.Context(cmd, info_name=path) as ctx:
            record = param.get_help_record(ctx)
        if record is None or envvar not in " ".join(record):
            silent.append(f"{path} {param.opts[0]}: {envvar}")
    assert not silent, "options whose --help does not name their environment variable:\n" + "\n".join(silent)


def test_every_option_with_a_variable_is_in_docs_environment_md():
    """docs/environment.md's table of variables with an option names each option that reads one
    (`group command --option` in the row of its variable), and no option that reads none."""
    text = ENVIRONMENT.read_text()
    table = text[text.index("## With an option"):text.index("## Without an option")]
    rows = {m[0]: m[1] for m in re.findall(r"^\| `([A-Z_]+)` \| (.*) \|$", table, re.MULTILINE)}
    missing = []
    for path, _cmd, param, envvar in environment_options():
        if envvar == "REDIS_URL":
            assert "--redis-url" in rows.get("REDIS_URL", ""), "REDIS_URL's row names --redis-url"
            continue
        long_opt = next(o for o in param.opts if o.startswith("--"))
        if envvar not in rows or not re.search(rf"{re.escape(path)}[^|;]*{re.escape(long_opt)}\b", rows[envvar]):
            missing.append(f"{envvar}: {path} {long_opt}")
    assert not missing, f"options whose variable docs/environment.md does not pair with them: {missing}"
    read = {e for *_, e in environment_options()}
    assert sorted(set(rows) - read - {"GENQUEUE_OUTPUT"}) == [], "rows for variables no option reads"


def test_gitignore_covers_what_the_tools_write_by_default():
    paths = ["genqueue-spool/gpu0/x.jsonl", "genqueue-out/run/shards/x.jsonl", "demo-out/demo.jsonl",
             "genqueue-logs/engine-gpu0.log", "x.rejects.jsonl"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    assert set(done.stdout.split()) == set(paths), done.stdout + done.stderr


@pytest.mark.integration
def test_the_demo_runs_and_leaves_no_temporary_folder(tmp_path):
    venv = ROOT / ".venv"
    stamp = venv / ".genqueue-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if Path(sys.prefix) != venv or not stamp.exists() or stamp.read_text().strip() != want:
        pytest.skip("the demo runs scripts/setup first, which would reinstall .venv: run scripts/setup")
    (tmp_path / "tmp").mkdir()
    (tmp_path / "out").mkdir()  # an earlier demo's output: replaced, and said
    (tmp_path / "out" / ".made-by-genqueue-demo").touch()
    (tmp_path / "out" / "stale.jsonl").write_text("{}\n")
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "DEMO_OUT": str(tmp_path / "out")}
    done = subprocess.run([str(ROOT / "scripts" / "demo")], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"scripts/demo: removing {tmp_path / 'out'}, the output of an earlier demo" in done.stdout
    assert not (tmp_path / "out" / "stale.jsonl").exists()
    assert "== results:" in done.stdout and (tmp_path / "out" / "demo.jsonl").stat().st_size > 0
    assert (tmp_path / "out" / "demo.rejects.jsonl").exists()
    assert list((tmp_path / "tmp").iterdir()) == [], "the demo left its temporary folder behind"


def test_the_demo_refuses_a_folder_it_did_not_make_instead_of_removing_it_without_a_word(tmp_path):
    """old: `DEMO_OUT=~/results scripts/demo` removed ~/results whole, saying nothing
    new: "error: <folder> exists and was not made by scripts/demo: nothing removed; move it away, or give
         the demo another folder with DEMO_OUT=...", exit 2, before anything is installed or started"""
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "precious.jsonl").write_text("{}\n")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    for out in (mine, a_file):
        done = subprocess.run([str(ROOT / "scripts" / "demo")], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "DEMO_OUT": str(out)}, check=False)
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        assert done.stderr.splitlines() == [(f"error: {out} exists and was not made by scripts/demo: nothing removed; "
                                             "move it away, or give the demo another folder with DEMO_OUT=...")]
    assert (mine / "precious.jsonl").read_text() == "{}\n" and a_file.read_text() == "mine\n"
