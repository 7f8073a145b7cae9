"""A host's disk cache of whole packs (prompts by reference), shared by its consumers.

A pack's jobs land on whichever consumers dequeue them; the consumers of one host share one
directory, so a pack is fetched once, whole, for all of them, and each job's block is read from
the local file (why: docs/decisions.md, "A host caches whole packs"). The rules:

- **Complete files only**: a fetch is checked whole (header, footer, index, every block's crc32)
  in a temporary file (`.tmp-<pid>-<random>-<name>`) renamed into place; no fsync, since a file
  cut short by a crash fails its own checks. A pack that fails as fetched is a PackError.
- **Checked when read**: a cached file's footer and index when opened, the block against its
  entry; a file that fails is deleted and the pack fetched again, never served.
- **One key per pack, store and run**: `<digest>-<pack name>`, the digest a sha256 of the S3
  endpoint and the pack's location; packs are never changed, so a file never goes stale.
- **Bounded, least recently used out**: reads touch the mtime; after each fetch the oldest files
  go down to max_bytes (an open file stays readable; a reader that finds its file gone fetches
  again), and temporary files older than PACK_CACHE_TEMP_AGE with them.
- **One fetch per pack and host**, under a lock file (`PackCache.fetching`), never a deadlock.
- **The cache never fails a job**: a directory that cannot be written logs a warning once and
  the pack is read from memory; the store's own errors pass through as without the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from genqueue.common import defaults
from genqueue.common.errors import PackCorruptError
from genqueue.common.packs import PackIndex, read_index
from genqueue.common.storage.base import PackStore

log = logging.getLogger(__name__)

#: Seconds after which a dead fetcher's half-written file is swept away: no live fetch takes this long.
TEMP_AGE = 600.0
#: Seconds to wait for another consumer of the host fetching the same pack before fetching it too (a fetch: < 1 s).
LOCK_WAIT = 30.0
#: Locks a process's threads stripe their packs over: bounded; two packs of a stripe only wait on each other.
_STRIPES = 64
_SUFFIX = ".gqpack"
_TEMP = ".tmp-"
_LOCK = ".lock-"
#: Seconds between looks for a pack another consumer is fetching (a near store fetches in tens of ms).
_POLL = 0.01


def verify_pack(data: bytes, where: str) -> PackIndex:
    """The index of the whole pack DATA after checking all of it: header, footer, index, and
    each block's crc32 (decoding is left to the reads). Raises PackError."""
    index = read_index(data, where)
    for entry in index.blocks:
        if zlib.crc32(data[entry.offset:entry.end]) != entry.crc32:
            raise PackCorruptError(where, f"block at {entry.offset}: crc32 does not match its index")
    return index


def _alive(lock: Path) -> bool:
    """Whether the process named in LOCK may still be fetching (an unreadable or half-written
    lock counts as alive: the wait's deadline ends it)."""
    try:
        pid = int(lock.read_text() or "0")
    except FileNotFoundError:
        return True  # removed meanwhile: the next try takes it
    except (OSError, ValueError):
        return True
    if pid <= 0:
        return True  # written in a moment
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process, alive
    return True


def _origin(store: PackStore) -> str:
    """The S3 endpoint a store talks to ('' for a directory): a bucket's name is unique only on
    its endpoint."""
    meta = getattr(getattr(store, "client", None), "meta", None)
    return str(getattr(meta, "endpoint_url", "") or "")


class PackCache:
    """Whole packs in the directory ROOT, at most MAX_BYTES of them (module docstring)."""

    def __init__(self, root: str | os.PathLike[str] = defaults.PACK_CACHE_DIR, *,
                 max_bytes: int = defaults.PACK_CACHE_BYTES, temp_age: float = TEMP_AGE,
                 lock_wait: float = LOCK_WAIT) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a pack cache of {max_bytes} bytes keeps nothing: pass no cache instead")
        self.root = Path(os.path.expanduser(os.fspath(root)))
        self.max_bytes = max_bytes
        self.temp_age = temp_age
        self.lock_wait = lock_wait
        self._stripes = tuple(threading.Lock() for _ in range(_STRIPES))
        self._warned = False
        self.evicted = 0  # files this process removed to stay under the bound

    def path(self, store: PackStore, run: str, name: str) -> Path:
        """The cache file of RUN's pack NAME in STORE."""
        where = store.pack_location(run, name)
        digest = hashlib.sha256(f"{_origin(store)}\n{where}".encode()).hexdigest()[:32]
        return self.root / f"{digest}-{name}"

    @contextlib.contextmanager
    def fetching(self, path: Path) -> Iterator[None]:
        """Held while this process fetches PATH: its other threads, and the host's other
        consumers, wait until PATH is in place (or the fetch failed), then look again.

        A host's consumers miss a new pack at once (its jobs are queued together). The first takes
        the lock file (`.lock-<file>`, O_EXCL, its pid inside) and fetches; the others wait (threads
        of one consumer on a lock in memory first). A lock whose pid is not alive is taken over at
        once, and after PACK_CACHE_LOCK_WAIT seconds a waiter fetches the pack itself (two renames
        of the same pack replace identical files). A fetch that fails removes its lock."""
        with self._stripes[hash(path) % _STRIPES]:
            lock = self._lock(path)
            try:
                yield
            finally:
                if lock is not None:
                    with contextlib.suppress(OSError):
                        lock.unlink()

    def _lock(self, path: Path) -> Path | None:
        """Take PATH's lock file, or wait while another live process holds it; the lock taken,
        or None (PATH is in place now, the wait ran out, or the directory cannot be written)."""
        lock = path.with_name(f"{_LOCK}{path.name}")
        deadline = time.monotonic() + self.lock_wait
        while True:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pass
            except OSError:
                return None  # a cache that cannot be written: keep() says so
            else:
                with os.fdopen(fd, "w") as fh:
                    fh.write(str(os.getpid()))
                return lock
            if path.exists() or time.monotonic() > deadline:
                return None
            if not _alive(lock):
                log.info("pack cache: lock %s of a process gone taken over", lock)
                with contextlib.suppress(OSError):
                    lock.unlink()
                continue
            time.sleep(_POLL)

    def open(self, path: Path) -> IO[bytes] | None:
        """PATH open for reading and touched (most recently used), or None when not cached (or
        the cache cannot be read: then `keep` cannot write it either, and says so)."""
        try:
            fh = open(path, "rb")  # noqa: SIM115 - the caller closes it
        except OSError:
            return None
        with contextlib.suppress(OSError):  # removed meanwhile: the open file still reads
            os.utime(fh.fileno())
        return fh

    def discard(self, path: Path) -> None:
        """Remove PATH (a cached file that failed its checks)."""
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def keep(self, path: Path, data: bytes) -> bool:
        """Put DATA, a checked pack, in place as PATH (a temporary file renamed into place), then
        evict down to the bound. False when it was not kept (larger than the whole cache, or the
        directory cannot be written: logged once); the caller reads DATA from memory."""
        if len(data) > self.max_bytes:
            return False
        tmp = self.root / f"{_TEMP}{os.getpid()}-{secrets.token_hex(4)}-{path.name}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not self._warned:
                self._warned = True
                log.warning("pack cache %s cannot be written (%s): packs are read from memory, fetched again "
                            "per job", self.root, e)
            return False
        self.evict(keep=path)
        return True

    def evict(self, *, keep: Path | None = None) -> None:
        """Remove the least recently used packs until the cache holds at most max_bytes (KEEP,
        the one just fetched, last of all), and temporary files left by dead fetchers."""
        now = time.time()
        files: list[tuple[float, int, str]] = []
        try:
            with os.scandir(self.root) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if entry.name.startswith((_TEMP, _LOCK)):
                        if now - st.st_mtime > self.temp_age:
                            self.discard(Path(entry.path))
                    elif entry.name.endswith(_SUFFIX) and entry.is_file(follow_symlinks=False):
                        files.append((st.st_mtime if entry.path != str(keep) else float("inf"), st.st_size,
                                      entry.path))
        except FileNotFoundError:
            return
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            self.discard(Path(path))  # another consumer may have removed it already: counted all the same
            self.evicted += 1
            total -= size

    def size(self) -> int:
        """Bytes of packs in the cache now."""
        total = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
            for e in it:
                if e.name.endswith(_SUFFIX) and not e.name.startswith((_TEMP, _LOCK)):
                    with contextlib.suppress(FileNotFoundError):
                        total += e.stat(follow_symlinks=False).st_size
        return total
