"""Feature shards: rows packed one after another into a large file, each durable when appended.

Layout, little-endian (every part starts at a multiple of 8 bytes):

    header  b"GQFS", u16 version, u16 reserved, 8 bytes: the capture's digest      (16 bytes)
    frames  one per row: b"GQFR", u32 crc32 of the row, u64 the row's length        (16 bytes)
            then the row: a complete safetensors file (row.py), padded with zeros to 8

and beside the shard its index (`<name>.index.json`, JSON): the capture, the shard's size and
sha256, and per row its id, offset and length (of the safetensors bytes, not the frame), tokens,
layers, hidden size, dtype and crc32. A reader takes a row's entry and reads that range alone
(a seek, or a ranged GET): `safetensors.torch.load(data)` is all a trainer without genqueue
needs (read.py). The frames make a shard readable without its index too: scan.py rebuilds it,
which is how a shard left open by a crash is sealed, its torn last frame dropped.

One writer per shard, append only. `append` encodes, writes and fsyncs the row before it
returns its entry, so a job may be acked on it: a crash loses no appended row (the spool's
leftovers are sealed by the next process: scan.leftover_feature_shards). A write that fails (disk
full) truncates the file back to its last whole row and raises; nothing is half-written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy.typing as npt

from genqueue.common.errors import FeatureError, FeatureValueError
from genqueue.common.features.codec import FeatureDtype, encode
from genqueue.common.features.manifest import FORMAT, FORMAT_VERSION, FeatureManifest
from genqueue.common.features.names import FEATURES_DIR, OPEN_SUFFIX, SEALED_DIR, feature_shard_name, index_name
from genqueue.common.features.row import pack_row
from genqueue.common.features.tables import LogprobsManifest, LogprobsTable, TableDtype, pack_table
from genqueue.common.storage.local import fsync_dir

log = logging.getLogger(__name__)

#: A feature shard is sealed past this size: ~25 rows of a 27B target's 2,000 tokens at fp8, ~1,000 objects a TB.
FEATURE_SHARD_MAX_BYTES = 1024**3

MAGIC = b"GQFS"
FRAME_MAGIC = b"GQFR"
VERSION = int(FORMAT_VERSION)
HEADER = struct.Struct("<4sHH8s")
FRAME = struct.Struct("<4sIQ")
#: Frames and rows start at multiples of this: the size of the int64 token ids a row starts with.
ALIGN = struct.calcsize("<q")
#: Bytes [offset, offset + length) of one shard, wherever it is (a file, an S3 object).
ReadRange = Callable[[int, int], bytes]


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """Where one row's features are: bytes [OFFSET, OFFSET + LENGTH) of SHARD, a safetensors file
    whose crc32 is CRC32. A log-probability table's row (logprobs.py) has 1 layer, K as its
    hidden size and a TableDtype."""

    row: str
    shard: str
    offset: int
    length: int
    tokens: int
    layers: int
    hidden: int
    dtype: FeatureDtype | TableDtype
    crc32: int


def entry_dtype(name: str) -> FeatureDtype | TableDtype:
    """An index entry's dtype by its name: a hidden-state dtype or a table's."""
    return TableDtype(name) if name in {d.value for d in TableDtype} else FeatureDtype(name)


@dataclass(frozen=True, slots=True)
class ShardIndex:
    """A shard's index: its capture, size and sha256, and its rows in the order written."""

    shard: str
    capture: str
    size: int
    sha256: str
    entries: tuple[IndexEntry, ...]

    def to_json(self) -> bytes:
        rows = [{k: v for k, v in asdict(e).items() if k != "shard"} for e in self.entries]
        return json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "shard": self.shard, "capture": self.capture,
                           "bytes": self.size, "sha256": self.sha256, "rows": rows},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ShardIndex:
        """An index to_json wrote. Raises FeatureError for anything else."""
        try:
            body = json.loads(raw)
            if body.get("format") != FORMAT or body.get("version") != FORMAT_VERSION:
                raise ValueError(f"not a {FORMAT} {FORMAT_VERSION} index")
            shard = str(body["shard"])
            entries = tuple(IndexEntry(str(r["row"]), shard, int(r["offset"]), int(r["length"]), int(r["tokens"]),
                                       int(r["layers"]), int(r["hidden"]), entry_dtype(r["dtype"]), int(r["crc32"]))
                            for r in body["rows"])
            return cls(shard, str(body["capture"]), int(body["bytes"]), str(body["sha256"]), entries)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FeatureError(f"unreadable feature shard index: {e}") from None


@dataclass(frozen=True, slots=True)
class SealedFeatureShard:
    """A shard that is complete on the spool (fsynced, its index beside it), ready to be put in
    the run's output store."""

    run: str
    path: Path
    index_path: Path
    index: ShardIndex

    @property
    def name(self) -> str:
        return self.index.shard

    @property
    def bytes(self) -> int:
        return self.index.size

    @property
    def sha256(self) -> str:
        return self.index.sha256


def pad(n: int) -> int:
    """Zeros after N bytes of a row, so the next frame starts aligned."""
    return -n % ALIGN


def frame(blob: bytes) -> bytes:
    """A row's frame: its header, the row, and the zeros that align the next one."""
    return FRAME.pack(FRAME_MAGIC, zlib.crc32(blob), len(blob)) + blob + bytes(pad(len(blob)))


def shard_header(capture: str) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, bytes.fromhex(capture))


class FeatureShardWriter:
    """Appends rows of one run to its open feature shard on the spool; seals it on demand (the
    caller seals when `full`, or when it wants the rows shipped)."""

    def __init__(self, spool: str | Path, run: str, worker: str, manifest: FeatureManifest | LogprobsManifest, *,
                 max_bytes: int = FEATURE_SHARD_MAX_BYTES) -> None:
        self.dir = Path(spool) / run / FEATURES_DIR
        self.sealed_dir = self.dir / SEALED_DIR
        self.sealed_dir.mkdir(parents=True, exist_ok=True)
        self.run = run
        self.worker = worker
        self.manifest = manifest
        self.capture = manifest.digest
        self.max_bytes = max_bytes
        self.seq = 0
        self._fd: int | None = None
        self._path: Path | None = None
        self._size = 0
        self._hash = hashlib.sha256()
        self._entries: list[IndexEntry] = []

    @property
    def name(self) -> str:
        return feature_shard_name(self.worker, self.seq)

    @property
    def rows(self) -> int:
        return len(self._entries)

    @property
    def open_bytes(self) -> int:
        return self._size

    @property
    def full(self) -> bool:
        return self._size >= self.max_bytes

    def append(self, row: str, token_ids: npt.ArrayLike, hidden: npt.ArrayLike) -> IndexEntry:
        """Encode HIDDEN ([tokens, layers, hidden]) of ROW with its TOKEN_IDS in the capture's
        dtype, write it and fsync it; returns its index entry (the row is durable on the spool).
        Raises FeatureValueError for hidden states that do not fit the capture, OSError when the
        disk refuses (the shard is left as it was before the call)."""
        if not isinstance(self.manifest, FeatureManifest):
            raise FeatureValueError(f"row {row!r}: hidden states in a shard of log-probability tables")
        enc = encode(hidden, self.manifest.dtype)
        if enc.layers != self.manifest.layers or enc.hidden != self.manifest.hidden_size:
            raise FeatureValueError(f"row {row!r}: hidden states of {enc.layers} layers x {enc.hidden}; the capture "
                                    f"takes {self.manifest.layers} x {self.manifest.hidden_size}")
        blob = pack_row(row, self.capture, self.manifest.layer_ids, token_ids, enc)
        return self._append(row, blob, enc.tokens, enc.layers, enc.hidden, enc.dtype)

    def append_table(self, row: str, table: LogprobsTable) -> IndexEntry:
        """Write ROW's log-probability TABLE (logprobs.py) and fsync it, as `append` does a row of
        hidden states. Raises FeatureValueError for a table of another K than the manifest's."""
        if not isinstance(self.manifest, LogprobsManifest) or table.k != self.manifest.k:
            raise FeatureValueError(f"row {row!r}: a table of {table.k} entries does not fit this shard's capture")
        blob = pack_table(row, self.capture, table)
        return self._append(row, blob, table.tokens, 1, table.k, self.manifest.values)

    def _append(self, row: str, blob: bytes, tokens: int, layers: int, hidden: int,
                dtype: FeatureDtype | TableDtype) -> IndexEntry:
        data = frame(blob)
        fd = self._open()
        try:
            _write_all(fd, data, self._size)
            os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, self._size)
            except OSError:  # the next append writes over it (pwrite at the end of the last row); seal cuts it
                log.warning("%s: could not cut off a failed append at %d bytes", self._path, self._size)
            raise
        entry = IndexEntry(row, self.name, self._size + FRAME.size, len(blob), tokens, layers, hidden, dtype,
                           zlib.crc32(blob))
        self._size += len(data)
        self._hash.update(data)
        self._entries.append(entry)
        return entry

    def _open(self) -> int:
        if self._fd is not None:
            return self._fd
        self.seq += 1
        # a writer of this worker name before this one (in this process) may have left shards
        # not shipped yet: never write over them
        while (self.sealed_dir / self.name).exists() or (self.dir / (self.name + OPEN_SUFFIX)).exists():
            self.seq += 1
        path = self.dir / (self.name + OPEN_SUFFIX)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        head = shard_header(self.capture)
        try:
            _write_all(fd, head, 0)
            os.fsync(fd)
            fsync_dir(self.dir)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(path)
            raise
        self._fd, self._path, self._size = fd, path, len(head)
        self._hash = hashlib.sha256(head)
        self._entries = []
        return fd

    def seal(self) -> SealedFeatureShard | None:
        """Move the open shard, with its index, to the spool's sealed folder; None when no row was
        appended since the last seal. Raises OSError when the disk refuses, and may be called again:
        until it succeeds the shard stays open (rows appended meanwhile join it) and its rows stay
        this writer's, whether or not the shard was already moved."""
        if self._path is None:
            return None
        if not self._entries:
            self._close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path)
            self._path = None
            return None
        sealed_path = self.sealed_dir / self.name
        path = self._path if self._path.exists() else sealed_path  # moved by a seal the disk then refused
        if path.stat().st_size > self._size:  # a failed append's bytes that ftruncate could not cut off
            os.truncate(path, self._size)
        index = ShardIndex(self.name, self.capture, self._size, self._hash.hexdigest(), tuple(self._entries))
        shard = seal_as(self.run, path, self.sealed_dir, index)
        self._close()
        self._path = None
        self._entries = []
        return shard

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def seal_as(run: str, open_path: Path, sealed_dir: Path, index: ShardIndex) -> SealedFeatureShard:
    """Move OPEN_PATH into SEALED_DIR under its shard name (unless it is there already) and write
    INDEX beside it (fsynced)."""
    dest = sealed_dir / index.shard
    if open_path != dest:
        os.replace(open_path, dest)
        fsync_dir(open_path.parent)
    idx = sealed_dir / index_name(index.shard)
    tmp = idx.with_name(f".{idx.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(index.to_json())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, idx)
    fsync_dir(sealed_dir)
    return SealedFeatureShard(run, dest, idx, index)


def _write_all(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def file_range(path: Path) -> ReadRange:
    """READ_RANGE over a local file: one positioned read of the range, nothing else."""
    def read(offset: int, length: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return pread_all(fd, offset, length)
        finally:
            os.close(fd)
    return read


def pread_all(fd: int, offset: int, length: int) -> bytes:
    """LENGTH bytes of FD at OFFSET (fewer where the file ends)."""
    parts, at, left = [], offset, length
    while left > 0 and (chunk := os.pread(fd, left, at)):
        parts.append(chunk)
        at, left = at + len(chunk), left - len(chunk)
    return b"".join(parts)
