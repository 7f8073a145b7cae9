"""Log-probability tables as stored (pure: arrays and bytes in and out; logprobs.py describes the
shapes and the format, and reads rows back from a store).

    LogprobsManifest   the tables' recipe (model, K, mode, temperature, value dtype), kept as
                       `<run>/features/logprobs.json` beside the hidden states' manifest.json
    LogprobsTable      one answer's tables in memory
    check_table        what a table must be before it is stored
    pack_table, unpack_table   a row's safetensors bytes
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from genqueue.common.errors import FeatureError, FeatureManifestConflictError, FeatureValueError
from genqueue.common.features.manifest import FeatureManifest, check_manifest, digest_of, identity_of
from genqueue.common.features.names import MANIFEST as HIDDEN_MANIFEST_NAME
from genqueue.common.logprobs import LogprobsMode

FORMAT = "genqueue-logprobs"
FORMAT_VERSION = "1"
KIND = "logprobs"
#: Where a run's table manifest is kept, in its features folder.
MANIFEST_NAME = "logprobs.json"
#: A table's probabilities may sum past 1 by this much: float32 log-softmax and rounding (measured: under 1e-6).
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
        return identity_of(self.to_json())

    @property
    def digest(self) -> str:
        """sha256 of the identity, first 16 hex: what shards and rows name the capture by."""
        return digest_of(self.identity())

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


def manifest_name(manifest: FeatureManifest | LogprobsManifest) -> str:
    """The file MANIFEST is kept as in a run's features folder."""
    return MANIFEST_NAME if isinstance(manifest, LogprobsManifest) else HIDDEN_MANIFEST_NAME


def manifest_from_json(raw: bytes) -> FeatureManifest | LogprobsManifest:
    """A manifest of either kind from what its to_json wrote. Raises FeatureError."""
    return LogprobsManifest.from_json(raw) if is_logprobs_manifest(raw) else FeatureManifest.from_json(raw)


def check_any_manifest(where: str, stored: bytes, manifest: FeatureManifest | LogprobsManifest) -> None:
    """Raise FeatureManifestConflictError when the manifest STORED at WHERE is not MANIFEST."""
    if isinstance(manifest, LogprobsManifest):
        check_logprobs_manifest(where, stored, manifest)
    else:
        check_manifest(where, stored, manifest)
