"""Where a run's feature shards are stored: the run's own output (a directory or S3), beside its
result shards, under `<run>/features/` (names.py).

Shipping a feature shard has the shape shipping a result shard has (common/storage): a put of a
sealed, fsynced spool file, verified, and then the small file that vouches for it (the shard's
index here, a result shard's manifest there), so an index that exists names a complete shard.

    feature_store_for(output)  -> LocalFeatureStore (a directory) or S3FeatureStore (s3://bucket/prefix)

Blocking (disk and S3 calls): run them in a thread. The S3 side lives in features/s3.py and is
imported only for s3:// outputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from genqueue.common.features.manifest import FeatureManifest
from genqueue.common.features.names import MANIFEST, features_prefix, index_name, shard_of_index
from genqueue.common.features.shard import ReadRange, SealedFeatureShard, ShardIndex, file_range, pread_all
from genqueue.common.features.tables import MANIFEST_NAME as LOGPROBS_MANIFEST
from genqueue.common.features.tables import LogprobsManifest, check_any_manifest, manifest_name
from genqueue.common.storage.base import StoreError
from genqueue.common.storage.local import READ_BUFFER, fsync_dir, fsync_file


class FeatureStore(Protocol):
    """A run's output location, for its features."""

    def location(self, run: str) -> str:
        """Where RUN's features are, for messages."""
        ...

    def put_shard(self, shard: SealedFeatureShard) -> str:
        """Copy SHARD in, verify it against its sha256, then write its index; returns where it
        went. Raises on any failure (nothing that depends on the shard being stored goes on)."""
        ...

    def put_manifest(self, run: str, manifest: FeatureManifest | LogprobsManifest) -> str:
        """Store RUN's capture manifest (its hidden states' or its log-probability tables'), once:
        the same one again is no change; another raises FeatureManifestConflictError."""
        ...

    def get_manifest(self, run: str) -> FeatureManifest | None:
        """RUN's capture manifest, or None. Raises StoreError, FeatureError."""
        ...

    def get_logprobs_manifest(self, run: str) -> LogprobsManifest | None:
        """RUN's log-probability tables' manifest, or None. Raises StoreError, FeatureError."""
        ...

    def list_shards(self, run: str) -> list[str]:
        """RUN's feature shards that have an index (the complete ones), in name order."""
        ...

    def get_index(self, run: str, shard: str) -> ShardIndex:
        """The index of RUN's feature shard SHARD. Raises StoreError, FeatureError."""
        ...

    def read_range(self, run: str, shard: str) -> ReadRange:
        """Reads of byte ranges of RUN's feature shard SHARD (each its own read or ranged GET)."""
        ...

    def read_spans(self, run: str, shard: str, spans: Sequence[tuple[int, int]]) -> Iterator[bytes]:
        """The bytes of each (offset, length) of SPANS of RUN's feature shard SHARD, in turn: one
        ranged GET each from S3, one open of the file on disk. Fewer bytes than asked where the
        shard ends. Raises StoreError."""
        ...


class LocalFeatureStore:
    """`<root>/<run>/features/` in a directory (local disk, or a mount every node shares)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def dir(self, run: str) -> Path:
        return self.root / features_prefix(run)

    def location(self, run: str) -> str:
        return str(self.dir(run))

    def put_shard(self, shard: SealedFeatureShard) -> str:
        d = self.dir(shard.run)
        d.mkdir(parents=True, exist_ok=True)
        dest = d / shard.name
        tmp = d / f".{shard.name}.{os.getpid()}.tmp"
        try:
            digest = _copy_hashed(shard.path, tmp)
            if digest != shard.sha256:
                raise StoreError(f"spool file {shard.path} changed since it was sealed (sha256 {digest}, "
                                 f"sealed as {shard.sha256})")
            fsync_file(tmp)
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        _put_whole(d / index_name(shard.name), shard.index.to_json())
        fsync_dir(d)
        return str(dest)

    def put_manifest(self, run: str, manifest: FeatureManifest | LogprobsManifest) -> str:
        d = self.dir(run)
        d.mkdir(parents=True, exist_ok=True)
        name = manifest_name(manifest)
        dest = d / name
        tmp = d / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(manifest.to_json())
        try:
            fsync_file(tmp)
            os.link(tmp, dest)  # create-if-absent: two writers never replace each other's
            fsync_dir(d)
        except FileExistsError:
            check_any_manifest(str(dest), dest.read_bytes(), manifest)
        finally:
            os.remove(tmp)
        return str(dest)

    def get_manifest(self, run: str) -> FeatureManifest | None:
        path = self.dir(run) / MANIFEST
        try:
            return FeatureManifest.from_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror}") from None

    def get_logprobs_manifest(self, run: str) -> LogprobsManifest | None:
        path = self.dir(run) / LOGPROBS_MANIFEST
        try:
            return LogprobsManifest.from_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror}") from None

    def list_shards(self, run: str) -> list[str]:
        d = self.dir(run)
        try:
            return sorted(s for e in os.scandir(d) if e.is_file() and (s := shard_of_index(e.name)) is not None)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"cannot list {d}: {e.strerror}") from None

    def get_index(self, run: str, shard: str) -> ShardIndex:
        path = self.dir(run) / index_name(shard)
        try:
            return ShardIndex.from_json(path.read_bytes())
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror}") from None

    def read_range(self, run: str, shard: str) -> ReadRange:
        return file_range(self.dir(run) / shard)

    def read_spans(self, run: str, shard: str, spans: Sequence[tuple[int, int]]) -> Iterator[bytes]:
        path = self.dir(run) / shard
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror}") from None
        try:
            for offset, length in spans:
                yield pread_all(fd, offset, length)
        finally:
            os.close(fd)


def _copy_hashed(src: Path, dest: Path) -> str:
    """Copy SRC to DEST; the sha256 of the bytes copied."""
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        while chunk := fin.read(READ_BUFFER):
            h.update(chunk)
            fout.write(chunk)
    return h.hexdigest()


def _put_whole(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    fsync_file(tmp)
    os.replace(tmp, path)


def feature_store_for(output: str, *, tmpdir: str | None = None) -> FeatureStore:
    """The feature store of a run whose output setting is OUTPUT (common.storage.store_for's
    rule): S3 for s3://bucket/prefix, else a directory."""
    if output.startswith("s3://"):
        from genqueue.common.features.s3 import S3FeatureStore
        from genqueue.common.storage.s3 import S3Store

        return S3FeatureStore(S3Store.from_url(output, tmpdir=tmpdir))
    return LocalFeatureStore(output)
