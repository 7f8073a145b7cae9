"""The consumer's spool: result shards being written, sealed, and left behind by a crash.

Layout of the spool (one per consumer; keep consumers on one machine in separate spools):
  <spool>/<run>/<worker>-<seq>.jsonl.open   the shard being appended to
  <spool>/<run>/sealed/<worker>-<seq>.jsonl  flushed, fsynced, waiting to be shipped
Shard names follow genqueue.common.storage.names; shipping them to the run's output is the
store's job (genqueue.common.storage). Worker names are unique per process start, so object
names never collide.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import orjson

from genqueue.common.storage import SealedShard, parse_shard_name, shard_name
from genqueue.common.storage.local import fsync_dir

log = logging.getLogger(__name__)

#: The suffix of the shard being appended to (never shipped under this name).
OPEN_SUFFIX = ".open"

class ShardWriter:
    """Appends records of one run to the open shard; seals it by size or age.

    Appending never touches the disk, so it cannot fail: the open shard's lines are kept in
    memory (at most max_bytes) and written by flush() (every fraction of a second, for crash
    recovery) and seal(). A write or fsync that fails (a full disk, an I/O error) raises
    OSError and loses nothing: the file is rewritten whole from memory at the next try, since
    after a failed fsync the kernel may have dropped pages it reported written.
    """

    def __init__(self, spool: str, run: str, worker: str, *, max_bytes: int, max_age: float) -> None:
        self.dir = Path(spool) / run
        self.sealed_dir = self.dir / "sealed"
        self.sealed_dir.mkdir(parents=True, exist_ok=True)
        self.run = run
        self.worker = worker
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.seq = 0
        self._lines: list[bytes] = []
        self._written = 0  # lines of _lines in the file
        self._fd: int | None = None
        self._broken = False  # a write failed: rewrite the file whole before anything else
        self._path: Path | None = None
        self._opened: float | None = None
        self._bytes = 0
        # The sha256 of the lines, fed a whole chunk at a time in flush(), not a line at a time
        # in append(): hashlib drops the GIL for any input of 2 KB or more, so hashing each
        # record would make the event loop hand the GIL to the rq thread and back for every item.
        self._hash = hashlib.sha256()
        self._hashed = 0  # lines of _lines in _hash
        self._keys: set[str] = set()

    @property
    def records(self) -> int:
        return len(self._lines)

    @property
    def open_bytes(self) -> int:
        return self._bytes

    def _name(self) -> str:
        return shard_name(self.worker, self.seq)

    def append(self, record: Mapping[str, Any]) -> int:
        """Add RECORD to the open shard (in memory); returns that shard's sequence number."""
        if self._opened is None:
            self.seq += 1
            self._path = self.dir / (self._name() + OPEN_SUFFIX)
            self._opened = time.monotonic()
        line = orjson.dumps(record) + b"\n"
        self._lines.append(line)
        self._bytes += len(line)
        self._keys.add(record["key"])
        return self.seq

    def due(self, now: float | None = None) -> bool:
        if self._opened is None:
            return False
        now = time.monotonic() if now is None else now
        return self._bytes >= self.max_bytes or now - self._opened >= self.max_age

    def flush(self) -> None:
        """Write the lines not yet in the file. Raises OSError (nothing is lost: retry later)."""
        if self._path is None or (self._written == len(self._lines) and not self._broken):
            return
        if self._fd is None:
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT, 0o644)
            self._broken = True  # a file of this name may hold anything: start it over
        try:
            if self._broken:
                os.ftruncate(self._fd, 0)
                os.lseek(self._fd, 0, os.SEEK_SET)
                self._written = 0
                self._broken = False
            chunk = b"".join(self._lines[self._written:])
            if self._hashed < len(self._lines):  # after a failed write, _written < _hashed
                self._hash.update(chunk if self._hashed == self._written else b"".join(self._lines[self._hashed:]))
                self._hashed = len(self._lines)
            data = memoryview(chunk)
            while data:
                n = os.write(self._fd, data)
                data = data[n:]
            self._written = len(self._lines)
        except OSError:
            self._broken = True
            raise

    def seal(self) -> SealedShard | None:
        """Write, fsync and move the open shard to sealed/. None when nothing is open. Raises
        OSError when the disk refuses (the shard stays open, whole in memory: retry later)."""
        if self._opened is None or self._path is None:
            return None
        self.flush()
        assert self._fd is not None  # flush() opened it: there is at least one line
        try:
            os.fsync(self._fd)
        except OSError:
            self._broken = True
            raise
        os.close(self._fd)
        self._fd = None
        name = self._name()
        sealed = self.sealed_dir / name
        os.replace(self._path, sealed)
        fsync_dir(self.sealed_dir)
        shard = SealedShard(self.run, self.seq, sealed, name, len(self._lines), self._bytes,
                            self._hash.hexdigest(), len(self._keys))
        self._lines = []
        self._written = 0
        self._path = None
        self._opened = None
        self._bytes = 0
        self._hash = hashlib.sha256()
        self._hashed = 0
        self._keys = set()
        return shard


def leftover_shards(spool: str, is_dead: Callable[[str], bool]) -> list[SealedShard]:
    """Shards a crashed consumer left in SPOOL: sealed ones, and open ones of workers that
    is_dead(worker_name) says are gone. Open ones are sealed here (their last line may be
    torn by the crash; it is dropped)."""
    found: list[SealedShard] = []
    root = Path(spool)
    if not root.is_dir():
        return found
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        sealed_dir = run_dir / "sealed"
        sealed_dir.mkdir(exist_ok=True)
        for open_path in sorted(run_dir.glob("*" + OPEN_SUFFIX)):
            name = parse_shard_name(open_path.name.removesuffix(OPEN_SUFFIX))
            if name is not None and is_dead(name.worker):
                _drop_torn_tail(open_path)
                os.replace(open_path, sealed_dir / open_path.name.removesuffix(OPEN_SUFFIX))
        for path in sorted(sealed_dir.iterdir()):
            name = parse_shard_name(path.name)
            if name is not None and is_dead(name.worker):
                found.append(_describe(run_dir.name, path, name.seq))
    return found


#: The spool's lock file (lock_spool), the one file an empty spool holds.
LOCK_NAME = ".lock"


class SpoolBusyError(Exception):
    """Another live consumer holds this spool directory."""


def lock_spool(spool: str) -> IO[str]:
    """Take the spool for this process (an flock the kernel drops when the process dies, even
    by SIGKILL). Two live consumers on one spool would ship and delete each other's shards."""
    import fcntl

    for tries in range(3):  # a consumer that just removed its empty spool (release_spool) races the mkdir
        Path(spool).mkdir(parents=True, exist_ok=True)
        try:
            fh = open(Path(spool) / LOCK_NAME, "a+")  # noqa: SIM115 - held for the life of the process
            break
        except FileNotFoundError:
            if tries == 2:
                raise
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        owner = fh.read().strip() or "another process"
        fh.close()
        raise SpoolBusyError(f"spool {spool} is in use by {owner}; give each consumer its own --spool") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}\n")
    fh.flush()
    return fh


def release_spool(spool: str, lock: IO[str]) -> bool:
    """Let go of SPOOL at exit (LOCK is lock_spool's). A spool that holds nothing to ship (no
    file but its lock, at any depth: a consumer whose endpoint never came up, or that was refused
    in its pre-flight, or that shipped everything) is removed, lock file and empty run folders
    with it, so failed starts leave no empty folders behind. Any other file keeps the spool
    whole. True when it was removed."""
    root = Path(spool)
    try:
        if _holds_files(root, top=True):
            return False
        for dirpath, dirnames, _ in os.walk(root, topdown=False):
            for d in dirnames:
                with contextlib.suppress(OSError):
                    (Path(dirpath) / d).rmdir()  # empty, or left as it is
        (root / LOCK_NAME).unlink(missing_ok=True)  # still holding its flock: no one else owns it yet
        lock.close()
        root.rmdir()  # fails (and keeps it) if anything appeared meanwhile
    except OSError as e:
        log.debug("spool %s kept: %s", spool, e)
        return False
    finally:
        if not lock.closed:
            lock.close()
    return True


def _holds_files(path: Path, *, top: bool = False) -> bool:
    """Whether PATH holds anything but directories (the top's lock file aside). A symlink counts
    as a file: it is never followed, never removed."""
    with os.scandir(path) as entries:
        for entry in entries:
            if top and entry.name == LOCK_NAME and entry.is_file(follow_symlinks=False):
                continue
            if not entry.is_dir(follow_symlinks=False) or _holds_files(Path(entry.path)):
                return True
    return False


def _drop_torn_tail(path: Path) -> None:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as fh:
            fh.truncate(cut)


def _describe(run: str, path: Path, seq: int) -> SealedShard:
    h = hashlib.sha256()
    records = 0
    keys: set[str] = set()
    with open(path, "rb") as fh:
        for line in fh:
            h.update(line)
            records += 1
            try:
                keys.add(orjson.loads(line)["key"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                pass
    return SealedShard(run, seq, path, path.name, records, path.stat().st_size, h.hexdigest(), len(keys))
