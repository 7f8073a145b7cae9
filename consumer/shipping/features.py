"""The consumer's feature shards (--capture): one open per run, sealed with the run's result shard.

A captured row is appended to its run's open feature shard (common/features/shard.py: durable
when `append` returns) before the record that names it is handed to the outbox, and the outbox
seals the run's feature shard whenever it seals the run's result shard, queueing it first. Shards
ship in order, so a result shard is stored (and its jobs acked) only after every feature shard
its records name: a record never reaches the output before its features do.

Beside the shards, the spool keeps each capture's manifest (`<spool>/<run>/features/
manifest-<digest>.json`) while a shard of it is on the spool, so the shards a crash left are
shipped with their manifest by the next consumer on the spool.

`append` runs in the capture thread, `seal` in the event loop: one lock keeps them apart.

A disk that refuses a row (full, or an I/O error) is a pause, not an error of the item: `append`
raises, `disk_error` says why until a row is stored again, and the outbox pauses admission on it
as it does on its own disk errors (the capture keeper keeps the answer waiting and tries again).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy.typing as npt

from genqueue.common.errors import FeatureError, FeatureValueError
from genqueue.common.features import (
    FeatureManifest,
    FeatureShardWriter,
    FeatureStore,
    IndexEntry,
    SealedFeatureShard,
    leftover_feature_shards,
)
from genqueue.common.features.names import FEATURES_DIR, OPEN_SUFFIX, SEALED_DIR, parse_feature_shard_name
from genqueue.common.features.shard import FEATURE_SHARD_MAX_BYTES, HEADER
from genqueue.common.features.tables import LogprobsManifest, LogprobsTable, manifest_from_json
from genqueue.common.records import Record
from genqueue.common.storage.local import fsync_dir

log = logging.getLogger(__name__)

MANIFEST_PREFIX = "manifest-"
#: A capture's recipe: its hidden states', or its log-probability tables' (one per run).
Manifest = FeatureManifest | LogprobsManifest


def disk_error_message(spool: str | Path, e: OSError) -> str:
    """What a spool disk's refusal E is, with the bytes left free, in words."""
    try:
        free = shutil.disk_usage(spool).free
    except OSError:
        free = -1
    what = "spool disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "spool disk error"
    return f"{what} ({free} bytes free): {e.strerror or e}"


class FeatureSpool:
    """The feature shards of one consumer's spool: the open one per run, and the manifests."""

    def __init__(self, spool: str, worker: str, *, max_bytes: int = FEATURE_SHARD_MAX_BYTES) -> None:
        self.spool = Path(spool)
        self.worker = worker
        self.max_bytes = max_bytes
        self.writers: dict[str, FeatureShardWriter] = {}
        self._lock = threading.Lock()
        self.disk_error: str | None = None  # why the last row was refused, until one is stored
        self._disk_error_since: float | None = None

    def _dir(self, run: str) -> Path:
        return self.spool / run / FEATURES_DIR

    def manifest_path(self, run: str, digest: str) -> Path:
        return self._dir(run) / f"{MANIFEST_PREFIX}{digest}.json"

    def append(self, run: str, manifest: FeatureManifest, row: str, token_ids: npt.ArrayLike,
               hidden: npt.ArrayLike) -> IndexEntry:
        """Store ROW of RUN's capture MANIFEST (durable when it returns). Raises FeatureValueError
        for hidden states that do not fit the capture, OSError when the disk refuses (disk_error
        says so until a row is stored)."""
        with self._lock:
            try:
                entry = self._append(run, manifest, row, token_ids, hidden)
            except OSError as e:
                self._disk_failed(e)
                raise
            if self.disk_error is not None:
                log.warning("spool %s takes feature rows again after %.1f s: resuming admission", self.spool,
                            time.monotonic() - (self._disk_error_since or time.monotonic()))
                self.disk_error = self._disk_error_since = None
            return entry

    def append_table(self, run: str, manifest: LogprobsManifest, row: str, table: LogprobsTable) -> IndexEntry:
        """Store ROW's log-probability TABLE in RUN's shard of MANIFEST, as `append` stores
        hidden states (durable when it returns; the same errors)."""
        with self._lock:
            try:
                entry = self._writer(run, manifest, row).append_table(row, table)
            except OSError as e:
                self._disk_failed(e)
                raise
            if self.disk_error is not None:
                log.warning("spool %s takes feature rows again after %.1f s: resuming admission", self.spool,
                            time.monotonic() - (self._disk_error_since or time.monotonic()))
                self.disk_error = self._disk_error_since = None
            return entry

    def _disk_failed(self, e: OSError) -> None:
        msg = disk_error_message(self.spool, e)
        if self.disk_error is None:
            self._disk_error_since = time.monotonic()
            log.error("%s; pausing admission, answers wait with their captures, leases kept; retrying", msg)
        self.disk_error = msg

    def _append(self, run: str, manifest: FeatureManifest, row: str, token_ids: npt.ArrayLike,
                hidden: npt.ArrayLike) -> IndexEntry:
        return self._writer(run, manifest, row).append(row, token_ids, hidden)

    def _writer(self, run: str, manifest: Manifest, row: str) -> FeatureShardWriter:
        w = self.writers.get(run)
        if w is None or (w.rows == 0 and w.manifest != manifest):
            seq = w.seq if w is not None else 0
            w = self.writers[run] = FeatureShardWriter(self.spool, run, self.worker, manifest,
                                                       max_bytes=self.max_bytes)
            w.seq = seq  # the names this worker used stay used
        elif w.manifest != manifest:
            raise FeatureValueError(f"row {row!r}: a capture of {manifest.to_json().decode()} while this shard "
                                    f"holds {w.manifest.to_json().decode()}")
        if w.rows == 0:
            self._keep_manifest(run, manifest)
        return w

    def _keep_manifest(self, run: str, manifest: Manifest) -> None:
        path = self.manifest_path(run, manifest.digest)
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(manifest.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def manifest_of(self, run: str, digest: str) -> Manifest | None:
        """The manifest of RUN's capture DIGEST kept on the spool; None when it is not there."""
        try:
            return manifest_from_json(self.manifest_path(run, digest).read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, FeatureError) as e:
            log.warning("capture manifest %s unreadable: %s", self.manifest_path(run, digest), e)
            return None

    def rows(self, run: str) -> int:
        """Rows in RUN's open feature shard."""
        w = self.writers.get(run)
        return w.rows if w is not None else 0

    def full(self, run: str) -> bool:
        w = self.writers.get(run)
        return w is not None and w.full

    @property
    def open_bytes(self) -> int:
        return sum(w.open_bytes for w in self.writers.values())

    def seal(self, run: str) -> SealedFeatureShard | None:
        """Seal RUN's open feature shard (None: no row since the last seal). Raises OSError."""
        with self._lock:
            w = self.writers.get(run)
            return w.seal() if w is not None else None

    def runs(self) -> list[str]:
        """Runs with rows in an open feature shard."""
        return [run for run, w in self.writers.items() if w.rows]

    def shipped(self, shard: SealedFeatureShard) -> None:
        """SHARD is stored at its run's output: drop its spool files, and its capture's manifest
        once no shard of that capture is left on the spool."""
        with self._lock:
            shard.path.unlink(missing_ok=True)
            shard.index_path.unlink(missing_ok=True)
            digest = shard.index.capture
            w = self.writers.get(shard.run)
            if w is not None and w.rows and w.capture == digest:
                return
            if any(_capture_of(p) == digest for p in _shards_on_spool(self._dir(shard.run))):
                return
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.manifest_path(shard.run, digest))

    def leftovers(self, is_dead: Callable[[str], bool]) -> list[SealedFeatureShard]:
        """The feature shards a dead consumer left on this spool, sealed (scan.py)."""
        return leftover_feature_shards(self.spool, is_dead)


class FeatureOutputs:
    """Where feature shards go: a store per output (STORE_FOR), and each capture's manifest put
    there before its first shard. Blocking: called in the shipping thread."""

    def __init__(self, spool: FeatureSpool, store_for: Callable[[str], FeatureStore]) -> None:
        self.spool = spool
        self._store_for = store_for
        self._stores: dict[str, FeatureStore] = {}
        self._manifests: set[tuple[str, str, str]] = set()  # (output, run, capture digest) put

    def put(self, output: str, shard: SealedFeatureShard) -> str:
        """Store SHARD at OUTPUT, its capture's manifest first (once), then the shard and its index;
        where it went. Raises on any failure (the caller retries)."""
        store = self._stores.get(output)
        if store is None:
            store = self._stores[output] = self._store_for(output)
        key = (output, shard.run, shard.index.capture)
        if key not in self._manifests:
            manifest = self.spool.manifest_of(shard.run, shard.index.capture)
            if manifest is None:
                log.warning("feature shard %s: the manifest of its capture %s is not on the spool; shipped without it",
                            shard.name, shard.index.capture)
            else:
                store.put_manifest(shard.run, manifest)
                self._manifests.add(key)
        return store.put_shard(shard)


def feature_shards_of(record: Record) -> set[str]:
    """The feature shards RECORD names (--capture, --logprobs: its answer's rows, or each
    regenerated turn's)."""
    names: set[str] = set()
    turns = record.get("turns")
    for answer in [record, *(turns if isinstance(turns, list) else ())]:
        for field in ("features", "logprobs"):
            ref = answer.get(field) if isinstance(answer, dict) else None
            if isinstance(ref, dict):
                names.add(ref["shard"])
    return names


def _shards_on_spool(fdir: Path) -> list[Path]:
    if not fdir.is_dir():
        return []
    found = [p for p in fdir.glob("*" + OPEN_SUFFIX)
             if parse_feature_shard_name(p.name.removesuffix(OPEN_SUFFIX)) is not None]
    sealed = fdir / SEALED_DIR
    if sealed.is_dir():
        found += [p for p in sealed.iterdir() if parse_feature_shard_name(p.name) is not None]
    return found


def _capture_of(path: Path) -> str | None:
    """The capture digest in a shard's header (None: not readable)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(HEADER.size)
    except OSError:
        return None
    if len(head) < HEADER.size:
        return None
    digest: bytes = HEADER.unpack(head)[3]
    return digest.hex()
