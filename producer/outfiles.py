"""Files the producer writes, and the one line a failed write becomes.

A full disk (ENOSPC), a spent quota (EDQUOT), an I/O error, a read-only or forbidden place:
each ends the command with `error: ...` naming the file, what it held on disk when the write
failed, the space left there, and the option that moves it (WriteFailedError, exit 1). A place
that cannot take one block at all is refused before anything is done (`probe`: UserError,
exit 2). Writers write under a temporary name and rename into place only when complete; on a
failure the caller removes the temporary file, so nothing partial keeps a final name.
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

from genqueue.common import defaults
from genqueue.common.errors import UserError, WriteFailedError

PROBE_BYTES = defaults.OUTFILES_PROBE_BYTES

#: What a failed write means to a user, by errno.
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


@dataclass(frozen=True, slots=True)
class Target:
    """What a file is, for messages, and how to put it elsewhere."""

    what: str
    remedy: str


OUTPUT = Target("output file", "write it elsewhere with --output")
ERRORS = Target("errors file", "write it elsewhere with --errors")
TRUNCATED = Target("truncated file", "write it elsewhere with --truncated")
FLAGGED = Target("flagged file", "write it elsewhere with --flagged")
MISSING = Target("missing file", "write it elsewhere with --missing")
PARTITIONS = Target("temporary partition files", "put them elsewhere with --tmp-dir")
REJECTS = Target("rejects file", "write it elsewhere with --rejects")
OUTPUT_DIR = Target("output directory", "consumers ship their shards there too: free space, or name another "
                    "--output")
HOLD = Target("--longest-first holding files", "hold them elsewhere with --tmp-dir (or TMPDIR)")


def disk_full(e: OSError) -> bool:
    """E says the disk is full or the quota spent."""
    return e.errno in _FULL


def size_text(n: int) -> str:
    """N bytes for a person: '512 bytes', '1.2 GB (1,234,567,890 bytes)'."""
    if n < 1000:
        return f"{n:,} bytes"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"  # pragma: no cover - n >= 1000 always has a unit


def on_disk(path: Path) -> int:
    """Bytes PATH holds on disk: a file's size, or the sum of a directory's files."""
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0


def _free(path: Path) -> tuple[Path, int | None]:
    """The nearest existing directory at or above PATH, and the bytes free there."""
    d = path
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        return d, shutil.disk_usage(d).free
    except OSError:
        return d, None


def write_failed(e: OSError, path: Path, target: Target, *, written: int | None = None,
                 needed: int | None = None, room_in: Path | None = None) -> WriteFailedError:
    """The error for E, raised while writing PATH (TARGET's file, or its temporary directory):
    what PATH held when it failed (WRITTEN, else its size on disk), NEEDED when known, the
    space left in ROOM_IN (default: PATH's directory), and TARGET's remedy."""
    held = on_disk(path) if written is None else written
    where, free = _free(room_in or path.parent)
    room = "" if free is None else f", {size_text(free)} free in {where}"
    need = "" if needed is None else f" (it needs about {size_text(needed)})"
    full = _FULL.get(e.errno or 0)
    if full is not None:
        filled = "the disk filled" if e.errno == errno.ENOSPC else "the quota ran out"
        msg = f"{target.what} {path}: {full}: wrote {size_text(held)} before {filled}{need}{room}"
    else:
        msg = f"{target.what} {path}: cannot write: {e.strerror or e} after {size_text(held)}{need}{room}"
    return WriteFailedError(f"{msg}; {target.remedy}")


def probe(path: Path, target: Target, *, keep: bool = False, shown: Path | None = None,
          only_full: bool = False) -> IO[bytes] | None:
    """Create PATH and write one block to it (then empty it): a place that is read-only,
    forbidden or already full is refused (UserError, exit 2, naming SHOWN or PATH) before
    anything is done; ONLY_FULL: a full one only (other failures pass). KEEP: return PATH open
    for writing; else remove it."""
    fh: IO[bytes] | None = None
    try:
        fh = open(path, "wb")  # noqa: SIM115 - returned, or closed below
        fh.write(bytes(PROBE_BYTES))
        fh.flush()
        fh.seek(0)
        fh.truncate()
    except OSError as e:
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass  # its buffer, refused again: the first error is the one reported
            path.unlink(missing_ok=True)
        if only_full and e.errno not in _FULL:
            return None
        where, free = _free(path.parent)
        room = "" if free is None else f" ({size_text(free)} free in {where})"
        raise UserError(f"cannot write {target.what} {shown or path}: {e.strerror or e}{room}; "
                        f"{target.remedy}") from None
    if keep:
        return fh
    fh.close()
    path.unlink(missing_ok=True)
    return None


class GuardedWriter:
    """A writer of one file (OUTER: the file itself or a compressor over RAW) whose failures
    become WriteFailedError naming PATH. Leaving a `with` block on an exception closes it
    quietly: the first failure is the one reported."""

    def __init__(self, outer: Any, raw: IO[bytes], path: Path, target: Target) -> None:
        self._outer = outer
        self._raw = raw
        self.path = path
        self.target = target

    def write(self, data: bytes | memoryview) -> int:
        try:
            return int(self._outer.write(data))
        except OSError as e:
            raise self._failed(e) from None

    def close(self) -> None:
        try:
            if self._outer is not self._raw:
                self._outer.close()
            self._raw.close()
        except OSError as e:
            raise self._failed(e) from None

    def discard(self) -> None:
        """Close, writing nothing more and raising nothing (the caller removes the file)."""
        for fh in (self._outer, self._raw):
            try:
                fh.close()
            except (OSError, ValueError):
                pass

    def _failed(self, e: OSError) -> WriteFailedError:
        self.discard()
        return write_failed(e, self.path, self.target)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()
