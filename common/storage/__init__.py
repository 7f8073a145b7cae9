"""Where result shards are stored, and the one rule that names them.

    store_for(output)  -> LocalStore (a directory or shared mount) or S3Store (s3://bucket/prefix)
    probe_output(output, run)  -> None, or OutputProbeError: the output cannot be written and read back

The consumer ships sealed shards through a store; `producer export` lists and opens them
through the same one. The S3 implementation lives in `genqueue.common.storage.s3` and is
imported only for s3:// outputs (boto3 takes a noticeable moment to import).
"""

from __future__ import annotations

from genqueue.common.storage.base import (
    OutputMissingError,
    OutputProbeError,
    OutputStore,
    PackNotFoundError,
    PackStore,
    ProbeCause,
    SealedShard,
    ShardInfo,
    ShardStore,
    StoreError,
    parse_manifest,
    read_manifest,
)
from genqueue.common.storage.local import LocalStore
from genqueue.common.storage.names import (
    PackName,
    ShardName,
    manifest_name,
    pack_name,
    packs_prefix,
    parse_pack_name,
    parse_shard_name,
    run_settings_name,
    shard_name,
    shard_of_manifest,
    shards_prefix,
)

__all__ = ["LocalStore", "OutputMissingError", "OutputProbeError", "OutputStore", "PackName", "PackNotFoundError", "PackStore", "ProbeCause",
           "SealedShard", "ShardInfo", "ShardName", "ShardStore", "StoreError",
           "manifest_name", "pack_name", "packs_prefix", "parse_manifest", "parse_pack_name", "parse_shard_name", "probe_output", "read_manifest", "run_settings_name",
           "shard_name", "shard_of_manifest", "shards_prefix", "store_for"]


def store_for(output: str, *, tmpdir: str | None = None) -> OutputStore:
    """The store of a run whose output setting is OUTPUT: S3 for s3://bucket/prefix, else a
    directory. TMPDIR is where an S3 store puts the files it downloads for reading."""
    if output.startswith("s3://"):
        from genqueue.common.storage.s3 import S3Store

        return S3Store.from_url(output, tmpdir=tmpdir)
    return LocalStore(output)


def probe_output(output: str, run: str) -> None:
    """Prove RUN's OUTPUT can be written and read back (ShardStore.probe), before anything is
    queued (`producer enqueue`) or generated (each consumer's pre-flight): one probe, nothing
    left behind. Raises OutputProbeError: one line with the output, the cause and the fix.
    Blocking (S3 calls): the consumer runs it in a thread."""
    store_for(output).probe(run)
