"""Feature shards put in a run's output as result shards are (a sealed spool file, verified, then
the index that vouches for it) and read back row by row: a directory, and a real S3 (SeaweedFS)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from genqueue.common.errors import FeatureCorruptError, FeatureError, FeatureManifestConflictError
from genqueue.common.features import (
    FeatureDtype,
    FeatureManifest,
    FeatureReader,
    FeatureShardWriter,
    LocalFeatureStore,
    SealedFeatureShard,
    feature_store_for,
    standin_features,
)
from genqueue.common.features.s3 import S3FeatureStore
from genqueue.common.features.shard import ReadRange
from genqueue.common.storage import store_for
from genqueue.common.storage.base import StoreError
from genqueue.common.storage.s3 import S3Store, ShipVerifyError
from tests import s3server
from tests.s3server import S3Server

s3_server = s3server.s3_server  # fixtures
s3_env = s3server.s3_env

LAYERS = (1, 2, 3)


def capture(dtype: FeatureDtype = FeatureDtype.FP8_E4M3, hidden: int = 64) -> FeatureManifest:
    return FeatureManifest("tiny", "rev1", LAYERS, dtype, hidden, "tmpl", "0.32.0", "0.1.0")


def shards(spool: Path, man: FeatureManifest, rows: int, tokens: int = 20, worker: str = "w1",
           per_shard: int = 4, rows_of: str | None = None) -> list[SealedFeatureShard]:
    """WORKER's sealed shards of ROWS rows, named `<ROWS_OF or WORKER>-row-<i>`."""
    w = FeatureShardWriter(spool, "run", worker, man)
    out = []
    for i in range(rows):
        ids = np.arange(tokens) + i
        w.append(f"{rows_of or worker}-row-{i}", ids, standin_features(ids, LAYERS, man.hidden_size, seed=i))
        if w.rows == per_shard and (sealed := w.seal()) is not None:
            out.append(sealed)
    if (sealed := w.seal()) is not None:
        out.append(sealed)
    return out


def check_reads(reader: FeatureReader, man: FeatureManifest, rows: int, tokens: int = 20, worker: str = "w1") -> None:
    assert {f"{worker}-row-{i}" for i in range(rows)} <= reader.entries.keys()
    for i in range(rows):
        row = reader.row(f"{worker}-row-{i}")
        ids = np.arange(tokens) + i
        assert np.array_equal(row.token_ids, ids)
        assert np.allclose(row.features(), standin_features(ids, LAYERS, man.hidden_size, seed=i), rtol=1 / 17,
                           atol=1e-4)


def test_a_directory_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    store = feature_store_for(str(out))
    assert isinstance(store, LocalFeatureStore)
    man = capture()
    assert store.get_manifest("run") is None and store.list_shards("run") == []
    store.put_manifest("run", man)
    store.put_manifest("run", man)  # the same capture again: no change
    # a consumer of another genqueue release capturing the same run: the same capture (it was a
    # conflict, and that consumer's shipping retried it for ever)
    later = FeatureManifest("tiny", "rev1", LAYERS, FeatureDtype.FP8_E4M3, 64, "tmpl", "0.32.0", "0.2.0")
    store.put_manifest("run", later)
    assert later.digest == man.digest and store.get_manifest("run") == man  # the first stored stays
    other = FeatureManifest("tiny", "rev2", LAYERS, FeatureDtype.FP8_E4M3, 64, "tmpl", "0.32.0", "0.1.0")
    with pytest.raises(FeatureManifestConflictError, match="another capture"):
        store.put_manifest("run", other)
    sealed = shards(tmp_path / "spool", man, 10)
    for s in sealed:
        dest = store.put_shard(s)
        assert Path(dest).read_bytes() == s.path.read_bytes()
    store.put_shard(sealed[0])  # a retry after a lost answer: same name, same bytes
    assert sorted(p.name for p in (out / "run" / "features").iterdir()) == [
        "manifest.json", "w1-000001.gqfeat", "w1-000001.index.json", "w1-000002.gqfeat", "w1-000002.index.json",
        "w1-000003.gqfeat", "w1-000003.index.json"]
    reader = FeatureReader(store, "run")
    assert reader.manifest == man and reader.duplicates == 0 and len(reader.entries) == 10
    check_reads(reader, man, 10)


def test_a_shard_changed_on_the_spool_is_not_put(tmp_path: Path) -> None:
    store = LocalFeatureStore(tmp_path / "out")
    (s,) = shards(tmp_path / "spool", capture(), 2)
    data = bytearray(s.path.read_bytes())
    data[-3] ^= 1
    s.path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="changed since it was sealed"):
        store.put_shard(s)
    assert store.list_shards("run") == [] and not (tmp_path / "out" / "run" / "features" / s.name).exists()


def test_the_reader_refuses_shards_of_another_capture_and_counts_rows_stored_twice(tmp_path: Path) -> None:
    store = LocalFeatureStore(tmp_path / "out")
    man = capture()
    store.put_manifest("run", man)
    for s in shards(tmp_path / "a", man, 3) + shards(tmp_path / "b", man, 2, worker="w1x"):
        store.put_shard(s)
    (again,) = shards(tmp_path / "c", man, 2, worker="w0", rows_of="w1")  # a redone job: its rows again
    store.put_shard(again)
    reader = FeatureReader(store, "run")
    assert reader.duplicates == 2 and len(reader.entries) == 5
    assert reader.entries["w1-row-1"].shard == "w0-000001.gqfeat"  # the first shard in name order
    check_reads(reader, man, 3)
    for s in shards(tmp_path / "d", man, 2, worker="w2"):
        store.put_shard(s)
    stranger = shards(tmp_path / "e", capture(FeatureDtype.BF16), 1, worker="w3")[0]
    store.put_shard(stranger)
    with pytest.raises(FeatureError, match="w3-000001.gqfeat .* is of capture"):
        FeatureReader(store, "run")
    with pytest.raises(FeatureError, match="no capture manifest"):
        FeatureReader(store, "other-run")


def test_a_garbled_stored_row_names_itself(tmp_path: Path) -> None:
    store = LocalFeatureStore(tmp_path / "out")
    man = capture()
    store.put_manifest("run", man)
    (s,) = shards(tmp_path / "spool", man, 3)
    store.put_shard(s)
    reader = FeatureReader(store, "run")
    entry = reader.entries["w1-row-1"]
    path = tmp_path / "out" / "run" / "features" / s.name
    data = bytearray(path.read_bytes())
    data[entry.offset + 100] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(FeatureCorruptError, match=f"row 'w1-row-1' in shard {s.name} at offset {entry.offset}"):
        reader.row("w1-row-1")


@pytest.mark.integration
def test_real_s3_round_trip(tmp_path: Path, s3_server: S3Server, s3_env: dict[str, str]) -> None:
    """Through SeaweedFS: a small shard and a multipart one (three 5 MiB parts), checked by the
    server's SHA256; the capture's manifest once; each row read by a ranged GET of its bytes."""
    out = s3_server.url("out/prefix")
    store = feature_store_for(out)
    assert isinstance(store, S3FeatureStore) and isinstance(store_for(out), S3Store)
    store = S3FeatureStore(S3Store.from_url(out, multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20))
    man = capture(FeatureDtype.BF16, hidden=1024)
    assert store.get_manifest("run") is None
    store.put_manifest("run", man)
    store.put_manifest("run", man)
    with pytest.raises(FeatureManifestConflictError):
        store.put_manifest("run", capture())
    small = shards(tmp_path / "s", man, 2, tokens=10, worker="small")
    big = shards(tmp_path / "b", man, 5, tokens=500, worker="big", per_shard=5)  # 5 x 3 MB
    assert big[0].bytes > 10 * 2**20
    client = s3_server.client()
    for s in small + big:
        dest = store.put_shard(s)
        key = f"out/prefix/run/features/{s.name}"
        assert dest == f"s3://{s3_server.bucket}/{key}"
        assert client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == s.path.read_bytes()
        head = client.head_object(Bucket=s3_server.bucket, Key=key, ChecksumMode="ENABLED")
        assert head["Metadata"]["sha256"] == s.sha256 and head.get("ChecksumSHA256")
    head = client.head_object(Bucket=s3_server.bucket, Key=f"out/prefix/run/features/{big[0].name}",
                              ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"].endswith("-3")  # the composite of three parts, verified by put_shard
    assert store.list_shards("run") == ["big-000001.gqfeat", "small-000001.gqfeat"]

    reader = FeatureReader(store, "run")
    check_reads(reader, man, 2, tokens=10, worker="small")
    fetched: list[int] = []
    plain = store.read_range

    def counting(run: str, shard: str) -> ReadRange:
        read = plain(run, shard)

        def counted(offset: int, length: int) -> bytes:
            fetched.append(length)
            return read(offset, length)
        return counted

    store.read_range = counting  # type: ignore[method-assign]
    check_reads(reader, man, 5, tokens=500, worker="big")
    assert fetched == [reader.entries[f"big-row-{i}"].length for i in range(5)]
    assert max(fetched) * 4 < big[0].bytes

    # a spool file changed after it was sealed is caught by the verification, and no index is put
    changed = shards(tmp_path / "c", man, 1, worker="changed")[0]
    data = bytearray(changed.path.read_bytes())
    data[-1] ^= 1
    changed.path.write_bytes(bytes(data))
    with pytest.raises(ShipVerifyError):
        store.put_shard(changed)
    assert "changed-000001.gqfeat" not in store.list_shards("run")
