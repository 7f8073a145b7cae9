"""The shard naming rule, and both stores through the one ShardStore interface (a temp dir, and
the real S3 server)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from genqueue.common.storage import (
    LocalStore,
    SealedShard,
    ShardInfo,
    ShardName,
    ShardStore,
    StoreError,
    manifest_name,
    parse_manifest,
    parse_shard_name,
    read_manifest,
    run_settings_name,
    shard_name,
    shard_of_manifest,
    shards_prefix,
    store_for,
)
from genqueue.consumer.shipping.shards import ShardWriter
from tests import s3server
from tests.s3server import S3Server

s3_server = s3server.s3_server  # fixtures
s3_env = s3server.s3_env

# --- the naming rule ---------------------------------------------------------------------

workers = st.text(st.characters(codec="utf-8", exclude_characters="/\\\x00"), min_size=1, max_size=40)


@given(workers, st.integers(0, 10**9))
def test_shard_names_round_trip(worker: str, seq: int) -> None:
    name = shard_name(worker, seq)
    assert parse_shard_name(name) == ShardName(worker, seq)
    assert shard_of_manifest(manifest_name(name)) == name


def test_the_layout_is_spelled_as_the_readme_says() -> None:
    assert shard_name("gq-node1-0a1b2c3d", 7) == "gq-node1-0a1b2c3d-000007.jsonl"
    assert manifest_name("gq-node1-0a1b2c3d-000007.jsonl") == "gq-node1-0a1b2c3d-000007.manifest.json"
    assert shards_prefix("data") == "data/shards"
    assert run_settings_name("data") == "data/run.json"
    assert parse_shard_name("w-1234567.jsonl") == ShardName("w", 1234567)  # past six digits


@pytest.mark.parametrize("name", [
    "w-000001.jsonl.open", "w-000001.manifest.json", ".w-000001.jsonl.tmp", "w-1.jsonl", "w-00000a.jsonl",
    "-000001.jsonl", "000001.jsonl", "w_000001.jsonl", "sub/w-000001.jsonl", "w-0000001.jsonl", "notes.txt",
    "data.jsonl", "w-000001.JSONL", "w-000001.jsonl\n",
])
def test_foreign_names_are_not_shards(name: str) -> None:
    assert parse_shard_name(name) is None


def test_names_that_cannot_be_made() -> None:
    for worker in ("", "a/b", "a\\b"):
        with pytest.raises(ValueError):
            shard_name(worker, 1)
    with pytest.raises(ValueError):
        shard_name("w", -1)
    with pytest.raises(ValueError):
        manifest_name("w-000001.txt")
    assert shard_of_manifest("w-000001.jsonl") is None and shard_of_manifest("x.manifest.json") is None


def test_manifest_parsing_is_lenient_but_checks_what_readers_use() -> None:
    assert parse_manifest(b'{"sha256": "ab", "records": 3}') == {"sha256": "ab", "records": 3}
    for raw in (b"not json", b"[]", b'{"sha256": "ab"}', b'{"sha256": 1, "records": 3}', b'{"records": "3"}'):
        assert parse_manifest(raw) is None


# --- both stores, one interface ----------------------------------------------------------

@dataclass
class Target:
    """A store under test, its output setting, and a way to drop any object into that output."""

    store: ShardStore
    output: str
    put: Callable[[str, bytes], object]


@pytest.fixture(params=["local", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """A temp dir, or a prefix on the real S3 server."""
    if request.param == "local":
        root = tmp_path / "out"
        root.mkdir()

        def put(rel: str, data: bytes) -> None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)

        return Target(store_for(str(root)), str(root), put)
    server: S3Server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_env")
    client = server.client()
    return Target(store_for(server.url("pre/fix"), tmpdir=str(tmp_path)), server.url("pre/fix"),
                  lambda rel, data: client.put_object(Bucket=server.bucket, Key=f"pre/fix/{rel}", Body=data))


def seal(tmp_path: Path, run: str, worker: str, n: int) -> SealedShard:
    w = ShardWriter(str(tmp_path / "spool"), run, worker, max_bytes=10**9, max_age=3600)
    for i in range(n):
        w.append({"key": f"{i:032x}", "index": i})
    shard = w.seal()
    assert shard is not None
    return shard


@pytest.mark.integration
def test_ship_list_and_read_back(target: Target, tmp_path: Path) -> None:
    st_, output = target.store, target.output
    assert st_.list_shards("r") == []
    shards = [seal(tmp_path, "r", "wb", 3), seal(tmp_path, "r", "wa", 5)]
    for s in shards:
        dest = st_.ship(s)
        assert dest.endswith(f"r/shards/{s.name}")
    listed = st_.list_shards("r")
    assert listed == [ShardInfo("wa-000001.jsonl", shards[1].bytes, "wa-000001.manifest.json"),
                      ShardInfo("wb-000001.jsonl", shards[0].bytes, "wb-000001.manifest.json")]  # name order
    for info, shard in zip(listed, reversed(shards), strict=True):
        with st_.open("r", info.name) as fh:
            data = fh.read()
        assert data == shard.path.read_bytes() and hashlib.sha256(data).hexdigest() == shard.sha256
        assert read_manifest(st_, "r", info) == shard.manifest()
    assert st_.location("r").startswith(output.rstrip("/")) and "r/shards" in st_.location("r")
    assert st_.list_shards("other") == []


@pytest.mark.integration
def test_listing_keeps_shards_without_manifest_and_leaves_out_foreign_objects(target: Target) -> None:
    st_, put = target.store, target.put
    put("r/shards/w-000001.jsonl", b'{"key": "a"}\n')  # its consumer died before the manifest
    put("r/shards/notes.txt", b"hello")
    put("r/shards/w-000002.jsonl.open", b"x")
    put("r/shards/x.manifest.json", b"{}")
    put("r/other/w-000003.jsonl", b"x")
    assert st_.list_shards("r") == [ShardInfo("w-000001.jsonl", 13, None)]
    assert read_manifest(st_, "r", st_.list_shards("r")[0]) is None


@pytest.mark.integration
def test_reading_what_is_not_there_is_a_store_error(target: Target) -> None:
    st_ = target.store
    with pytest.raises(StoreError, match="cannot read"):
        st_.open("r", "w-000009.jsonl")
    with pytest.raises(StoreError, match="not a shard"):
        st_.open("r", "../../etc/passwd")


def test_a_local_output_that_does_not_exist_is_a_user_error(tmp_path: Path) -> None:
    from genqueue.common.errors import UserError

    with pytest.raises(UserError, match="does not exist"):
        LocalStore(str(tmp_path / "nope")).list_shards("r")


def test_sealed_shard_manifest_is_the_contract() -> None:
    s = SealedShard("r", 1, Path("/x"), "w-000001.jsonl", 2, 20, "ab" * 32, 2)
    assert orjson.loads(orjson.dumps(s.manifest())) == {"run": "r", "shard": "w-000001.jsonl", "records": 2,
                                                         "keys": 2, "bytes": 20, "sha256": "ab" * 32}
