"""Features for a drafter's trainer: the target's hidden states and the teacher's top-K
log-probability tables of each answer, stored as rows a trainer reads without genqueue.

    codec      [tokens, layers, hidden] -> fp8 e4m3 with a float32 scale per token (or bf16) and
               back to float32; bytes_per_token; the error each dtype may carry
    row        one row as a complete safetensors file (what speculators' fp8 connector writes)
    logprobs   a top-K table row (`--logprobs K`) read back and checked; tables: its bytes
    shard      many rows in one append-only shard of checked frames, each durable before its
               entry is returned; the shard's index by row id
    scan       a shard read from its bytes alone: the index rebuilt, a crash's leftovers sealed
    store, s3  feature shards put in the run's output (a directory or S3) as result shards are
    read       one row read back by its id and checked, without reading its shard; an export's
               rows grouped by shard and read in few large reads
    manifest   the capture: model, revision, layer ids, dtype, hidden size, template, versions
    names      every name of a run's feature files;  standin  the stand-in engine's features

A row is read with a seek (or a ranged GET) and `safetensors.torch.load(data)`, checked alone by
its frame's crc32 (shard.py has the layout); why this format: docs/decisions.md, "Feature rows
are safetensors files in framed shards".
"""

from __future__ import annotations

from genqueue.common.features.codec import (
    BF16_ERROR,
    FP8_ERROR,
    EncodedFeatures,
    ErrorBound,
    FeatureDtype,
    bytes_per_token,
    encode,
    error_bound,
)
from genqueue.common.features.manifest import FeatureManifest
from genqueue.common.features.read import FeatureReader, read_row
from genqueue.common.features.row import FeatureRow, pack_row, unpack_row
from genqueue.common.features.scan import leftover_feature_shards, scan
from genqueue.common.features.shard import FeatureShardWriter, IndexEntry, SealedFeatureShard, ShardIndex
from genqueue.common.features.standin import standin_features, standin_vector
from genqueue.common.features.store import FeatureStore, LocalFeatureStore, feature_store_for

__all__ = ["BF16_ERROR", "FP8_ERROR", "EncodedFeatures", "ErrorBound", "FeatureDtype", "FeatureManifest",
           "FeatureReader", "FeatureRow", "FeatureShardWriter", "FeatureStore", "IndexEntry", "LocalFeatureStore",
           "SealedFeatureShard", "ShardIndex", "bytes_per_token", "encode", "error_bound", "feature_store_for",
           "leftover_feature_shards", "pack_row", "read_row", "scan", "standin_features", "standin_vector",
           "unpack_row"]
