"""`producer export-features`: a run's captured hidden states, joined by id to the rows of its
tokens export, in the files a drafter's trainer reads as they are (featurelayouts.py).

The join. Each row of the tokens export (`producer export --format tokens`: id, key, turn,
step, input_ids, loss_mask) names the feature row its answer was captured under: the row's own
`features.row` when it carries one, else the consumer's rule (the item key; in mode regenerate
`<key>:<turn>` and `.<step>` after tool results: feature_row_id). A row is accepted when one of
the stored rows of that id (a job redone after a crash may have stored it twice) holds exactly
the token ids its features cover: input_ids but the last (captured during generation) or all of
them (a prefill pass), read and checked by its crc32. Every other row is counted and named, never
dropped silently: rows without features (`no_features`), rows whose stored features are of other
tokens (`tokens_differ`), and the features no row of the tokens export names (`no_row`); all
go to `genqueue-unmatched.jsonl` in the output folder.

The output folder is written whole beside its place under a hidden name and renamed into place;
a folder already there is replaced only when every file in it is one genqueue wrote and no one
changed since (outfiles.py's manifests), else refused before anything is read.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from genqueue.common.errors import FeatureCorruptError, UserError
from genqueue.common.features import FeatureRow, FeatureStore, IndexEntry, read_row
from genqueue.common.features.manifest import FeatureManifest
from genqueue.common.features.read import StoredRows, capture_entries, check_row, read_entries, windows

log = logging.getLogger(__name__)

#: Side files every layout writes beside its own.
ROWS_FILE = "genqueue-rows.jsonl"  # sample index -> the tokens row's id, its file, its feature row
UNMATCHED_FILE = "genqueue-unmatched.jsonl"
SUMMARY_FILE = "genqueue-features.json"
TOKEN_FREQ_JSON = "token_freq.json"
#: The generic layout's row table.
ROW_TABLE = "rows.parquet"
#: Unmatched rows and features the summary names per reason (all are in genqueue-unmatched.jsonl).
NAMED = 5
#: Bytes per read when the generic layout copies a feature shard (a ranged GET each from S3).
COPY_CHUNK = 8 * 1024 * 1024


class FeatureLayout(StrEnum):
    """`--layout`: whose files the export writes."""

    SPECULATORS = "speculators"
    SPECFORGE = "specforge"
    GENERIC = "generic"


class Unmatched(StrEnum):
    """Why a row or a feature is not in the export."""

    NO_FEATURES = "no_features"  # the tokens row's answer has no stored features
    TOKENS_DIFFER = "tokens_differ"  # its stored features are of other token ids
    NO_ROW = "no_row"  # stored features no row of the tokens export names


@dataclass(frozen=True, slots=True)
class TokenRow:
    """One row of the tokens export, and the feature row its answer was captured under."""

    id: str
    feature_row: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True, slots=True)
class Joined:
    """A tokens row with its features: its first TOKENS input_ids and loss_mask are the ones
    the features cover."""

    row: TokenRow
    entry: IndexEntry
    features: FeatureRow

    @property
    def tokens(self) -> int:
        return self.entry.tokens

    @property
    def input_ids(self) -> list[int]:
        return self.row.input_ids[:self.tokens]

    @property
    def loss_mask(self) -> list[int]:
        return self.row.loss_mask[:self.tokens]


@dataclass
class FeatureExportResult:
    """What an export of features did."""

    run: str
    layout: str
    output: str
    tokens_file: str
    source: str
    capture: dict[str, Any] = field(default_factory=dict)
    rows_read: int = 0
    rows_exported: int = 0
    tokens_exported: int = 0
    rows_without_features: int = 0
    rows_tokens_differ: int = 0
    features_without_rows: int = 0
    duplicate_features: int = 0
    named: dict[str, list[str]] = field(default_factory=dict)
    token_freq_ids: int = 0
    token_freq_tokens: int = 0
    files: int = 0
    bytes: int = 0
    torch_python: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every tokens row has its features."""
        return not (self.rows_without_features or self.rows_tokens_differ)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def feature_row_id(row: dict[str, Any], *, regenerate: bool) -> str | None:
    """The feature row a tokens export ROW's answer was captured under: the row's own
    `features.row`, else the consumer's naming (the item key; regenerate: `<key>:<turn>`, then
    `.<step>` after tool results). None when the row has no key (or, regenerate, no turn)."""
    ref = row.get("features")
    if isinstance(ref, dict) and isinstance(ref.get("row"), str):
        return str(ref["row"])
    key = row.get("key")
    if not isinstance(key, str) or not key:
        return None
    if not regenerate:
        return key
    turn, step = row.get("turn"), row.get("step") or 0
    if not isinstance(turn, int):
        return None
    return f"{key}:{turn}" + (f".{step}" if step else "")


def read_token_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a tokens export file: JSONL (.gz, .zst) or Parquet. Raises UserError."""
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            pf = pq.ParquetFile(path)
            for batch in pf.iter_batches(batch_size=1024):
                yield from batch.to_pylist()
            return
        with _open_text(path) as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield orjson.loads(line)
                    except orjson.JSONDecodeError:
                        raise UserError(f"--tokens {path}: line {n} is not JSON") from None
    except OSError as e:
        raise UserError(f"--tokens {path}: cannot read it: {e.strerror or e}") from None
    except pa.ArrowInvalid as e:
        raise UserError(f"--tokens {path}: not a Parquet file: {e}") from None


@contextlib.contextmanager
def _open_text(path: Path) -> Iterator[Iterable[bytes]]:
    name = path.name.lower()
    if name.endswith(".gz"):
        with gzip.open(path, "rb") as gz:
            yield gz
    elif name.endswith((".zst", ".zstd")):
        import zstandard

        with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as z:
            yield io.BufferedReader(z)
    else:
        with open(path, "rb") as fh:
            yield fh


def token_row(raw: dict[str, Any], *, regenerate: bool, path: Path) -> TokenRow:
    """RAW as a TokenRow. Raises UserError for a row that is no tokens export row."""
    rid, ids, mask = raw.get("id"), raw.get("input_ids"), raw.get("loss_mask")
    if not isinstance(rid, str) or not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise UserError(f"--tokens {path}: a row without id, or input_ids and loss_mask of one length: is it "
                        "`producer export --format tokens` output?")
    feature = feature_row_id(raw, regenerate=regenerate)
    return TokenRow(rid, feature or "", [int(x) for x in ids], [int(x) for x in mask])


class FeatureIndex:
    """Every stored row of a run's capture by its id (each copy, in shard name order)."""

    def __init__(self, store: FeatureStore, run: str) -> None:
        self.store = store
        self.run = run
        manifest = store.get_manifest(run)
        if manifest is None:
            raise UserError(f"run {run} has no captured features at {store.location(run)} (no manifest.json): "
                            "was it enqueued with --capture, and have consumers shipped any?")
        self.manifest: FeatureManifest = manifest
        self.stored = StoredRows(capture_entries(store, run, manifest))
        self.by_row: dict[str, list[IndexEntry]] = self.stored.by_row

    @property
    def duplicates(self) -> int:
        return self.stored.duplicates

    def read(self, entry: IndexEntry) -> FeatureRow:
        return read_row(self.store.read_range(self.run, entry.shard), entry, capture=self.manifest.digest)

    def read_many(self, entries: Iterable[IndexEntry]) -> dict[IndexEntry, FeatureRow | FeatureCorruptError]:
        """Each of ENTRIES' rows (or why it is unreadable), read together (read_entries: grouped by
        shard, few large reads)."""
        return read_entries(self.store, self.run, entries, self._check)

    def _check(self, data: bytes, entry: IndexEntry) -> FeatureRow:
        return check_row(data, entry, capture=self.manifest.digest)

    def copies(self, row: TokenRow) -> list[IndexEntry]:
        """The stored copies of ROW's features."""
        return self.by_row.get(row.feature_row, []) if row.feature_row else []

    def join(self, row: TokenRow) -> tuple[Joined | None, Unmatched | None, str]:
        """ROW with the first stored copy of its features whose token ids are the row's (input_ids
        but the last, or all); else why not, in words."""
        return self._join(row, self.read_many(self.copies(row)))

    def joins(self, rows: Iterable[TokenRow]) -> Iterator[tuple[TokenRow, Joined | None, Unmatched | None, str]]:
        """Each of ROWS, in order, joined as `join` does, their features read a window of rows at a
        time (read.windows) in few large reads."""
        for window in windows(rows, lambda r: sum(e.length for e in self.copies(r))):
            got = self.read_many(e for r in window for e in self.copies(r))
            for row in window:
                yield (row, *self._join(row, got))

    def _join(self, row: TokenRow, got: Mapping[IndexEntry, FeatureRow | FeatureCorruptError]
              ) -> tuple[Joined | None, Unmatched | None, str]:
        copies = self.copies(row)
        if not copies:
            return None, Unmatched.NO_FEATURES, f"no stored features of row {row.feature_row or '(no key)'}"
        why = ""
        for entry in copies:
            features = got[entry]
            if isinstance(features, FeatureCorruptError):
                why = str(features)
                continue
            ids = features.token_ids.tolist()
            if len(row.input_ids) - 1 <= len(ids) <= len(row.input_ids) and ids == row.input_ids[:len(ids)]:
                return Joined(row, entry, features), None, ""
            why = _difference(ids, row.input_ids, entry.shard)
        return None, Unmatched.TOKENS_DIFFER, why


def _difference(found: list[int], expected: list[int], shard: str) -> str:
    n = min(len(found), len(expected))
    at = next((i for i in range(n) if found[i] != expected[i]), n)
    if at < n:
        return f"features in {shard}: token {at} is id {found[at]}, the row's is {expected[at]}"
    return f"features in {shard} cover {len(found)} tokens, the row has {len(expected)} input_ids"
