"""Reading a capture back: one row by its id, through its entry, without reading its shard.

Every read checks what it reads: the row's crc32 against its index entry, its safetensors
layout, and that it is the row, shape, dtype and capture the entry and the manifest say. A
mismatch raises FeatureCorruptError naming the row, the shard and the offset; nothing is skipped.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

from genqueue.common.errors import FeatureCorruptError, FeatureError
from genqueue.common.features.manifest import FeatureManifest
from genqueue.common.features.row import FeatureRow, RowFormatError, unpack_row
from genqueue.common.features.shard import IndexEntry, ReadRange
from genqueue.common.features.store import FeatureStore


def read_row(read_range: ReadRange, entry: IndexEntry, *, capture: str | None = None) -> FeatureRow:
    """The row ENTRY names, read alone through READ_RANGE(offset, length) and checked (and of
    CAPTURE, a manifest's digest, when given). Raises FeatureCorruptError."""
    data = read_range(entry.offset, entry.length)

    def bad(reason: str) -> FeatureCorruptError:
        return FeatureCorruptError(entry.row, entry.shard, entry.offset, reason)

    if len(data) != entry.length:
        raise bad(f"{len(data)} bytes read of {entry.length}")
    if (crc := zlib.crc32(data)) != entry.crc32:
        raise bad(f"crc32 {crc:08x}, the index says {entry.crc32:08x}")
    try:
        row = unpack_row(data)
    except RowFormatError as e:
        raise bad(str(e)) from None
    enc = row.encoded
    if row.row != entry.row:
        raise bad(f"the stored row is {row.row!r}")
    if (enc.tokens, enc.layers, enc.hidden, enc.dtype) != (entry.tokens, entry.layers, entry.hidden, entry.dtype):
        raise bad(f"{enc.tokens} x {enc.layers} x {enc.hidden} {enc.dtype.value} stored, the index says "
                  f"{entry.tokens} x {entry.layers} x {entry.hidden} {entry.dtype.value}")
    if capture is not None and row.capture != capture:
        raise bad(f"a row of capture {row.capture}, not {capture}")
    return row


def capture_entries(store: FeatureStore, run: str, manifest: FeatureManifest) -> Iterator[IndexEntry]:
    """Every index entry of RUN's feature shards in STORE, in shard order; a shard of another
    capture than MANIFEST raises FeatureError naming it (the run's log-probability tables',
    logprobs.py, are passed over: they are not hidden states)."""
    tables = store.get_logprobs_manifest(run)
    for shard in store.list_shards(run):
        index = store.get_index(run, shard)
        if tables is not None and index.capture == tables.digest:
            continue
        if index.capture != manifest.digest:
            raise FeatureError(f"feature shard {shard} at {store.location(run)} is of capture {index.capture}, "
                               f"not the manifest's {manifest.digest}")
        yield from index.entries


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
        self.entries: dict[str, IndexEntry] = {}
        self.duplicates = 0
        for entry in capture_entries(store, run, manifest):
            if entry.row in self.entries:
                self.duplicates += 1
            else:
                self.entries[entry.row] = entry

    def row(self, row: str) -> FeatureRow:
        """ROW's features. Raises KeyError when it has none, FeatureCorruptError."""
        entry = self.entries[row]
        return read_row(self.store.read_range(self.run, entry.shard), entry, capture=self.manifest.digest)
