"""The teacher's distribution per generated token (`--logprobs K`): top-K tables stored as rows of
the feature store, beside (never inside) hidden-state rows.

What a table row reads back as (`LogprobsTable`; `LogprobsReader.row`, `read_table`), for an
answer of T generated tokens at a run's K:

    sampled_ids       int32   [T]     the token the engine generated at each position: the
                                      answer's completion token ids, in order
    sampled_logprobs  float32 [T]     that token's log-probability
    topk_ids          int32   [T, K]  the K most likely ids at each position, most likely first
    topk_logprobs     float32 [T, K]  their log-probabilities, sorted descending (ties in any order)

Position t is the distribution the engine sampled completion token t from (its prompt is the
conversation so far plus completion tokens 0..t-1). The values are what the engine's
`--logprobs-mode` gives (the manifest names it; `raw_logprobs`, vLLM's default, is the model's
own log-softmax before temperature and the other sampling processors), as vLLM's OpenAI server
returns them: a log-probability below -9999 reads as -9999.

Stored (safetensors, one file a row, framed in a feature shard as hidden-state rows are):

    sampled_ids I32 [T], sampled_logprobs F16 [T], topk_ids I32 [T, K], topk_logprobs F16 [T, K]
    __metadata__  format, version, row, kind "logprobs", k, capture (the manifest's digest)

so a token costs 6 x (K + 1) bytes (126 B at K = 20, 774 B at K = 128) and a row ~300 B more.
Ids are int32 (vocabularies pass 65,536). Values are IEEE fp16: a log-probability x comes back
within |x| x 2**-11 (half an ulp of an 11-bit significand), 0.005 at x = -10, a relative error of
0.5 % on a probability of 4.5e-5; bf16 (2**-8) is 8 times coarser for the same two bytes, and
8-bit codes with a scale (DistillKit's) save one byte a value at ~30 times the error. fp16's
range (to -65504) holds vLLM's floor of -9999, and rounding is monotone, so a sorted table stays
sorted. A row is checked before it is stored (`check_table`): the sampled ids are the answer's
completion ids, every table has K entries sorted descending, nothing is NaN, and in a
log-probability mode no value is above 0 and a table's probabilities sum to at most 1 + SUM_EPS.

The run's manifest for its tables (`LogprobsManifest`: model, K, mode, temperature, value dtype)
is stored once as `<run>/features/logprobs.json`, beside the hidden states' `manifest.json`;
every table shard's header and index name its digest, so hidden-state readers never take a
table shard for one of theirs.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from genqueue.common.errors import FeatureCorruptError, FeatureError, FeatureManifestConflictError, FeatureValueError
from genqueue.common.logprobs import LogprobsMode

if TYPE_CHECKING:
    from genqueue.common.features.shard import IndexEntry
    from genqueue.common.features.store import FeatureStore

FORMAT = "genqueue-logprobs"
FORMAT_VERSION = "1"
KIND = "logprobs"
#: Where a run's table manifest is kept, in its features folder.
MANIFEST_NAME = "logprobs.json"
#: A table's probabilities may sum past 1 by this much (float32 arithmetic in the engine).
SUM_EPS = 1e-3
#: A log-probability may be above 0 by this much (float32 rounding of a probability of ~1).
ZERO_EPS = 1e-4

SAMPLED_IDS = "sampled_ids"
SAMPLED_LOGPROBS = "sampled_logprobs"
TOPK_IDS = "topk_ids"
TOPK_LOGPROBS = "topk_logprobs"
_LENGTH = struct.Struct("<Q")

Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]
ReadRange = Callable[[int, int], bytes]


class TableDtype(StrEnum):
    """How a table's values are stored."""

    FP16 = "fp16"

    @property
    def safetensors(self) -> str:
        return "F16"


@dataclass(frozen=True, slots=True)
class LogprobsManifest:
    """The tables' recipe: MODEL (the served name), K entries a table, the engine's MODE, the
    run's TEMPERATURE (None: the engine's default) and the stored value dtype."""

    model: str
    k: int
    mode: LogprobsMode
    temperature: float | None
    genqueue_version: str
    values: TableDtype = TableDtype.FP16
    format: str = FORMAT
    format_version: str = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.k < 1:
            raise FeatureError(f"a log-probability table has at least one entry: k = {self.k}")

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): the same manifest gives the same bytes."""
        body: dict[str, Any] = asdict(self)
        body["mode"], body["values"] = self.mode.value, self.values.value
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def identity(self) -> bytes:
        """The canonical JSON less the genqueue version: what makes two table captures one."""
        body = json.loads(self.to_json())
        body.pop("genqueue_version", None)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        """sha256 of the identity, first 16 hex: what shards and rows name the capture by."""
        return hashlib.sha256(self.identity()).hexdigest()[:16]

    @classmethod
    def from_json(cls, raw: bytes) -> LogprobsManifest:
        """A manifest to_json wrote. Raises FeatureError for anything else."""
        try:
            body = json.loads(raw)
            if body.get("format") != FORMAT or body.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"not a {FORMAT} {FORMAT_VERSION} manifest")
            t = body["temperature"]
            return cls(model=str(body["model"]), k=int(body["k"]), mode=LogprobsMode(body["mode"]),
                       temperature=None if t is None else float(t), genqueue_version=str(body["genqueue_version"]),
                       values=TableDtype(body["values"]))
        except FeatureError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FeatureError(f"unreadable log-probability manifest: {e}") from None


def is_logprobs_manifest(raw: bytes) -> bool:
    """Whether RAW is a table manifest's JSON (by its format), not a hidden-state capture's."""
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("format") == FORMAT


def check_logprobs_manifest(where: str, stored: bytes, manifest: LogprobsManifest) -> None:
    """Raise FeatureManifestConflictError when the table manifest STORED at WHERE is not MANIFEST."""
    if stored == manifest.to_json():
        return
    try:
        theirs = LogprobsManifest.from_json(stored)
        if theirs.identity() == manifest.identity():
            return  # the same tables, stored by another genqueue release
        other = theirs.to_json().decode()
    except FeatureError:
        other = "an unreadable one"
    raise FeatureManifestConflictError(f"{where} holds other log-probability tables ({other}); these are "
                                       f"{manifest.to_json().decode()}: capture into another run or output")


@dataclass(frozen=True, slots=True)
class LogprobsTable:
    """One answer's tables (the module's docstring gives the shapes and their meaning)."""

    sampled_ids: Int32Array
    sampled_logprobs: Float32Array
    topk_ids: Int32Array
    topk_logprobs: Float32Array

    @property
    def tokens(self) -> int:
        return int(self.sampled_ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.topk_ids.shape[1])

    @classmethod
    def of(cls, sampled_ids: npt.ArrayLike, sampled_logprobs: npt.ArrayLike, topk_ids: npt.ArrayLike,
           topk_logprobs: npt.ArrayLike) -> LogprobsTable:
        """A table from lists or arrays, in its dtypes and shapes. Raises FeatureValueError for
        shapes that do not fit ([T], [T], [T, K], [T, K]) or ids out of int32's range."""
        ids, lps = np.asarray(sampled_ids), np.asarray(sampled_logprobs, dtype=np.float64)
        tids, tlps = np.asarray(topk_ids), np.asarray(topk_logprobs, dtype=np.float64)
        if ids.ndim != 1 or ids.shape[0] < 1 or lps.shape != ids.shape:
            raise FeatureValueError(f"a table needs sampled ids and log-probabilities [T], T >= 1; got "
                                    f"{list(ids.shape)} and {list(lps.shape)}")
        if tids.ndim != 2 or tids.shape[0] != ids.shape[0] or tids.shape[1] < 1 or tlps.shape != tids.shape:
            raise FeatureValueError(f"top-k ids and log-probabilities must be [{ids.shape[0]}, K]; got "
                                    f"{list(tids.shape)} and {list(tlps.shape)}")
        for name, a in (("sampled", ids), ("top-k", tids)):
            if a.size and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() > np.iinfo(np.int32).max):
                raise FeatureValueError(f"{name} token ids must be integers in [0, 2**31); got {a.dtype}")
        return cls(ids.astype(np.int32), lps.astype(np.float32), tids.astype(np.int32), tlps.astype(np.float32))


def bytes_per_token(k: int) -> int:
    """Bytes a generated token's tables take in a shard at K (a row adds its header and frame)."""
    return (k + 1) * (4 + 2)


def check_table(table: LogprobsTable, *, k: int, mode: LogprobsMode, expected_ids: list[int] | None) -> None:
    """Raise FeatureValueError naming the first position where TABLE is not what a run of K in
    MODE keeps: sampled ids other than EXPECTED_IDS (the answer's completion ids), a table of
    another width, a NaN, a table not sorted descending, and in a log-probability mode a value
    above 0 or probabilities summing past 1 + SUM_EPS."""
    if expected_ids is not None:
        found = table.sampled_ids.tolist()
        if found != expected_ids:
            n = min(len(found), len(expected_ids))
            at = next((i for i in range(n) if found[i] != expected_ids[i]), n)
            raise FeatureValueError(
                f"sampled token {at} is id {found[at]}, the answer's is {expected_ids[at]}" if at < n else
                f"{len(found)} sampled tokens, the answer has {len(expected_ids)} completion ids")
    if table.k != k:
        raise FeatureValueError(f"tables of {table.k} entries, the run asks for {k}")
    for name, a in (("sampled log-probability", table.sampled_logprobs), ("top-k log-probability", table.topk_logprobs)):
        nan_at = np.argwhere(np.isnan(a))
        if nan_at.size:
            raise FeatureValueError(f"{name} at token {int(nan_at[0][0])} is NaN")
    unsorted = np.flatnonzero(np.any(np.diff(table.topk_logprobs, axis=1) > 0, axis=1))
    if unsorted.size:
        raise FeatureValueError(f"the table of token {int(unsorted[0])} is not sorted descending")
    if not mode.probabilities:
        return
    for name, a in (("sampled log-probability", table.sampled_logprobs), ("top-k log-probability", table.topk_logprobs)):
        over = np.argwhere(a > ZERO_EPS)
        if over.size:
            raise FeatureValueError(f"{name} at token {int(over[0][0])} is above 0")
    total = np.exp(table.topk_logprobs.astype(np.float64)).sum(axis=1)
    past = np.flatnonzero(total > 1 + SUM_EPS)
    if past.size:
        raise FeatureValueError(f"the table of token {int(past[0])} sums to probability {total[past[0]]:.6f} > 1")


def pack_table(row: str, capture: str, table: LogprobsTable) -> bytes:
    """The safetensors bytes of ROW's TABLE, of the capture whose digest is CAPTURE."""
    if not row:
        raise FeatureValueError("a row id is not empty")
    t, k = table.tokens, table.k
    tensors = [(SAMPLED_IDS, "I32", [t], table.sampled_ids.astype("<i4").tobytes()),
               (SAMPLED_LOGPROBS, "F16", [t], table.sampled_logprobs.astype("<f2").tobytes()),
               (TOPK_IDS, "I32", [t, k], np.ascontiguousarray(table.topk_ids, dtype="<i4").tobytes()),
               (TOPK_LOGPROBS, "F16", [t, k], np.ascontiguousarray(table.topk_logprobs).astype("<f2").tobytes())]
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "version": FORMAT_VERSION, "row": row, "kind": KIND,
                                               "k": str(k), "capture": capture}}
    at = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
        at += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(_LENGTH.size + len(head)) % 8)
    return b"".join([_LENGTH.pack(len(head)), head, *(x[3] for x in tensors)])


_NUMPY: dict[str, np.dtype[Any]] = {"I32": np.dtype("<i4"), "F16": np.dtype("<f2")}
_SPEC = {SAMPLED_IDS: ("I32", 1), SAMPLED_LOGPROBS: ("F16", 1), TOPK_IDS: ("I32", 2), TOPK_LOGPROBS: ("F16", 2)}


@dataclass(frozen=True, slots=True)
class StoredTable:
    """A table row as unpacked: its id, its capture's digest and the table."""

    row: str
    capture: str
    table: LogprobsTable


def is_table_row(blob: bytes | memoryview) -> bool:
    """Whether BLOB is a row pack_table wrote (by its metadata's format), not a hidden-state row."""
    try:
        (size,) = _LENGTH.unpack_from(blob)
        meta = json.loads(bytes(memoryview(blob)[_LENGTH.size:_LENGTH.size + size])).get("__metadata__", {})
        return bool(meta.get("format") == FORMAT)
    except (struct.error, ValueError, AttributeError):
        return False


def unpack_table(blob: bytes | memoryview) -> StoredTable:
    """The row pack_table made. Raises FeatureValueError for any other bytes."""
    view = memoryview(blob)
    try:
        (size,) = _LENGTH.unpack_from(view)
        if _LENGTH.size + size > len(view):
            raise ValueError(f"header of {size} bytes in a row of {len(view)}")
        header = json.loads(bytes(view[_LENGTH.size:_LENGTH.size + size]))
        meta = header.pop("__metadata__")
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION or meta.get("kind") != KIND:
            raise ValueError(f"not a {FORMAT} {FORMAT_VERSION} row: {meta.get('format')} {meta.get('version')}")
        if set(header) != set(_SPEC):
            raise ValueError(f"tensors {sorted(header)}, not {sorted(_SPEC)}")
        data = view[_LENGTH.size + size:]
        arrays: dict[str, npt.NDArray[Any]] = {}
        for name, spec in header.items():
            dtype, ndim = _SPEC[name]
            start, end = (int(v) for v in spec["data_offsets"])
            shape = tuple(int(n) for n in spec["shape"])
            item = _NUMPY[dtype]
            if spec["dtype"] != dtype or len(shape) != ndim or not 0 <= start <= end <= len(data) \
                    or end - start != int(np.prod(shape, dtype=np.int64)) * item.itemsize:
                raise ValueError(f"tensor {name} {spec['dtype']} {list(shape)} at [{start}, {end}) does not fit")
            arrays[name] = np.frombuffer(data[start:end], dtype=item).reshape(shape)
        table = LogprobsTable.of(arrays[SAMPLED_IDS], arrays[SAMPLED_LOGPROBS], arrays[TOPK_IDS], arrays[TOPK_LOGPROBS])
        if table.k != int(meta["k"]):
            raise ValueError(f"tables of {table.k} entries in a row of k = {meta['k']}")
        return StoredTable(str(meta["row"]), str(meta["capture"]), table)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, FeatureValueError) as e:
        raise FeatureValueError(f"not a log-probability row: {e}") from None


def read_table(read_range: ReadRange, entry: IndexEntry, *, capture: str | None = None) -> LogprobsTable:
    """The table ENTRY names, read alone through READ_RANGE(offset, length) and checked: its
    crc32, its layout, its row id, tokens and K against the entry (and CAPTURE, a manifest's
    digest, when given). Raises FeatureCorruptError naming the row, shard and offset."""
    data = read_range(entry.offset, entry.length)

    def bad(reason: str) -> FeatureCorruptError:
        return FeatureCorruptError(entry.row, entry.shard, entry.offset, reason)

    if len(data) != entry.length:
        raise bad(f"{len(data)} bytes read of {entry.length}")
    if (crc := zlib.crc32(data)) != entry.crc32:
        raise bad(f"crc32 {crc:08x}, the index says {entry.crc32:08x}")
    try:
        stored = unpack_table(data)
    except FeatureValueError as e:
        raise bad(str(e)) from None
    if stored.row != entry.row:
        raise bad(f"the stored row is {stored.row!r}")
    if (stored.table.tokens, stored.table.k) != (entry.tokens, entry.hidden):
        raise bad(f"{stored.table.tokens} tokens x {stored.table.k} stored, the index says "
                  f"{entry.tokens} x {entry.hidden}")
    if capture is not None and stored.capture != capture:
        raise bad(f"a row of capture {stored.capture}, not {capture}")
    return stored.table


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
        self.entries: dict[str, IndexEntry] = {}
        self.duplicates = 0
        for shard in store.list_shards(run):
            index = store.get_index(run, shard)
            if index.capture != manifest.digest:
                continue
            for entry in index.entries:
                if entry.row in self.entries:
                    self.duplicates += 1
                else:
                    self.entries[entry.row] = entry

    def row(self, row: str) -> LogprobsTable:
        """ROW's tables. Raises KeyError when it has none, FeatureCorruptError."""
        entry = self.entries[row]
        return read_table(self.store.read_range(self.run, entry.shard), entry, capture=self.manifest.digest)

    def rows(self) -> Iterator[tuple[str, LogprobsTable]]:
        """Every row's id and tables, in shard order (one read per row)."""
        by_shard: dict[str, ReadRange] = {}
        for row, entry in self.entries.items():
            read = by_shard.get(entry.shard)
            if read is None:
                read = by_shard[entry.shard] = self.store.read_range(self.run, entry.shard)
            yield row, read_table(read, entry, capture=self.manifest.digest)
