"""Feature shards on the spool: each row durable when its entry is returned, read back alone and
checked, an index the bytes alone rebuild, a crash's torn row dropped, corruption named."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from genqueue.common.errors import FeatureCorruptError, FeatureValueError
from genqueue.common.features import (
    FeatureDtype,
    FeatureManifest,
    FeatureShardWriter,
    ShardIndex,
    leftover_feature_shards,
    read_row,
    scan,
    standin_features,
)
from genqueue.common.features import shard as shard_mod
from genqueue.common.features.shard import FRAME, file_range, frame

LAYERS = (0, 1, 2)
HIDDEN = 32


def manifest(dtype: FeatureDtype = FeatureDtype.FP8_E4M3) -> FeatureManifest:
    return FeatureManifest("tiny", "rev1", LAYERS, dtype, HIDDEN, "tmpl", "0.32.0", "0.1.0")


def ids_of(i: int) -> np.ndarray:
    return np.arange(5 + 3 * i) + i


def features_of(i: int) -> np.ndarray:
    return standin_features(ids_of(i), LAYERS, HIDDEN, seed=1)


def fill(writer: FeatureShardWriter, n: int, start: int = 0) -> list:
    return [writer.append(f"row-{i}", ids_of(i), features_of(i)) for i in range(start, start + n)]


@pytest.mark.parametrize("dtype", list(FeatureDtype))
def test_rows_read_back_alone_and_the_index_matches_the_bytes(tmp_path: Path, dtype: FeatureDtype) -> None:
    w = FeatureShardWriter(tmp_path, "run", "w1", manifest(dtype))
    entries = fill(w, 6)
    sealed = w.seal()
    assert sealed is not None and sealed.name == "w1-000001.gqfeat"
    assert sealed.path == tmp_path / "run" / "features" / "sealed" / "w1-000001.gqfeat"
    assert sealed.index.entries == tuple(entries) and sealed.bytes == sealed.path.stat().st_size
    assert ShardIndex.from_json(sealed.index_path.read_bytes()) == sealed.index
    import hashlib
    assert hashlib.sha256(sealed.path.read_bytes()).hexdigest() == sealed.sha256
    for i, e in enumerate(entries):
        row = read_row(file_range(sealed.path), e, capture=w.capture)
        assert (row.row, e.tokens, e.layers, e.hidden, e.dtype) == (f"row-{i}", len(ids_of(i)), 3, HIDDEN, dtype)
        assert np.array_equal(row.token_ids, ids_of(i))
        assert np.allclose(row.features(), features_of(i), rtol=1 / 17, atol=1e-5)
        assert e.offset % 8 == 0
    found = scan(sealed.path)
    assert (found.capture, found.entries, found.end, found.sha256) == (w.capture, sealed.index.entries,
                                                                       sealed.bytes, sealed.sha256)
    # a plain reader: the index's JSON and a seek are all it takes
    body = json.loads(sealed.index_path.read_bytes())
    assert body["rows"][2]["row"] == "row-2" and body["rows"][2]["offset"] == entries[2].offset


def test_reading_one_row_reads_its_bytes_only(tmp_path: Path) -> None:
    w = FeatureShardWriter(tmp_path, "run", "w1", manifest())
    entries = fill(w, 40)
    sealed = w.seal()
    assert sealed is not None
    asked: list[tuple[int, int]] = []
    plain = file_range(sealed.path)

    def counting(offset: int, length: int) -> bytes:
        asked.append((offset, length))
        return plain(offset, length)

    read_row(counting, entries[17])
    assert asked == [(entries[17].offset, entries[17].length)]
    assert entries[17].length * 20 < sealed.bytes


def test_a_row_is_on_disk_and_fsynced_when_its_entry_is_returned(tmp_path: Path, monkeypatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(shard_mod.os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd)))
    w = FeatureShardWriter(tmp_path, "run", "w1", manifest())
    e = w.append("row-0", ids_of(0), features_of(0))
    open_path = tmp_path / "run" / "features" / "w1-000001.gqfeat.open"
    # the file held the row when it was last fsynced, before append returned
    assert synced[-1] == open_path.stat().st_size >= e.offset + e.length
    assert read_row(file_range(open_path), e).row == "row-0"


def test_seal_by_size_and_a_new_shard_after(tmp_path: Path) -> None:
    w = FeatureShardWriter(tmp_path, "run", "w1", manifest(), max_bytes=3000)
    fill(w, 1)
    assert not w.full
    fill(w, 3, start=1)
    assert w.full
    first = w.seal()
    fill(w, 2, start=4)
    second = w.seal()
    assert first is not None and second is not None
    assert (first.name, second.name) == ("w1-000001.gqfeat", "w1-000002.gqfeat")
    assert [e.row for e in second.index.entries] == ["row-4", "row-5"]
    assert w.seal() is None
    assert sorted(p.name for p in (tmp_path / "run" / "features").iterdir()) == ["sealed"]


def test_a_second_writer_of_the_same_name_never_writes_over_the_first(tmp_path: Path) -> None:
    first = FeatureShardWriter(tmp_path, "run", "w1", manifest())
    fill(first, 2)
    sealed = first.seal()
    second = FeatureShardWriter(tmp_path, "run", "w1", manifest())
    fill(second, 1, start=5)
    again = second.seal()
    assert sealed is not None and again is not None and again.name == "w1-000002.gqfeat"
    assert [e.row for e in scan(sealed.path).entries] == ["row-0", "row-1"]


def test_rows_that_do_not_fit_the_capture_are_refused(tmp_path: Path) -> None:
    w = FeatureShardWriter(tmp_path, "run", "w1", manifest())
    with pytest.raises(FeatureValueError, match="2 layers x 32; the capture takes 3 x 32"):
        w.append("r", [1, 2], standin_features([1, 2], (0, 1), HIDDEN))
    with pytest.raises(FeatureValueError, match="3 layers x 16"):
        w.append("r", [1, 2], standin_features([1, 2], LAYERS, 16))
    assert w.rows == 0


def test_a_failed_write_leaves_the_shard_as_it_was(tmp_path: Path, monkeypatch) -> None:
    w = FeatureShardWriter(tmp_path, "run", "w1", manifest())
    fill(w, 2)
    before = w.open_bytes
    real = os.pwrite

    def half_then_full(fd: int, data, at: int) -> int:
        real(fd, bytes(data[: len(data) // 2]), at)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard_mod.os, "pwrite", half_then_full)
    with pytest.raises(OSError, match="No space"):
        w.append("row-2", ids_of(2), features_of(2))
    assert (tmp_path / "run" / "features" / "w1-000001.gqfeat.open").stat().st_size == before
    monkeypatch.setattr(shard_mod.os, "pwrite", real)
    fill(w, 2, start=2)
    sealed = w.seal()
    assert sealed is not None
    assert [e.row for e in scan(sealed.path).entries] == ["row-0", "row-1", "row-2", "row-3"]


def corrupt(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_garbled_row_is_named_with_its_shard_and_offset(tmp_path: Path) -> None:
    w = FeatureShardWriter(tmp_path, "run", "w1", manifest())
    entries = fill(w, 4)
    sealed = w.seal()
    assert sealed is not None
    corrupt(sealed.path, entries[2].offset + entries[2].length - 5)
    with pytest.raises(FeatureCorruptError) as err:
        read_row(file_range(sealed.path), entries[2])
    assert (err.value.row, err.value.shard, err.value.offset) == ("row-2", "w1-000001.gqfeat", entries[2].offset)
    assert "crc32" in str(err.value) and "row-2" in str(err.value) and str(entries[2].offset) in str(err.value)
    read_row(file_range(sealed.path), entries[3])  # the others still read
    with pytest.raises(FeatureCorruptError, match="garbled row with whole rows after it"):
        scan(sealed.path)


def test_an_entry_that_points_at_another_row_is_refused(tmp_path: Path) -> None:
    """An index that names the wrong bytes for a row (the "features of another row" failure)."""
    w = FeatureShardWriter(tmp_path, "run", "w1", manifest())
    a, b = fill(w, 2)
    sealed = w.seal()
    assert sealed is not None
    swapped = type(a)(a.row, a.shard, b.offset, b.length, a.tokens, a.layers, a.hidden, a.dtype, b.crc32)
    with pytest.raises(FeatureCorruptError, match="the stored row is 'row-1'"):
        read_row(file_range(sealed.path), swapped)
    with pytest.raises(FeatureCorruptError, match="capture"):
        read_row(file_range(sealed.path), a, capture="ffffffffffffffff")


def test_a_crash_leaves_rows_the_next_process_seals(tmp_path: Path, caplog) -> None:
    """Every appended row survives; the torn frame of the row being written is dropped."""
    dead = FeatureShardWriter(tmp_path, "run", "dead", manifest())
    entries = fill(dead, 3)
    open_path = tmp_path / "run" / "features" / "dead-000001.gqfeat.open"
    blob = frame(b"x" * 500)
    with open(open_path, "ab") as fh:
        fh.write(blob[:300])  # the crash: a frame cut short
    live = FeatureShardWriter(tmp_path, "run", "live", manifest())
    fill(live, 1)
    with caplog.at_level(logging.WARNING):
        found = leftover_feature_shards(tmp_path, lambda worker: worker == "dead")
    assert [s.name for s in found] == ["dead-000001.gqfeat"]
    assert found[0].index.entries == tuple(entries)
    assert "dropped a torn row" in caplog.text
    assert not open_path.exists() and found[0].path.stat().st_size == found[0].bytes
    for e in entries:
        read_row(file_range(found[0].path), e)
    assert (tmp_path / "run" / "features" / "live-000001.gqfeat.open").exists()  # a live writer's is left alone
    # a sealed shard whose index a crash kept from being written gets it back
    found[0].index_path.unlink()
    again = leftover_feature_shards(tmp_path, lambda worker: worker == "dead")
    assert again[0].index == found[0].index


def test_a_torn_frame_header_or_a_garbled_last_row_is_a_torn_end(tmp_path: Path) -> None:
    w = FeatureShardWriter(tmp_path, "run", "w1", manifest())
    entries = fill(w, 2)
    path = tmp_path / "run" / "features" / "w1-000001.gqfeat.open"
    size = path.stat().st_size
    with open(path, "ab") as fh:
        fh.write(b"\0" * (FRAME.size + 64))  # the size grew, the data never reached the disk
    assert scan(path).entries == tuple(entries) and scan(path).end == size
    os.truncate(path, size)
    corrupt(path, entries[1].offset + 10)  # the last row garbled, nothing after it
    assert scan(path).entries == tuple(entries[:1])
