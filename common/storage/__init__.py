"""Where result shards are stored, and the one rule that names them.

    store_for(output)  -> LocalStore (a directory or shared mount) or S3Store (s3://bucket/prefix)

The consumer ships sealed shards through a store; `producer export` lists and opens them
through the same one. The S3 implementation lives in `genqueue.common.storage.s3` and is
imported only for s3:// outputs (boto3 takes a noticeable moment to import).
"""

from __future__ import annotations

from genqueue.common.storage.base import (
    OutputStore,
    SealedShard,
    ShardInfo,
    ShardStore,
    StoreError,
    parse_manifest,
    read_manifest,
)
from genqueue.common.storage.local import LocalStore
from genqueue.common.storage.names import (
    ShardName,
    manifest_name,
    parse_shard_name,
    run_settings_name,
    shard_name,
    shard_of_manifest,
    shards_prefix,
)

__all__ = ["LocalStore", "OutputStore", "SealedShard", "ShardInfo", "ShardName", "ShardStore", "StoreError",
           "manifest_name", "parse_manifest", "parse_shard_name", "read_manifest", "run_settings_name", "shard_name",
           "shard_of_manifest", "shards_prefix", "store_for"]


def store_for(output: str, *, tmpdir: str | None = None) -> OutputStore:
    """The store of a run whose output setting is OUTPUT: S3 for s3://bucket/prefix, else a
    directory. TMPDIR is where an S3 store puts the files it downloads for reading."""
    if output.startswith("s3://"):
        from genqueue.common.storage.s3 import S3Store

        return S3Store.from_url(output, tmpdir=tmpdir)
    return LocalStore(output)
