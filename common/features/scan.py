"""A feature shard read from its bytes alone: its index rebuilt, and a crash's leftovers sealed.

The frames (shard.py) say where every row is, so a shard whose index is lost, or one a crashed
writer left open, is read from the start: each whole frame whose crc32 matches is a row. The
last frame may be torn by the crash (cut short, or not on disk whole): it was never fsynced, so
its row was never acked, and it is dropped. A garbled frame with whole rows after it is not a
crash's work but corruption: it raises, since a row that was durable is never dropped in silence.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from genqueue.common.errors import FeatureCorruptError, FeatureValueError
from genqueue.common.features.names import FEATURES_DIR, OPEN_SUFFIX, SEALED_DIR, index_name, parse_feature_shard_name
from genqueue.common.features.row import RowFormatError, unpack_row
from genqueue.common.features.shard import (
    ALIGN,
    FRAME,
    FRAME_MAGIC,
    HEADER,
    MAGIC,
    VERSION,
    IndexEntry,
    SealedFeatureShard,
    ShardIndex,
    pad,
    seal_as,
)
from genqueue.common.features.tables import TableDtype, is_table_row, unpack_table

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Scan:
    """What a shard's bytes hold: its capture, the rows of its whole frames, where the last whole
    frame ends, and the sha256 of the bytes up to there."""

    capture: str
    entries: tuple[IndexEntry, ...]
    end: int
    sha256: str


def scan(path: Path, shard: str | None = None) -> Scan:
    """Read a shard's frames from the start (the index from the bytes alone). A last frame cut
    short or garbled (a crash while it was written) ends the scan; a garbled frame with whole
    frames after it raises FeatureCorruptError (a row once durable is never dropped in silence)."""
    name = shard or path.name.removesuffix(OPEN_SUFFIX)
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        head = fh.read(HEADER.size)
        if len(head) < HEADER.size:
            raise FeatureCorruptError("(header)", name, 0, f"a shard of {len(head)} bytes has no header")
        magic, version, _, digest = HEADER.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise FeatureCorruptError("(header)", name, 0, f"not a feature shard of version {VERSION}")
        h.update(head)
        at, entries = HEADER.size, []
        while at < size:
            raw = fh.read(FRAME.size)
            if len(raw) < FRAME.size:
                break  # a frame header cut short: the torn end of a crash
            magic, crc, length = FRAME.unpack(raw)
            end = at + FRAME.size + length + pad(length)
            if magic != FRAME_MAGIC:
                if _whole_frame_after(path, at, size):
                    raise FeatureCorruptError("(unknown)", name, at, "a garbled frame with whole rows after it")
                break  # a frame header never written whole: the torn end of a crash
            blob = fh.read(length) if end <= size else b""
            if end > size or zlib.crc32(blob) != crc:
                if end >= size and not _whole_frame_after(path, at, size):
                    break  # the last frame, cut short or not on disk whole: the torn end of a crash
                raise FeatureCorruptError("(unknown)", name, at + FRAME.size, "a garbled row with whole rows after it")
            try:
                if is_table_row(blob):
                    t = unpack_table(blob)
                    entries.append(IndexEntry(t.row, name, at + FRAME.size, length, t.table.tokens, 1, t.table.k,
                                              TableDtype.FP16, crc))
                else:
                    row = unpack_row(blob)
                    enc = row.encoded
                    entries.append(IndexEntry(row.row, name, at + FRAME.size, length, enc.tokens, enc.layers,
                                              enc.hidden, enc.dtype, crc))
            except (RowFormatError, FeatureValueError) as e:
                raise FeatureCorruptError("(unknown)", name, at + FRAME.size, str(e)) from None
            zeros = fh.read(pad(length))
            h.update(raw + blob + zeros)
            at = end
    return Scan(digest.hex(), tuple(entries), at, h.hexdigest())


def _whole_frame_after(path: Path, at: int, size: int) -> bool:
    """Whether a whole, valid frame starts at an aligned place past AT: a garbled frame header
    with rows after it is corruption, not the torn end a crash leaves."""
    with open(path, "rb") as fh:
        fh.seek(at + ALIGN)
        rest = fh.read(size - at - ALIGN)
    for i in range(0, len(rest) - FRAME.size + 1, ALIGN):
        if rest[i:i + 4] != FRAME_MAGIC:
            continue
        _, crc, length = FRAME.unpack_from(rest, i)
        blob = rest[i + FRAME.size:i + FRAME.size + length]
        if len(blob) == length and zlib.crc32(blob) == crc:
            return True
    return False


def seal_scanned(run: str, path: Path, sealed_dir: Path) -> SealedFeatureShard:
    """Seal a shard from its bytes alone (one left open or without its index by a crash): its
    torn end cut off, its index rebuilt by scan."""
    name = path.name.removesuffix(OPEN_SUFFIX)
    found = scan(path, name)
    if found.end < path.stat().st_size:
        log.warning("%s: dropped a torn row at offset %d (%d bytes) left by a crash", path, found.end,
                    path.stat().st_size - found.end)
        os.truncate(path, found.end)
    index = ShardIndex(name, found.capture, found.end, found.sha256, found.entries)
    return seal_as(run, path, sealed_dir, index)


def leftover_feature_shards(spool: str | Path, is_dead: Callable[[str], bool]) -> list[SealedFeatureShard]:
    """Feature shards a crashed writer left in SPOOL, sealed and ready to put: open ones and sealed
    ones of workers that IS_DEAD(worker) says are gone (an open one's torn last row dropped; an
    index a crash kept from being written, rebuilt)."""
    found: list[SealedFeatureShard] = []
    root = Path(spool)
    if not root.is_dir():
        return found
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        fdir = run_dir / FEATURES_DIR
        if not fdir.is_dir():
            continue
        sealed_dir = fdir / SEALED_DIR
        sealed_dir.mkdir(exist_ok=True)
        for open_path in sorted(fdir.glob("*" + OPEN_SUFFIX)):
            name = parse_feature_shard_name(open_path.name.removesuffix(OPEN_SUFFIX))
            if name is not None and is_dead(name.worker):
                if open_path.stat().st_size <= HEADER.size:
                    os.remove(open_path)  # opened, no row written
                    continue
                seal_scanned(run_dir.name, open_path, sealed_dir)
        for path in sorted(sealed_dir.iterdir()):
            name = parse_feature_shard_name(path.name)
            if name is None or not is_dead(name.worker):
                continue
            idx = sealed_dir / index_name(path.name)
            if idx.exists():
                found.append(SealedFeatureShard(run_dir.name, path, idx, ShardIndex.from_json(idx.read_bytes())))
            else:
                found.append(seal_scanned(run_dir.name, path, sealed_dir))
    return found
