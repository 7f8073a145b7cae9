"""Features for a drafter's trainer: the target's hidden states of each row, stored compactly.

    codec      [tokens, layers, hidden] -> fp8 e4m3 with a float32 scale per token (or bf16) and
               back to float32; bytes_per_token; the error each dtype may carry
    row        one row as a complete safetensors file (what speculators' fp8 connector writes)
    shard      many rows in one append-only shard, each durable before its entry is returned;
               the shard's index by row id
    scan       a shard read from its bytes alone: the index rebuilt, a crash's leftovers sealed
    store      feature shards put in the run's output (a directory or S3) as result shards are
    read       one row read back by its id, checked, without reading its shard; an export's
               rows grouped by shard and read in few large reads, each checked alone
    manifest   the capture: model, revision, layer ids, dtype, hidden size, template, versions
    standin    the stand-in engine's deterministic features

The format, and why. A shard is a header and then frames, one per row: a frame is a 16-byte
header (magic, crc32, length) and the row, a complete safetensors file holding `token_ids` I64
[T], `hidden_states_scales` F32 [T, 1, 1] and `hidden_states` F8_E4M3 [T, L, H] (or BF16), with
the row id and the capture in its metadata. Beside each shard its index is JSON: row id ->
shard, offset, length, tokens, layers, hidden, dtype, crc32. So:
- a trainer without genqueue reads a row with a seek (or a ranged GET) and
  `safetensors.torch.load(data)`: the tensors, names and fp8 scales are speculators' own, and an
  export to its per-sample layout is a copy of the bytes; nothing else is needed but json;
- one row is read without reading its shard, and checked by its crc32 (zlib's: in the standard
  library and in every language a trainer uses, ~GB/s, and the packs' choice; the threat is
  a torn or flipped block, not an adversary, and a shipped shard's sha256 is checked whole);
- the frames make the shard its own index: one left open by a crash is sealed by reading it,
  its torn last row dropped (that row's job was never acked).
A Parquet file of rows was the other candidate: it needs a reader that knows nested lists of
fp8 (none does) and rewrites a file to append; a shard of one safetensors file per group of rows
cannot be appended to without rewriting its header.
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
