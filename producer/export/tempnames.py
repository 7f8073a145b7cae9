"""The names export writes under before a finished file is renamed into place.

A temporary name beside a file is one no user file can hold: hidden, genqueue's prefix, the
writing process's id and a random part, then the file's own name (so its suffix, .gz, .zst or
.parquet, still says how it is written). A name such as `mydata.jsonl.tmp` is a user's to
have: written to and renamed away, it would be lost. An export killed before it could remove
its temporary files leaves them hidden and under names no later export writes to; the next
export into that folder removes those of the same file whose process is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

__all__ = ["PREFIX", "sweep_dead", "temp_beside"]

#: What every temporary name starts with.
PREFIX = ".gq-tmp-"
_NAME = re.compile(re.escape(PREFIX) + r"(?P<pid>[0-9]+)-[0-9a-f]{8}-(?P<name>.+)\Z", re.DOTALL)


def temp_beside(path: Path) -> Path:
    """A fresh temporary name in PATH's folder for PATH's content (see the module docstring)."""
    return path.with_name(f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def sweep_dead(paths: list[Path]) -> list[Path]:
    """Remove the temporary files of PATHS that an export no longer running left beside them
    (killed before it could); returns those removed. Only names of this module's shape for the
    same file are looked at, and a process still running keeps its own."""
    removed: list[Path] = []
    for folder, names in _by_folder(paths).items():
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for entry in entries:
            m = _NAME.match(entry)
            if m is None or m["name"] not in names or _alive(int(m["pid"])):
                continue
            with contextlib.suppress(OSError):
                (folder / entry).unlink()
                removed.append(folder / entry)
    return removed


def _by_folder(paths: list[Path]) -> dict[Path, set[str]]:
    out: dict[Path, set[str]] = {}
    for p in paths:
        out.setdefault(p.parent, set()).add(p.name)
    return out
