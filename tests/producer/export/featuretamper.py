"""A stored feature row rewritten in place, as a bad capture would have stored it: its features
changed and encoded again in the row's dtype, the frame's bytes replaced at the same offset and
its index entry's crc32 made to match, so every read's own checks pass and only a comparison with
the model can tell. Shared by the check's default tests and the real-vLLM tier's."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from genqueue.common.features import LocalFeatureStore, encode, pack_row, unpack_row
from genqueue.common.features.names import index_name
from genqueue.common.features.shard import FRAME, ShardIndex


def rewrite_row(output: Path, run: str, row: str, change: Callable[[np.ndarray], np.ndarray]) -> str:
    """Rewrite the first stored copy of ROW of RUN under OUTPUT with its features (float32
    [tokens, layers, hidden]) through CHANGE; the shard's name."""
    store = LocalFeatureStore(output)
    for shard in store.list_shards(run):
        index = store.get_index(run, shard)
        for i, entry in enumerate(index.entries):
            if entry.row != row:
                continue
            path = store.dir(run) / shard
            data = bytearray(path.read_bytes())
            old = unpack_row(bytes(data[entry.offset:entry.offset + entry.length]))
            blob = pack_row(old.row, old.capture, old.layer_ids, old.token_ids,
                            encode(change(old.features().copy()), old.encoded.dtype))
            assert len(blob) == entry.length, "a row of the same shape packs to the same length"
            data[entry.offset:entry.offset + entry.length] = blob
            crc = zlib.crc32(blob)
            _fix_frame(data, entry.offset, crc)
            path.write_bytes(bytes(data))
            entries = list(index.entries)
            entries[i] = replace(entry, crc32=crc)
            fixed = replace(index, sha256=hashlib.sha256(data).hexdigest(), entries=tuple(entries))
            (store.dir(run) / index_name(shard)).write_bytes(fixed.to_json())
            assert ShardIndex.from_json(fixed.to_json()) == fixed
            return shard
    raise KeyError(row)


def _fix_frame(data: bytearray, offset: int, crc: int) -> None:
    """The frame header just before the row at OFFSET names its crc32 too."""
    at = offset - FRAME.size
    magic, _, length = FRAME.unpack_from(data, at)
    FRAME.pack_into(data, at, magic, crc, length)
