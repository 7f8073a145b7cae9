"""The naming rule of a run's feature shards, spelled once.

A run's features live under `<output>/<run>/features/`, beside its `shards/`:
    manifest.json                     the capture (manifest.FeatureManifest), written once
    <worker>-<seq:06d>.gqfeat         a shard: rows one after another (shard.py)
    <worker>-<seq:06d>.index.json     its index, written after the shard is stored and verified:
                                      an index that exists vouches for a complete shard
Worker names are unique per process start (as a result shard's are), so two writers never
write the same name. A consumer's spool keeps the shard being written as
`<spool>/<run>/features/<name>.open` and sealed ones with their index in `.../features/sealed/`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

FEATURES_DIR = "features"
SHARD_SUFFIX = ".gqfeat"
INDEX_SUFFIX = ".index.json"
MANIFEST = "manifest.json"
OPEN_SUFFIX = ".open"
SEALED_DIR = "sealed"

_SHARD = re.compile(r"(?P<worker>[^/\\\x00]+)-(?P<seq>[0-9]{6,})" + re.escape(SHARD_SUFFIX))


class FeatureShardName(NamedTuple):
    worker: str
    seq: int


def feature_shard_name(worker: str, seq: int) -> str:
    """WORKER's feature shard number SEQ: `<worker>-<seq:06d>.gqfeat`."""
    if not worker or "/" in worker or "\\" in worker or "\x00" in worker:
        raise ValueError(f"not a usable worker name for a feature shard: {worker!r}")
    if seq < 0:
        raise ValueError(f"feature shard sequence numbers are not negative: {seq}")
    return f"{worker}-{seq:06d}{SHARD_SUFFIX}"


def parse_feature_shard_name(name: str) -> FeatureShardName | None:
    """The worker and sequence number of a shard NAME; None for a name feature_shard_name cannot make."""
    m = _SHARD.fullmatch(name)
    if m is None or f"{int(m['seq']):06d}" != m["seq"]:
        return None
    return FeatureShardName(m["worker"], int(m["seq"]))


def index_name(shard: str) -> str:
    """The index's name of the feature shard named SHARD."""
    if parse_feature_shard_name(shard) is None:
        raise ValueError(f"not a feature shard name: {shard!r}")
    return shard.removesuffix(SHARD_SUFFIX) + INDEX_SUFFIX


def shard_of_index(name: str) -> str | None:
    """The shard an index NAME belongs to; None when NAME is not a feature shard's index."""
    if not name.endswith(INDEX_SUFFIX):
        return None
    shard = name.removesuffix(INDEX_SUFFIX) + SHARD_SUFFIX
    return shard if parse_feature_shard_name(shard) is not None else None


def features_prefix(run: str) -> str:
    """Where RUN's features go, relative to the output: `<run>/features`."""
    return f"{run}/{FEATURES_DIR}"
