"""A run's features in S3: `<prefix>/<run>/features/` of the run's own output (names.py).

Rides on the result shards' S3Store (common/storage/s3.py) for its client, its location and its
transfer settings (multipart sizes, concurrency), so features go where the results go, with the
same credentials and endpoint. A shard is uploaded as a result shard is (ChecksumAlgorithm
SHA256, the server checks each part; its sha256 as metadata), then verified by a HEAD (size,
sha256, the server's own checksum), and only then is its index put: an index that exists names
a complete shard. A row is read by a ranged GET of its bytes alone, and an export's rows by one
ranged GET of a span of many (read.py read_entries).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from genqueue.common.errors import FeatureError
from genqueue.common.features.manifest import FeatureManifest
from genqueue.common.features.names import MANIFEST, features_prefix, index_name, shard_of_index
from genqueue.common.features.shard import ReadRange, SealedFeatureShard, ShardIndex
from genqueue.common.features.tables import MANIFEST_NAME as LOGPROBS_MANIFEST
from genqueue.common.features.tables import LogprobsManifest, check_any_manifest, manifest_name
from genqueue.common.storage.base import StoreError
from genqueue.common.storage.s3 import S3Store


class S3FeatureStore:
    """Feature shards, their indexes and the capture manifest under s3://bucket/prefix/<run>/features/."""

    def __init__(self, results: S3Store) -> None:
        self.results = results
        self.loc = results.loc

    @property
    def client(self) -> Any:
        return self.results.client

    def key(self, run: str, name: str) -> str:
        return self.loc.key(features_prefix(run), name)

    def location(self, run: str) -> str:
        return self.loc.url(self.loc.key(features_prefix(run))) + "/"

    def put_shard(self, shard: SealedFeatureShard) -> str:
        key = self.key(shard.run, shard.name)
        self.results.upload_verified(shard.path, key, size=shard.bytes, sha256=shard.sha256, what="the feature shard",
                                     content_type="application/octet-stream",
                                     metadata={"rows": str(len(shard.index.entries))})
        self.client.put_object(Bucket=self.loc.bucket, Key=self.key(shard.run, index_name(shard.name)),
                               Body=shard.index.to_json(), ChecksumAlgorithm="SHA256", ContentType="application/json")
        return self.loc.url(key)

    def put_manifest(self, run: str, manifest: FeatureManifest | LogprobsManifest) -> str:
        key = self.key(run, manifest_name(manifest))
        stored = self._get(key)
        if stored is None:
            self.client.put_object(Bucket=self.loc.bucket, Key=key, Body=manifest.to_json(),
                                   ChecksumAlgorithm="SHA256", ContentType="application/json")
            stored = self._get(key)  # two writers at once: the one that landed is the capture
        check_any_manifest(self.loc.url(key), stored or b"", manifest)
        return self.loc.url(key)

    def get_manifest(self, run: str) -> FeatureManifest | None:
        raw = self._get(self.key(run, MANIFEST))
        return None if raw is None else FeatureManifest.from_json(raw)

    def get_logprobs_manifest(self, run: str) -> LogprobsManifest | None:
        raw = self._get(self.key(run, LOGPROBS_MANIFEST))
        return None if raw is None else LogprobsManifest.from_json(raw)

    def list_shards(self, run: str) -> list[str]:
        prefix = self.loc.key(features_prefix(run)) + "/"
        try:
            names = [obj["Key"][len(prefix):]
                     for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.loc.bucket,
                                                                                         Prefix=prefix)
                     for obj in page.get("Contents", [])]
        except (ClientError, BotoCoreError) as e:
            raise StoreError(f"cannot list {self.loc.url(prefix)}: {e}") from None
        return sorted(s for n in names if (s := shard_of_index(n)) is not None)

    def get_index(self, run: str, shard: str) -> ShardIndex:
        key = self.key(run, index_name(shard))
        raw = self._get(key)
        if raw is None:
            raise FeatureError(f"no index {self.loc.url(key)}")
        return ShardIndex.from_json(raw)

    def read_range(self, run: str, shard: str) -> ReadRange:
        key = self.key(run, shard)

        def read(offset: int, length: int) -> bytes:
            if length <= 0:
                return b""
            try:
                resp = self.client.get_object(Bucket=self.loc.bucket, Key=key,
                                              Range=f"bytes={offset}-{offset + length - 1}")
                return bytes(resp["Body"].read())
            except (ClientError, BotoCoreError) as e:
                raise StoreError(f"cannot read {self.loc.url(key)} bytes {offset}+{length}: {e}") from None
        return read

    def read_spans(self, run: str, shard: str, spans: Sequence[tuple[int, int]]) -> Iterator[bytes]:
        read = self.read_range(run, shard)
        for offset, length in spans:
            yield read(offset, length)

    def _get(self, key: str) -> bytes | None:
        try:
            return bytes(self.client.get_object(Bucket=self.loc.bucket, Key=key)["Body"].read())
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise StoreError(f"cannot read {self.loc.url(key)}: {e}") from None
        except BotoCoreError as e:
            raise StoreError(f"cannot read {self.loc.url(key)}: {e}") from None
