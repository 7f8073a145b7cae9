"""Every command's --help and its documentation agree, so neither can drift from the other.

docs/cli.md is generated from the click commands (scripts/cli_docs.py) and must be what the
generator makes from the code now. For each command, the page that explains it in depth names
every option its --help lists, every choice of an option with fixed choices, and no option the
command does not have (in the section's option table). Every command line written anywhere in
the README or docs/ (code blocks and inline code) uses only options its command has. Plus the
small truths of `consumer dashboard`: -h works, its --help names the Redis default genqueue
really uses, and its normal start is not logged as an error.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from genqueue.consumer.cli import main as consumer_main
from genqueue.producer.cli import main as producer_main
from scripts import cli_docs
from tests.conftest import BIN, cli, free_port

ROOT = Path(__file__).resolve().parent.parent
#: every page a user reads: the README (the guide) and docs/ (the reference)
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text() for path in [ROOT / "README.md",
                                                                        *sorted((ROOT / "docs").glob("*.md"))]}

#: command -> (the page, the heading of its section, with its subsections) that explains it
SECTIONS: dict[tuple[str, str], tuple[str, str]] = {
    ("producer", "enqueue"): ("docs/enqueue.md", "## `producer enqueue PATH`"),
    ("producer", "capture"): ("docs/enqueue.md", "## `producer capture`: a capture pass over a finished run"),
    ("producer", "export"): ("docs/export.md", "## `producer export`"),
    ("producer", "export-features"): ("docs/export.md", "## `producer export-features`"),
    ("producer", "export-logprobs"): ("docs/export.md", "## `producer export-logprobs`"),
    ("producer", "check-features"): ("docs/export.md", "## `producer check-features`"),
    ("producer", "parity"): ("docs/export.md", "## `producer parity`"),
    ("producer", "status"): ("docs/operations.md", "## `producer status`"),
    ("producer", "drafter-report"): ("docs/operations.md", "## `producer drafter-report`"),
    ("producer", "runs"): ("README.md", "## 7. Recover"),
    ("producer", "resume"): ("README.md", "## 7. Recover"),
    ("producer", "delete"): ("README.md", "## 7. Recover"),
    ("consumer", "run"): ("docs/consumer.md", "## `consumer run`"),
    ("consumer", "launch"): ("docs/consumer.md", "## `consumer launch`: one command per node"),
    ("consumer", "simulate"): ("docs/consumer.md", "## The stand-in vLLM: `consumer simulate`"),
}
#: options every command shares, documented once (docs/cli.md's head, docs/environment.md)
SHARED = {"--help", "--redis-url", "--verbose", "--quiet"}
GROUPS = {"producer": producer_main, "consumer": consumer_main}


def section(where: tuple[str, str]) -> str:
    """The page's text from the heading to the next heading of the same level."""
    page, heading = where
    text = PAGES[page]
    start = text.index(heading + "\n")
    level = heading.split(" ", 1)[0]
    rest = text[start + len(heading):]
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
    assert not missing, f"{group} {name}: options in --help that its section does not name: {missing}"


@pytest.mark.parametrize(("group", "name"), list(SECTIONS), ids=[f"{g} {n}" for g, n in SECTIONS])
def test_the_readme_lists_every_choice_of_an_option(group: str, name: str) -> None:
    text = section(SECTIONS[(group, name)])
    for opt, param in long_options(command(group, name)).items():
        if isinstance(param.type, click.Choice) and opt == param.opts[-1]:
            absent = [c for c in param.type.choices if f"`{c}`" not in text and not re.search(
                rf"{re.escape(opt)}[ =][^\n]*\b{re.escape(str(c))}\b", text)]
            assert not absent, f"{group} {name} {opt}: choices its section does not list: {absent}"


@pytest.mark.parametrize(("group", "name"), list(SECTIONS), ids=[f"{g} {n}" for g, n in SECTIONS])
def test_the_readme_documents_no_option_the_command_lacks(group: str, name: str) -> None:
    text = section(SECTIONS[(group, name)])
    known = set(long_options(command(group, name)))
    # a line naming this very command: the synopsis and option-table rows of the section
    tables = [line for line in text.splitlines() if line.startswith("| `--")]
    synopsis = [line for line in text.splitlines() if line.startswith(f"{group} {name} ")]
    named = {o for line in tables for o in re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1])}
    named |= {o for line in synopsis for o in re.findall(r"(?<![\w-])(--[a-z0-9-]+)", line.split("#")[0].split(" -- ")[0])}
    unknown = sorted(named - known - SHARED)
    assert not unknown, f"{group} {name}: its section documents options it does not have: {unknown}"


def test_the_checks_above_can_fail() -> None:
    """The checks read real text: an option the docs never name is found missing."""
    assert not mentions(section(SECTIONS[("producer", "status")]), "--no-such-option")
    assert mentions("`--run NAME`", "--run") and not mentions("--run-name", "--run")
    assert unknown_options("`producer export --run data --frobnicate`") == ["producer export --frobnicate"]


def test_docs_cli_md_is_what_the_code_generates() -> None:
    """docs/cli.md is generated: a changed option, help text or default is a diff to commit."""
    # in a fresh interpreter, as `python -m scripts.cli_docs` runs: click caches a command's help
    # option from the first context that asks, and other tests here make contexts of their own
    want = subprocess.run([sys.executable, "-c", "from scripts import cli_docs; print(cli_docs.render(), end='')"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout
    have = (ROOT / "docs" / "cli.md").read_text()
    assert have == want, "docs/cli.md differs from the commands' --help: run `python -m scripts.cli_docs` and commit"


def test_docs_cli_md_lists_every_option_of_every_command() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    for group_name, group in GROUPS.items():
        assert isinstance(group, click.Group)
        for name in group.commands:
            assert f"## `{group_name} {name}`" in text, f"docs/cli.md has no section for {group_name} {name}"
            missing = [o for o in long_options(command(group_name, name)) if not mentions(text, o)]
            assert not missing, f"{group_name} {name}: options docs/cli.md does not list: {missing}"


def test_the_generator_follows_the_code() -> None:
    """A command given a new option, or a new help text, renders differently: the check can fail."""

    @click.group()
    def grp() -> None:
        """A group."""

    @grp.command("go")
    @click.option("--frobnicate", type=click.Choice(["a", "b"]), default="a", show_default=True,
                  envvar="GQ_TEST_FROB", show_envvar=True, help="Frobnicates.")
    def go(frobnicate: str) -> None:
        """Goes."""

    text = cli_docs.render({"tool": grp})
    assert "## `tool go`" in text and "Goes." in text
    row = next(line for line in text.splitlines() if "--frobnicate" in line)
    assert "Frobnicates." in row and "a\\|b" in row and "GQ_TEST_FROB" in row and "default: a" in row
    go.params[0].help = "Frobnicates twice."
    assert cli_docs.render({"tool": grp}) != text


def command_lines(text: str) -> list[str]:
    """Every command a page writes as code: lines of fenced and indented blocks, and inline spans."""
    found: list[str] = []
    prose: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            found.append(line.strip())
        else:
            prose.append(line)
    found += re.findall(r"`([^`]+)`", " ".join(prose))
    return found


def unknown_options(text: str) -> list[str]:
    """`group command --option` for every long option TEXT's command lines give a command that
    lacks it. Values of options that take one are skipped (`--consumer-args '--shared-fs'`),
    and so is what follows ` -- ` (the engine's arguments) or a shell separator."""
    bad: list[str] = []
    for line in command_lines(text):
        for m in re.finditer(r"(?<![\w/-])(producer|consumer) ([a-z]+(?:-[a-z]+)*)(?![\w-])", line):
            group_name, name = m[1], m[2]
            grp = GROUPS[group_name]
            assert isinstance(grp, click.Group)
            if name not in grp.commands or name == "dashboard":  # dashboard passes rq-dashboard's options on
                continue
            options = long_options(command(group_name, name))
            rest = line[m.end():]
            try:
                tokens = shlex.split(rest, comments=True)
            except ValueError:
                tokens = rest.split()
            i = 0
            while i < len(tokens):
                token = tokens[i].strip("[]()`,;.")
                i += 1
                if tokens[i - 1] in ("--", "|", "&&", ";", "&", "#") or token in ("producer", "consumer"):
                    break
                if not token.startswith("--") or token == "--":
                    continue
                opt = token.split("=", 1)[0]
                if opt not in options and opt not in SHARED:
                    bad.append(f"{group_name} {name} {opt}")
                elif opt in options and "=" not in token and not options[opt].is_flag and not options[opt].count:
                    i += 1
    return bad


@pytest.mark.parametrize("page", list(PAGES))
def test_every_command_line_uses_only_options_its_command_has(page: str) -> None:
    bad = unknown_options(PAGES[page])
    assert not bad, f"{page} writes options these commands do not have: {sorted(set(bad))}"


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
