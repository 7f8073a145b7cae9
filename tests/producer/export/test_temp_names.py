"""Export's temporary names are no user's: a `<file>.tmp` of the user's beside an export's file
survives the export byte for byte, and the hidden temporary files a killed export left are
removed by the next export of the same file, never another's nor a live one's.

The run is test_user_files.py's: a real `producer enqueue` (real Redis, the CLI as a user runs
it) whose every item is shipped by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from genqueue.producer.export import cardplots
from genqueue.producer.export.tempnames import PREFIX, sweep_dead, temp_beside
from tests.producer.export.test_user_files import N, export, run

__all__ = ["run"]  # the fixture, imported for the tests below

pytestmark = pytest.mark.integration

#: Every file a sharegpt export with its card writes beside ds.jsonl.
WRITTEN = ["ds.jsonl", "ds.errors.jsonl", "ds.truncated.jsonl", "ds.missing.txt", "ds.dataset_info.json", "README.md"]
PICTURES = ["ds.lengths.png", "ds.generations.png"]


def dead_pid() -> int:
    """The id of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_users_tmp_files_survive_an_export_byte_for_byte(run: Path, redis_url: str) -> None:
    """Old: `ds.jsonl.tmp` (and README.md.tmp, ds.lengths.png.tmp, ...) of the user's was written
    over and renamed into ds.jsonl: gone, exit 0. New: each is left as it was; the export writes
    its files under hidden names of its own and leaves none behind."""
    tmp = run.parent
    names = WRITTEN + (PICTURES if cardplots.available() else [])
    mine = {f"{name}.tmp": f"my own {name}.tmp, keep me\n".encode() for name in names}
    for name, body in mine.items():
        (tmp / name).write_bytes(body)
    proc = export(tmp, redis_url, "-o", "ds.jsonl", "--format", "sharegpt")
    assert proc.returncode == 0, proc.stderr
    for name, body in mine.items():
        assert (tmp / name).read_bytes() == body, name
    assert len((tmp / "ds.jsonl").read_bytes().splitlines()) == N
    for name in names:
        assert (tmp / name).is_file(), name
    assert not [p for p in os.listdir(tmp) if p.startswith(PREFIX)]


def test_a_killed_exports_leftovers_are_removed_by_the_next(run: Path, redis_url: str) -> None:
    """What an export killed mid-write leaves (hidden, under its pid) is removed by the next
    export of the same file; a live process's, another file's and a user's look-alike stay."""
    tmp = run.parent
    gone = dead_pid()
    left = [tmp / f"{PREFIX}{gone}-0123abcd-{name}" for name in ("ds.jsonl", "ds.errors.jsonl", "README.md")]
    live = tmp / f"{PREFIX}{os.getppid()}-0123abcd-ds.jsonl"  # pytest's parent: running
    other = tmp / f"{PREFIX}{gone}-0123abcd-other.jsonl"
    looks = tmp / f"{PREFIX}{gone}-nothex00-ds.jsonl"
    for p in [*left, live, other, looks]:
        p.write_bytes(b"half a file")
    proc = export(tmp, redis_url, "-o", "ds.jsonl")
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in left if p.exists()] == []
    assert live.exists() and other.exists() and looks.exists()


def test_temp_names_are_fresh_hidden_and_keep_the_suffix(tmp_path: Path) -> None:
    out = tmp_path / "ds.jsonl.zst"
    a, b = temp_beside(out), temp_beside(out)
    assert a != b and a.parent == tmp_path and a.name.startswith(".") and a.name.endswith("-ds.jsonl.zst")
    assert str(os.getpid()) in a.name
    a.write_bytes(b"mine, running")
    assert sweep_dead([out]) == [] and a.exists()  # this process is alive
