"""Every command's --help and the README agree, so neither can drift from the other.

For each command, the README section that documents it names every option its --help lists,
every choice of an option with fixed choices, and no option the command does not have (in the
section's option table). Plus the small truths of `consumer dashboard`: -h works, its --help
names the Redis default genqueue really uses, and its normal start is not logged as an error.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import click
import pytest

from genqueue.consumer.cli import main as consumer_main
from genqueue.producer.cli import main as producer_main
from tests.conftest import BIN, cli, free_port

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()

#: command -> the heading of the README section (with its subsections) that documents it
SECTIONS: dict[tuple[str, str], str] = {
    ("producer", "enqueue"): "## `producer enqueue PATH`",
    ("producer", "export"): "## `producer export`",
    ("producer", "status"): "## `producer status`",
    ("producer", "runs"): "## Runs: `producer runs`, `producer resume`, `producer delete`",
    ("producer", "resume"): "## Runs: `producer runs`, `producer resume`, `producer delete`",
    ("producer", "delete"): "## Runs: `producer runs`, `producer resume`, `producer delete`",
    ("consumer", "run"): "## `consumer run`",
    ("consumer", "launch"): "## `consumer launch`: one command per node",
    ("consumer", "simulate"): "## The stand-in vLLM: `consumer simulate`",
}
#: options every command shares, documented once (Install, Redis connections, Environment variables)
SHARED = {"--help", "--redis-url", "--verbose", "--quiet"}
GROUPS = {"producer": producer_main, "consumer": consumer_main}


def section(heading: str) -> str:
    """The README's text from HEADING to the next heading of the same level."""
    start = README.index(heading + "\n")
    level = heading.split(" ", 1)[0]
    rest = README[start + len(heading):]
    end = re.search(rf"^{level} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def command(group: str, name: str) -> click.Command:
    grp = GROUPS[group]
    assert isinstance(grp, click.Group)
    cmd = grp.commands[name]
    return cmd


def long_options(cmd: click.Command) -> dict[str, click.Option]:
    found: dict[str, click.Option] = {}
    for param in cmd.params:
        if isinstance(param, click.Option):
            for opt in [*param.opts, *param.secondary_opts]:
                if opt.startswith("--"):
                    found[opt] = param
    return found


def mentions(text: str, opt: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text) is not None


@pytest.mark.parametrize(("group", "name"), list(SECTIONS), ids=[f"{g} {n}" for g, n in SECTIONS])
def test_the_readme_names_every_option_of_the_command(group: str, name: str) -> None:
    text = section(SECTIONS[(group, name)])
    options = long_options(command(group, name))
    missing = sorted(o for o in options if o not in SHARED and not mentions(text, o))
    assert not missing, f"{group} {name}: options in --help that its README section does not name: {missing}"


@pytest.mark.parametrize(("group", "name"), list(SECTIONS), ids=[f"{g} {n}" for g, n in SECTIONS])
def test_the_readme_lists_every_choice_of_an_option(group: str, name: str) -> None:
    text = section(SECTIONS[(group, name)])
    for opt, param in long_options(command(group, name)).items():
        if isinstance(param.type, click.Choice) and opt == param.opts[-1]:
            absent = [c for c in param.type.choices if f"`{c}`" not in text and not re.search(
                rf"{re.escape(opt)}[ =][^\n]*\b{re.escape(str(c))}\b", text)]
            assert not absent, f"{group} {name} {opt}: choices the README does not list: {absent}"


@pytest.mark.parametrize(("group", "name"), list(SECTIONS), ids=[f"{g} {n}" for g, n in SECTIONS])
def test_the_readme_documents_no_option_the_command_lacks(group: str, name: str) -> None:
    text = section(SECTIONS[(group, name)])
    known = set(long_options(command(group, name)))
    # a README line naming this very command: the synopsis and option-table rows of the section
    tables = [line for line in text.splitlines() if line.startswith("| `--")]
    synopsis = [line for line in text.splitlines() if line.startswith(f"{group} {name} ")]
    named = {o for line in tables for o in re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1])}
    named |= {o for line in synopsis for o in re.findall(r"(?<![\w-])(--[a-z0-9-]+)", line.split("#")[0].split(" -- ")[0])}
    unknown = sorted(named - known - SHARED)
    assert not unknown, f"{group} {name}: the README documents options it does not have: {unknown}"


def test_the_checks_above_can_fail() -> None:
    """The checks read real text: an option the README never names is found missing."""
    assert not mentions(section(SECTIONS[("producer", "status")]), "--no-such-option")
    assert mentions("`--run NAME`", "--run") and not mentions("--run-name", "--run")


def test_dashboard_takes_h_and_names_the_redis_default_it_uses() -> None:
    short = cli("consumer", "dashboard", "-h", env={"REDIS_URL": "redis://:secret@example:6390/0"})
    assert "Usage: consumer dashboard" in short.stdout
    help_text = " ".join(short.stdout.split())
    assert "Default: $REDIS_URL (now redis://***@example:6390/0)" in help_text
    assert "secret" not in short.stdout + short.stderr
    assert "Default: redis://127.0.0.1:6379" not in help_text


def test_dashboard_start_is_not_an_error(redis_url: str) -> None:
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url}
    proc = subprocess.Popen([str(BIN / "consumer"), "dashboard", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        seen = ""
        assert proc.stdout is not None
        while "Running on" not in seen and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        assert "Running on" in seen, seen
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    line = next(x for x in seen.splitlines() if "Running on" in x)
    assert " ERROR " not in line and " INFO " in line, line
