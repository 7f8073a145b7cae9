"""docs/cli.md, generated from the click commands themselves, so the option reference cannot drift.

    python -m scripts.cli_docs           # rewrite docs/cli.md from the code
    python -m scripts.cli_docs --check   # exit 1 when docs/cli.md differs from what the code makes

Each command gets its usage line, its docstring and a table of its options as its --help lists
them (names, value, help, default, environment variable, choices). tests/test_cli_docs.py fails
when docs/cli.md is not what this produces, so a new option, a changed help text or default,
or a removed command shows up as a diff to commit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "cli.md"

HEADER = """\
# Command reference

Generated from the code by `python -m scripts.cli_docs` (do not edit by hand: tests/test_cli_docs.py
fails when this page and the commands' `--help` differ). Each command also answers `-h`/`--help`.
The guide is [the README](../README.md); what the options do, in depth: [enqueue](enqueue.md),
[consumer](consumer.md), [export](export.md), [operations](operations.md).

Options commands share (`--redis-url/-u`, read from `$REDIS_URL` as rq's own tools do; `-v`, `-q`)
are listed under each command that takes them, and the groups' own `-v` goes before the command
name (`producer -v enqueue ...`). Environment variables: [environment](environment.md).
"""


@contextmanager
def clean_environment() -> Iterator[None]:
    """No REDIS_URL, GENQUEUE_* or RQ_DASHBOARD_* while rendering: --help may show them."""
    saved = {k: v for k, v in os.environ.items()
             if k == "REDIS_URL" or k.startswith(("GENQUEUE_", "RQ_DASHBOARD_"))}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def cell(text: str) -> str:
    """TEXT as one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def render_command(group: click.Group, group_name: str, name: str) -> list[str]:
    cmd = group.commands[name]
    # each with its own context_settings, as click's make_context gives them (`-h` among them)
    parent = click.Context(group, info_name=group_name, terminal_width=100, max_content_width=100,
                           **group.context_settings)
    ctx = click.Context(cmd, info_name=name, parent=parent, terminal_width=100, max_content_width=100,
                        **cmd.context_settings)
    lines = [f"## `{group_name} {name}`", "", "```", cmd.get_usage(ctx), "```", ""]
    doc = (cmd.help or cmd.short_help or "").split("\f")[0].strip()
    for paragraph in doc.split("\n\n"):
        if paragraph.strip():
            lines += [" ".join(paragraph.replace("\b", "").split()), ""]
    rows = []
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
        if record is None:
            continue
        opts, help_text = record
        rows.append(f"| `{cell(opts)}` | {cell(help_text)} |")
    if rows:
        lines += ["| option | help |", "|---|---|", *rows, ""]
    return lines


def groups() -> dict[str, click.Group]:
    from genqueue.consumer.cli import main as consumer_main
    from genqueue.producer.cli import main as producer_main

    found = {"producer": producer_main, "consumer": consumer_main}
    for name, grp in found.items():
        assert isinstance(grp, click.Group), name
    return {k: v for k, v in found.items() if isinstance(v, click.Group)}


def render(command_groups: Mapping[str, click.Group] | None = None) -> str:
    """The whole of docs/cli.md as the code makes it now (or as COMMAND_GROUPS would)."""
    with clean_environment():
        lines = HEADER.splitlines() + [""]
        for group_name, group in (groups() if command_groups is None else command_groups).items():
            ctx = click.Context(group, info_name=group_name, terminal_width=100, max_content_width=100)
            lines += [f"# `{group_name}`", "", cell(group.help or ""), "", "```", group.get_usage(ctx), "```", ""]
            for name in sorted(group.commands):
                lines += render_command(group, group_name, name)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv == ["--check"]:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET.relative_to(ROOT)} differs from the code: run python -m scripts.cli_docs", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    TARGET.parent.mkdir(exist_ok=True)
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
