"""Files the producer writes, and the one line a failed write becomes.

A full disk (ENOSPC), a spent quota (EDQUOT), an I/O error, a read-only or forbidden place:
each ends the command with `error: ...` naming the file, what it held on disk when the write
failed, the space left there, and the option that moves it (WriteFailedError, exit 1). A place
that cannot take one block at all is refused before anything is done (`probe`: UserError,
exit 2). Writers write under a temporary name and rename into place only when complete; on a
failure the caller removes the temporary file, so nothing partial keeps a final name.

Whose a file is: a command never writes over a file a run reads (its inputs, compared by
resolved path and by inode), nor over one genqueue did not write unless asked (`--overwrite`),
and says so in one line before anything is written (`refuse_replacing`, UserError). What
genqueue wrote is known by a manifest in each folder it writes to (MANIFEST, hidden): each file's
name with its size, modification time and inode as written (`record_written`). A file listed and
unchanged since is genqueue's to replace (an export run again over its own output); one changed
since, or not listed, is the user's. A manifest rather than a look at the file's content: the
files are of many kinds (JSONL, gzip, zstd, Parquet, PNG, a LLaMA-Factory entry), and an export
the user has since edited, or another run's export kept as data, looks like genqueue's and is not.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Any, Self

import orjson

from genqueue.common.errors import UserError, WriteFailedError

log = logging.getLogger(__name__)

#: Bytes `probe` writes: one page, what a full tmpfs or ext4 refuses at once.
PROBE_BYTES = 4096
#: The hidden file, in each folder genqueue writes to, that lists the files it wrote there.
MANIFEST = ".genqueue-files.json"

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
    forbidden, missing or already full is refused (UserError, exit 2, naming SHOWN or PATH)
    before anything is done; ONLY_FULL: a full one only (other failures pass). KEEP: return PATH
    open for writing; else remove it. An existing PATH is never opened: KEEP refuses it, and
    without KEEP a fresh name beside it is probed instead (the place is what is tried)."""
    fh: IO[bytes] | None = None
    made: Path | None = None
    try:
        try:
            fh = open(path, "xb")  # noqa: SIM115 - returned, or closed below
            made = path
        except FileExistsError:
            if keep:
                raise
            fd, name = tempfile.mkstemp(prefix=".gq-probe-", dir=path.parent)
            made = Path(name)
            fh = os.fdopen(fd, "wb")
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
        if made is not None:
            made.unlink(missing_ok=True)
        if only_full and e.errno not in _FULL:
            return None
        raise UserError(f"cannot write {target.what} {shown or path}: {_why(e, path)}; {target.remedy}") from None
    if keep:
        return fh
    fh.close()
    if made is not None:
        made.unlink(missing_ok=True)
    return None


def _why(e: OSError, path: Path) -> str:
    """What E, refusing a file at PATH, means: a folder that is not there, or the space left
    when the place is full (the free space says nothing of another cause)."""
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        d = path.parent
        while not d.exists() and d != d.parent:
            d = d.parent
        if not d.is_dir():
            return f"{d} is a file, not a folder"
        missing = path.parent
        return f"folder {missing} does not exist (create it: mkdir -p {missing})"
    if e.errno == errno.EEXIST:
        return f"{path} exists"
    if e.errno in _FULL:
        where, free = _free(path.parent)
        room = "" if free is None else f" ({size_text(free)} free in {where})"
        return f"{e.strerror or e}{room}"
    return str(e.strerror or e)


class Owner(StrEnum):
    """Whose an existing file is, for a command about to write over it."""

    ABSENT = "absent"
    GENQUEUE = "genqueue"  # listed in its folder's manifest, unchanged since
    CHANGED = "changed"  # listed, changed since genqueue wrote it
    USER = "user"  # not listed (or not a regular file)


def _stamp(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _listed(folder: Path) -> dict[str, Any]:
    """The files FOLDER's manifest lists (none when it has none, or an unreadable one)."""
    try:
        data = orjson.loads((folder / MANIFEST).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else {}


def owner(path: Path) -> Owner:
    """Whose PATH is (see the module docstring)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return Owner.ABSENT
    except OSError:
        return Owner.USER
    if not stat.S_ISREG(st.st_mode):
        return Owner.USER
    entry = _listed(path.parent).get(path.name)
    if not isinstance(entry, dict):
        return Owner.USER
    return Owner.GENQUEUE if entry == _stamp(st) else Owner.CHANGED


def same_file(a: Path, b: Path) -> bool:
    """A and B name one file: the same path once resolved (links, `./`, `..`), or the same inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def refuse_replacing(files: Iterable[tuple[Path, Target]], *, inputs: Mapping[str, str] | None = None,
                     overwrite: bool = False, asked: str = "pass --overwrite to replace it") -> None:
    """Refuse (UserError, one line) before anything is written when one of FILES (each a path
    and what it is) is one of INPUTS (a file a run reads -> the words for it: never replaced),
    or exists and is not genqueue's (unless OVERWRITE; ASKED says how to ask)."""
    for path, target in files:
        for source, what in (inputs or {}).items():
            if source != "-" and same_file(path, Path(source)):
                named = "" if os.path.abspath(source) == str(path) else f" ({source})"
                raise UserError(f"{target.what} {path} is {what}{named}: genqueue never writes over a file a run "
                                f"reads (a retry or reconcile reads it again); {target.remedy}")
        if overwrite:
            continue
        whose = owner(path)
        if whose is Owner.USER:
            raise UserError(f"{target.what} {path} exists and genqueue did not write it: {asked}, or "
                            f"{target.remedy}")
        if whose is Owner.CHANGED:
            raise UserError(f"{target.what} {path} was changed since genqueue wrote it: {asked}, or "
                            f"{target.remedy}")


def record_written(paths: Iterable[Path]) -> None:
    """List PATHS, just written, in their folders' manifests (entries of files gone or changed
    since are dropped). Best effort: a manifest that cannot be written only means the next
    command over these files asks for --overwrite."""
    by_folder: dict[Path, list[Path]] = {}
    for p in paths:
        by_folder.setdefault(p.parent, []).append(p)
    for folder, written in by_folder.items():
        files = {name: entry for name, entry in _listed(folder).items()
                 if owner(folder / name) is Owner.GENQUEUE}
        for p in written:
            try:
                files[p.name] = _stamp(p.lstat())
            except OSError:
                files.pop(p.name, None)
        body = {"genqueue": "the files genqueue wrote in this folder, each as written: one listed and unchanged "
                            "since may be replaced by the command that wrote it; any other file is left alone",
                "files": dict(sorted(files.items()))}
        tmp = folder / f"{MANIFEST}.{os.getpid()}.tmp"
        try:
            tmp.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")
            os.replace(tmp, folder / MANIFEST)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("could not list the files written in %s (%s): the next command over them asks for "
                        "--overwrite", folder / MANIFEST, e.strerror or e)


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
