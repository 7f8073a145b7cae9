"""S3Store against a real S3 server (SeaweedFS): objects, manifests, checksums, orphan uploads.

(Moved from tests/consumer/test_s3sink.py with the code: S3Sink is now common.storage.s3.S3Store.)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import orjson
import pytest

from genqueue.common.storage import SealedShard, store_for
from genqueue.common.storage.s3 import S3Location, S3Store, ShipVerifyError, abort_stale_uploads, endpoint_url
from genqueue.consumer.shipping.shards import ShardWriter
from tests import s3server
from tests.s3server import S3Server

s3_server = s3server.s3_server  # fixtures
s3_env = s3server.s3_env

pytestmark = pytest.mark.integration


def seal(tmp_path: Path, run: str, n: int, pad: int = 0, worker: str = "w1") -> SealedShard:
    w = ShardWriter(str(tmp_path / "spool"), run, worker, max_bytes=10**12, max_age=3600)
    for i in range(n):
        w.append({"key": f"{i:032x}", "index": i, "pad": os.urandom(pad // 2).hex() if pad else ""})
    shard = w.seal()
    assert shard is not None
    return shard


def test_url_parsing_and_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    loc = S3Location.parse("s3://bucket/a/b/")
    assert (loc.bucket, loc.prefix, loc.key("r", "shards", "x.jsonl")) == ("bucket", "a/b", "a/b/r/shards/x.jsonl")
    assert S3Location.parse("s3://bucket").key("r") == "r"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://aws-env:1")
    monkeypatch.delenv("GENQUEUE_S3_ENDPOINT", raising=False)
    assert endpoint_url() == "http://aws-env:1"
    monkeypatch.setenv("GENQUEUE_S3_ENDPOINT", "http://ours:2")
    assert endpoint_url() == "http://ours:2"


def test_ship_small_and_multipart_shards(tmp_path: Path, s3_server: S3Server, s3_env: dict[str, str]) -> None:
    store = store_for(s3_server.url("out/prefix"))
    assert isinstance(store, S3Store)
    store = S3Store.from_url(s3_server.url("out/prefix"), multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    client = s3_server.client()
    small = seal(tmp_path, "r1", 10)
    big = seal(tmp_path, "r1", 1200, pad=10_000, worker="w2")  # ~12 MB: three 5 MiB parts
    assert big.bytes > 10 * 2**20
    for shard in (small, big):
        data = shard.path.read_bytes()
        dest = store.ship(shard)
        key = f"out/prefix/r1/shards/{shard.name}"
        assert dest == f"s3://{s3_server.bucket}/{key}"
        assert client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == data
        man_key = key.removesuffix(".jsonl") + ".manifest.json"
        man = orjson.loads(client.get_object(Bucket=s3_server.bucket, Key=man_key)["Body"].read())
        assert man == shard.manifest() and man["sha256"] == hashlib.sha256(data).hexdigest()
        head = client.head_object(Bucket=s3_server.bucket, Key=key, ChecksumMode="ENABLED")
        assert head["Metadata"]["sha256"] == shard.sha256
        assert head.get("ChecksumSHA256"), "the server kept no checksum"
    head = client.head_object(Bucket=s3_server.bucket, Key=f"out/prefix/r1/shards/{big.name}", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"].endswith("-3")  # multipart: a composite of three parts
    # Shipping again (a retry after a lost answer) is harmless: same name, same bytes.
    store.ship(small)


def test_verification_catches_a_changed_spool_file(tmp_path: Path, s3_server: S3Server, s3_env: dict[str, str]) -> None:
    store = S3Store.from_url(s3_server.url("p"))
    shard = seal(tmp_path, "r", 5)
    shard.path.write_bytes(shard.path.read_bytes().replace(b"0", b"1"))  # same size, other bytes
    with pytest.raises(ShipVerifyError):
        store.ship(shard)
    man = f"p/r/shards/{shard.name.removesuffix('.jsonl')}.manifest.json"
    listed = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=man).get("Contents", [])
    assert not listed, "a manifest was written for a shard that failed verification"


def test_abort_stale_uploads(tmp_path: Path, s3_server: S3Server, s3_env: dict[str, str]) -> None:
    client = s3_server.client()
    bucket = s3_server.bucket
    mine = client.create_multipart_upload(Bucket=bucket, Key="pre/run/shards/w-000001.jsonl")
    client.upload_part(Bucket=bucket, Key="pre/run/shards/w-000001.jsonl", UploadId=mine["UploadId"],
                       PartNumber=1, Body=b"x" * 1024)
    other = client.create_multipart_upload(Bucket=bucket, Key="elsewhere/x.jsonl")
    loc = S3Location(bucket, "pre")
    assert abort_stale_uploads(client, loc, older_than_s=3600) == 0  # too young
    assert abort_stale_uploads(client, loc, older_than_s=0) == 1
    left = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["UploadId"] for u in left] == [other["UploadId"]]
    # A store sweeps its own prefix once, before its first upload.
    again = client.create_multipart_upload(Bucket=bucket, Key="pre/run/shards/w-000002.jsonl")
    S3Store(loc, stale_after_s=0).ship(seal(tmp_path, "run", 3))
    left = {u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}
    assert again["UploadId"] not in left and other["UploadId"] in left


def test_ship_raises_while_the_server_is_down(tmp_path: Path, s3_server: S3Server, s3_env: dict[str, str]) -> None:
    from botocore.exceptions import EndpointConnectionError

    store = S3Store.from_url(s3_server.url("p"))
    s3_server.stop(kill=True)
    with pytest.raises(EndpointConnectionError):
        store.ship(seal(tmp_path, "r", 3))
    s3_server.start()
    assert store.ship(seal(tmp_path, "r", 3, worker="w9")).endswith("w9-000001.jsonl")
