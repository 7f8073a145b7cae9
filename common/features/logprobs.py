"""The teacher's distribution per generated token (`--logprobs K`): top-K tables stored as rows of
the feature store, beside (never inside) hidden-state rows.

What a table row reads back as (`LogprobsTable`; `LogprobsReader.row`, `read_table`), for an
answer of T generated tokens at a run's K:

    sampled_ids       int32   [T]     the token the engine generated at each position (the
                                      answer's completion token ids, in order)
    sampled_logprobs  float32 [T]     that token's log-probability
    topk_ids          int32   [T, K]  the K most likely ids at each position, most likely first
    topk_logprobs     float32 [T, K]  their log-probabilities, sorted descending (ties in any order)

Position t is the distribution completion token t was sampled from. The values are what the
engine's `--logprobs-mode` gives (the manifest names it), as vLLM's OpenAI server returns them
(below -9999 reads as -9999). Stored as safetensors rows (tables.py): ids int32, values fp16,
6 x (K + 1) bytes a token; a value comes back within |x| x 2**-11, and a sorted table stays sorted.
The tables' manifest (`LogprobsManifest`) is `<run>/features/logprobs.json`; every table shard's
header and index name its digest, so hidden-state readers never take a table shard for theirs.
Why fp16: docs/decisions.md, "Log-probability values in fp16".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from genqueue.common.errors import FeatureCorruptError, FeatureError, FeatureValueError
from genqueue.common.features.read import (
    StoredRows,
    capture_entries,
    check_frame,
    corrupt,
    read_by_id,
    read_entries,
    windows,
)
from genqueue.common.features.shard import IndexEntry, ReadRange
from genqueue.common.features.store import FeatureStore
from genqueue.common.features.tables import (
    MANIFEST_NAME,
    SUM_EPS,
    LogprobsManifest,
    LogprobsTable,
    StoredTable,
    TableDtype,
    bytes_per_token,
    check_table,
    pack_table,
    unpack_table,
)
from genqueue.common.logprobs import LogprobsMode

__all__ = ["MANIFEST_NAME", "SUM_EPS", "LogprobsManifest", "LogprobsMode", "LogprobsReader", "LogprobsTable",
           "StoredTable", "TableDtype", "bytes_per_token", "check_table", "pack_table", "read_table",
           "unpack_table"]


def check_stored_table(data: bytes, entry: IndexEntry, *, capture: str | None = None) -> LogprobsTable:
    """DATA, the bytes read of ENTRY's row, checked as the table ENTRY names: its crc32, its
    layout, its row id, tokens and K against the entry (and CAPTURE, a manifest's digest, when
    given). Raises FeatureCorruptError naming the row, shard and offset."""
    check_frame(data, entry)
    try:
        stored = unpack_table(data)
    except FeatureValueError as e:
        raise corrupt(entry, str(e)) from None
    if stored.row != entry.row:
        raise corrupt(entry, f"the stored row is {stored.row!r}")
    if (stored.table.tokens, stored.table.k) != (entry.tokens, entry.hidden):
        raise corrupt(entry, f"{stored.table.tokens} tokens x {stored.table.k} stored, the index says "
                             f"{entry.tokens} x {entry.hidden}")
    if capture is not None and stored.capture != capture:
        raise corrupt(entry, f"a row of capture {stored.capture}, not {capture}")
    return stored.table


def read_table(read_range: ReadRange, entry: IndexEntry, *, capture: str | None = None) -> LogprobsTable:
    """The table ENTRY names, read alone through READ_RANGE(offset, length) and checked
    (check_stored_table). Raises FeatureCorruptError naming the row, shard and offset."""
    return check_stored_table(read_range(entry.offset, entry.length), entry, capture=capture)


class LogprobsReader:
    """A run's log-probability tables in its output store: the manifest, the index entries of its
    table shards (shards of another capture, such as the run's hidden states, are not theirs and
    are passed over), and any row's table by its id. A row stored twice (a job redone after a
    crash) is read from the first shard in name order; `duplicates` counts the others.

        reader = LogprobsReader(feature_store_for(output), run)
        table = reader.row(row_id)       # LogprobsTable (the module's docstring)
        for row_id, table in reader.rows(): ...
    """

    def __init__(self, store: FeatureStore, run: str) -> None:
        self.store = store
        self.run = run
        manifest = store.get_logprobs_manifest(run)
        if manifest is None:
            raise FeatureError(f"no log-probability manifest at {store.location(run)}")
        self.manifest: LogprobsManifest = manifest
        stored = StoredRows(capture_entries(store, run, manifest))
        self.entries: dict[str, IndexEntry] = stored.first()
        self.duplicates = stored.duplicates

    def row(self, row: str) -> LogprobsTable:
        """ROW's tables. Raises KeyError when it has none, FeatureCorruptError."""
        entry = self.entries[row]
        return read_table(self.store.read_range(self.run, entry.shard), entry, capture=self.manifest.digest)

    def read_tables(self, rows: Iterable[str]) -> dict[str, LogprobsTable | FeatureCorruptError]:
        """Each of ROWS' tables (or why they are unreadable), read together (read.py
        read_entries: few large reads); rows without tables are not in it."""
        return read_by_id(self.store, self.run, self.entries, rows, self._check)

    def rows(self) -> Iterator[tuple[str, LogprobsTable]]:
        """Every row's id and tables, in shard order, read a window at a time. Raises
        FeatureCorruptError for the first unreadable one."""
        ordered = sorted(self.entries.values(), key=lambda e: (e.shard, e.offset))
        for window in windows(ordered, lambda e: e.length):
            got = read_entries(self.store, self.run, window, self._check)
            for entry in window:
                table = got[entry]
                if isinstance(table, FeatureCorruptError):
                    raise table
                yield entry.row, table

    def _check(self, data: bytes, entry: IndexEntry) -> LogprobsTable:
        return check_stored_table(data, entry, capture=self.manifest.digest)
