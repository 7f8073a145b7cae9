"""Reading a capture back: one row by its id, through its entry, without reading its shard; or
many rows at once (an export's), grouped by shard and read in few large reads.

Every read checks what it reads: the row's crc32 against its index entry, its safetensors
layout, and that it is the row, shape, dtype and capture the entry and the manifest say. A
mismatch raises FeatureCorruptError naming the row, the shard and the offset; nothing is skipped.

Many rows (`read_entries`): the entries wanted are grouped by shard and sorted by offset, and
rows near each other (at most FEATURE_READ_GAP_BYTES apart) are read as one span of at most
FEATURE_READ_SPAN_BYTES (a row larger than that alone): one ranged GET a span from S3, one open
a shard on disk (FeatureStore.read_spans). Each row is then cut out of its span and checked as
a row read alone is; a row that fails its check is that row's FeatureCorruptError, the others
are read as they are. Callers bound the memory by the rows they ask for at once (`windows`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from genqueue.common.errors import FeatureCorruptError, FeatureError
from genqueue.common.features.manifest import FeatureManifest
from genqueue.common.features.row import FeatureRow, RowFormatError, unpack_row
from genqueue.common.features.shard import IndexEntry, ReadRange
from genqueue.common.features.store import FeatureStore
from genqueue.common.features.tables import LogprobsManifest

#: Rows read together share one read (a ranged GET) up to this span: a GET's cost spread, its memory bounded.
FEATURE_READ_SPAN_BYTES = 64 * 1024 * 1024
#: ... and while they are at most this far apart: bytes read and thrown away cost about a GET at ~1 GB/s.
FEATURE_READ_GAP_BYTES = 1024 * 1024
#: The bytes of the rows an export reads at once.
FEATURE_READ_WINDOW_BYTES = 128 * 1024 * 1024
#: The rows an export reads at once (a tokens row's ids are Python ints, ~36 B each, held until written).
FEATURE_READ_WINDOW_ROWS = 1024

T = TypeVar("T")
#: A row's bytes and its entry -> the row, checked. Raises FeatureCorruptError.
Check = Callable[[bytes, IndexEntry], T]


def corrupt(entry: IndexEntry, reason: str) -> FeatureCorruptError:
    """ENTRY's row is not what was written, for REASON."""
    return FeatureCorruptError(entry.row, entry.shard, entry.offset, reason)


def check_frame(data: bytes, entry: IndexEntry) -> None:
    """DATA is all of ENTRY's bytes and of its crc32. Raises FeatureCorruptError."""
    if len(data) != entry.length:
        raise corrupt(entry, f"{len(data)} bytes read of {entry.length}")
    if (crc := zlib.crc32(data)) != entry.crc32:
        raise corrupt(entry, f"crc32 {crc:08x}, the index says {entry.crc32:08x}")


def check_row(data: bytes, entry: IndexEntry, *, capture: str | None = None) -> FeatureRow:
    """DATA, the bytes read of ENTRY's row, checked as the row ENTRY names (and of CAPTURE, a
    manifest's digest, when given). Raises FeatureCorruptError."""
    check_frame(data, entry)
    try:
        row = unpack_row(data)
    except RowFormatError as e:
        raise corrupt(entry, str(e)) from None
    enc = row.encoded
    if row.row != entry.row:
        raise corrupt(entry, f"the stored row is {row.row!r}")
    if (enc.tokens, enc.layers, enc.hidden, enc.dtype) != (entry.tokens, entry.layers, entry.hidden, entry.dtype):
        raise corrupt(entry, f"{enc.tokens} x {enc.layers} x {enc.hidden} {enc.dtype.value} stored, the index says "
                             f"{entry.tokens} x {entry.layers} x {entry.hidden} {entry.dtype.value}")
    if capture is not None and row.capture != capture:
        raise corrupt(entry, f"a row of capture {row.capture}, not {capture}")
    return row


def read_row(read_range: ReadRange, entry: IndexEntry, *, capture: str | None = None) -> FeatureRow:
    """The row ENTRY names, read alone through READ_RANGE(offset, length) and checked (and of
    CAPTURE, a manifest's digest, when given). Raises FeatureCorruptError."""
    return check_row(read_range(entry.offset, entry.length), entry, capture=capture)


@dataclass(frozen=True, slots=True)
class SpanRead:
    """One read of bytes [OFFSET, OFFSET + LENGTH) of SHARD, which holds ENTRIES' rows."""

    shard: str
    offset: int
    length: int
    entries: tuple[IndexEntry, ...]


def plan_reads(entries: Iterable[IndexEntry], *, max_bytes: int = FEATURE_READ_SPAN_BYTES,
               max_gap: int = FEATURE_READ_GAP_BYTES) -> list[SpanRead]:
    """The reads of ENTRIES (each once), in shard then offset order: rows at most MAX_GAP bytes
    apart share a read while it spans at most MAX_BYTES (a larger row is read alone)."""
    by_shard: dict[str, set[IndexEntry]] = {}
    for entry in entries:
        by_shard.setdefault(entry.shard, set()).add(entry)
    reads: list[SpanRead] = []
    for shard in sorted(by_shard):
        group: list[IndexEntry] = []
        start = end = 0
        for entry in sorted(by_shard[shard], key=lambda e: (e.offset, e.length)):
            stop = entry.offset + entry.length
            if group and entry.offset - end <= max_gap and max(end, stop) - start <= max_bytes:
                group.append(entry)
                end = max(end, stop)
                continue
            if group:
                reads.append(SpanRead(shard, start, end - start, tuple(group)))
            group, start, end = [entry], entry.offset, stop
        if group:
            reads.append(SpanRead(shard, start, end - start, tuple(group)))
    return reads


def read_entries(store: FeatureStore, run: str, entries: Iterable[IndexEntry], check: Check[T], *,
                 max_bytes: int = FEATURE_READ_SPAN_BYTES,
                 max_gap: int = FEATURE_READ_GAP_BYTES) -> dict[IndexEntry, T | FeatureCorruptError]:
    """Each of ENTRIES' rows in RUN's shards in STORE, read in plan_reads' spans and each cut out
    and checked by CHECK: the row, or its FeatureCorruptError (naming its row, shard and offset).
    Raises StoreError when a read fails."""
    out: dict[IndexEntry, T | FeatureCorruptError] = {}
    by_shard: dict[str, list[SpanRead]] = {}
    for span in plan_reads(entries, max_bytes=max_bytes, max_gap=max_gap):
        by_shard.setdefault(span.shard, []).append(span)
    for shard, spans in by_shard.items():
        datas = store.read_spans(run, shard, [(s.offset, s.length) for s in spans])
        for span, data in zip(spans, datas, strict=True):
            view = memoryview(data)
            for entry in span.entries:
                at = entry.offset - span.offset
                try:
                    out[entry] = check(bytes(view[at:at + entry.length]), entry)
                except FeatureCorruptError as e:
                    out[entry] = e
    return out


def read_by_id(store: FeatureStore, run: str, entries: Mapping[str, IndexEntry], rows: Iterable[str],
               check: Check[T]) -> dict[str, T | FeatureCorruptError]:
    """Each of ROWS that ENTRIES (row id -> its entry) holds, read_entries' way: the row id ->
    the row, or its FeatureCorruptError."""
    wanted = {r: entries[r] for r in rows if r in entries}
    got = read_entries(store, run, wanted.values(), check)
    return {r: got[e] for r, e in wanted.items()}


def windows(items: Iterable[T], size: Callable[[T], int], *, max_bytes: int = FEATURE_READ_WINDOW_BYTES,
            max_items: int = FEATURE_READ_WINDOW_ROWS) -> Iterator[list[T]]:
    """ITEMS in order, in lists of at most MAX_ITEMS whose SIZEs sum to at most MAX_BYTES (an
    item larger than that alone): what an export reads at once."""
    window: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if window and (len(window) >= max_items or total + n > max_bytes):
            yield window
            window, total = [], 0
        window.append(item)
        total += n
    if window:
        yield window


def capture_entries(store: FeatureStore, run: str, manifest: FeatureManifest | LogprobsManifest) -> Iterator[IndexEntry]:
    """Every index entry of RUN's shards in STORE of MANIFEST's capture, in shard order. For the
    hidden states' manifest a shard of another capture raises FeatureError naming it (the run's
    log-probability tables', logprobs.py, are passed over: they are not hidden states); for the
    tables' manifest every other shard is passed over (the hidden states')."""
    tables = manifest if isinstance(manifest, LogprobsManifest) else store.get_logprobs_manifest(run)
    for shard in store.list_shards(run):
        index = store.get_index(run, shard)
        if index.capture == manifest.digest:
            yield from index.entries
        elif isinstance(manifest, FeatureManifest) and (tables is None or index.capture != tables.digest):
            raise FeatureError(f"feature shard {shard} at {store.location(run)} is of capture {index.capture}, "
                               f"not the manifest's {manifest.digest}")


class StoredRows:
    """Every stored copy of a capture's rows by row id, in shard name order (a job redone after a
    crash may have stored its row twice)."""

    def __init__(self, entries: Iterable[IndexEntry]) -> None:
        self.by_row: dict[str, list[IndexEntry]] = {}
        for entry in entries:
            self.by_row.setdefault(entry.row, []).append(entry)

    @property
    def duplicates(self) -> int:
        """The copies but the first."""
        return sum(len(v) - 1 for v in self.by_row.values())

    def first(self) -> dict[str, IndexEntry]:
        """Each row's first copy (in shard name order)."""
        return {row: copies[0] for row, copies in self.by_row.items()}


class FeatureReader:
    """A run's captured features in its output store: the manifest, every shard's index (those
    of another capture refused), and any row by its id. A row stored twice (a job redone after a
    crash) is read from the first shard in name order; `duplicates` counts the others."""

    def __init__(self, store: FeatureStore, run: str) -> None:
        self.store = store
        self.run = run
        manifest = store.get_manifest(run)
        if manifest is None:
            raise FeatureError(f"no capture manifest at {store.location(run)}")
        self.manifest: FeatureManifest = manifest
        stored = StoredRows(capture_entries(store, run, manifest))
        self.entries: dict[str, IndexEntry] = stored.first()
        self.duplicates = stored.duplicates

    def row(self, row: str) -> FeatureRow:
        """ROW's features. Raises KeyError when it has none, FeatureCorruptError."""
        entry = self.entries[row]
        return read_row(self.store.read_range(self.run, entry.shard), entry, capture=self.manifest.digest)

    def rows(self, rows: Iterable[str]) -> dict[str, FeatureRow | FeatureCorruptError]:
        """Each of ROWS' features (or why it is unreadable), read together (read_entries); rows
        without features are not in it."""
        return read_by_id(self.store, self.run, self.entries, rows,
                          lambda data, e: check_row(data, e, capture=self.manifest.digest))
