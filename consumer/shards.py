"""Result shards: a local spool file per run, sealed by size or age, then shipped.

Layout of the spool (one per consumer; keep consumers on one machine in separate spools):
  <spool>/<run>/<worker>-<seq>.jsonl.open   the shard being appended to
  <spool>/<run>/sealed/<worker>-<seq>.jsonl  flushed, fsynced, waiting to be shipped
Shipping puts `<worker>-<seq>.jsonl` and its `.manifest.json` under `<output>/<run>/shards/`.
Worker names are unique per process start, so object names never collide.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import orjson

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SealedShard:
    run: str
    seq: int
    path: Path
    name: str
    records: int
    bytes: int
    sha256: str
    keys: int

    def manifest(self) -> dict[str, Any]:
        return {"run": self.run, "shard": self.name, "records": self.records, "keys": self.keys,
                "bytes": self.bytes, "sha256": self.sha256}


class Sink(Protocol):
    """Where sealed shards go. `ship` is synchronous; the consumer runs it in a thread."""

    def ship(self, shard: SealedShard) -> str: ...


class LocalSink:
    """A directory (local disk or a shared mount): copy, fsync, then rename into place."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def ship(self, shard: SealedShard) -> str:
        dest_dir = self.root / shard.run / "shards"
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / shard.name
        tmp = dest_dir / f".{shard.name}.tmp"
        shutil.copyfile(shard.path, tmp)
        _fsync_file(tmp)
        os.replace(tmp, dest)
        man = dest_dir / (shard.name.removesuffix(".jsonl") + ".manifest.json")
        man_tmp = dest_dir / f".{man.name}.tmp"
        man_tmp.write_bytes(orjson.dumps(shard.manifest()))
        _fsync_file(man_tmp)
        os.replace(man_tmp, man)
        _fsync_dir(dest_dir)
        return str(dest)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Appends records of one run to the open shard; seals it by size or age."""

    def __init__(self, spool: str, run: str, worker: str, *, max_bytes: int, max_age: float) -> None:
        self.dir = Path(spool) / run
        self.sealed_dir = self.dir / "sealed"
        self.sealed_dir.mkdir(parents=True, exist_ok=True)
        self.run = run
        self.worker = worker
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.seq = 0
        self._fh: IO[bytes] | None = None
        self._path: Path | None = None
        self._opened = 0.0
        self._records = 0
        self._bytes = 0
        self._hash = hashlib.sha256()
        self._keys: set[str] = set()

    @property
    def records(self) -> int:
        return self._records

    @property
    def open_bytes(self) -> int:
        return self._bytes

    def _name(self) -> str:
        return f"{self.worker}-{self.seq:06d}.jsonl"

    def append(self, record: dict[str, Any]) -> int:
        """Write RECORD to the open shard; returns that shard's sequence number."""
        if self._fh is None:
            self.seq += 1
            self._path = self.dir / (self._name() + ".open")
            self._fh = open(self._path, "wb")  # noqa: SIM115 - closed in seal()
            self._opened = time.monotonic()
        line = orjson.dumps(record) + b"\n"
        self._fh.write(line)
        self._hash.update(line)
        self._records += 1
        self._bytes += len(line)
        self._keys.add(record["key"])
        return self.seq

    def due(self, now: float | None = None) -> bool:
        if self._fh is None:
            return False
        now = time.monotonic() if now is None else now
        return self._bytes >= self.max_bytes or now - self._opened >= self.max_age

    def seal(self) -> SealedShard | None:
        """Flush and fsync the open shard and move it to sealed/. None when nothing is open."""
        if self._fh is None or self._path is None:
            return None
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        name = self._name()
        sealed = self.sealed_dir / name
        os.replace(self._path, sealed)
        _fsync_dir(self.sealed_dir)
        shard = SealedShard(self.run, self.seq, sealed, name, self._records, self._bytes,
                            self._hash.hexdigest(), len(self._keys))
        self._fh = None
        self._path = None
        self._records = 0
        self._bytes = 0
        self._hash = hashlib.sha256()
        self._keys = set()
        return shard


def leftover_shards(spool: str, is_dead: Any) -> list[SealedShard]:
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
        for open_path in sorted(run_dir.glob("*.jsonl.open")):
            worker = open_path.name.rsplit("-", 1)[0]
            if is_dead(worker):
                _drop_torn_tail(open_path)
                os.replace(open_path, sealed_dir / open_path.name.removesuffix(".open"))
        for path in sorted(sealed_dir.glob("*.jsonl")):
            if is_dead(path.name.rsplit("-", 1)[0]):
                found.append(_describe(run_dir.name, path))
    return found


class SpoolBusyError(Exception):
    """Another live consumer holds this spool directory."""


def lock_spool(spool: str) -> Any:
    """Take the spool for this process (an flock the kernel drops when the process dies, even
    by SIGKILL). Two live consumers on one spool would ship and delete each other's shards."""
    import fcntl

    Path(spool).mkdir(parents=True, exist_ok=True)
    fh = open(Path(spool) / ".lock", "a+")  # noqa: SIM115 - held for the life of the process
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


def _drop_torn_tail(path: Path) -> None:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as fh:
            fh.truncate(cut)


def _describe(run: str, path: Path) -> SealedShard:
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
    seq_part = path.name.removesuffix(".jsonl").rsplit("-", 1)[-1]
    seq = int(seq_part) if seq_part.isdigit() else 0
    return SealedShard(run, seq, path, path.name, records, path.stat().st_size, h.hexdigest(), len(keys))
