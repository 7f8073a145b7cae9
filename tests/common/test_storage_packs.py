"""Packs in the run's output (issue 34): their naming rule beside the shards, and both stores
(a temp dir, and a real S3 server: SeaweedFS) putting a pack and reading it back whole, by a
byte range and by its tail, so that a job's items come back from the bytes of one ranged read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from genqueue.common import packs
from genqueue.common.contracts import Item
from genqueue.common.errors import PackTruncatedError
from genqueue.common.storage import (
    LocalStore,
    OutputStore,
    PackName,
    PackNotFoundError,
    StoreError,
    pack_name,
    packs_prefix,
    parse_pack_name,
    parse_shard_name,
    shards_prefix,
    store_for,
)
from genqueue.common.storage.packreader import TAIL_BYTES
from genqueue.common.storage.s3 import S3Store
from tests import s3server
from tests.s3server import S3Server

s3_server = s3server.s3_server  # fixtures
s3_env = s3server.s3_env


# --- the naming rule ---------------------------------------------------------------------
def test_packs_live_beside_the_shards_under_the_run() -> None:
    assert packs_prefix("r1") == "r1/packs" and shards_prefix("r1") == "r1/shards"
    assert pack_name("a1b2", 7) == "a1b2-000007.gqpack"
    assert parse_pack_name("a1b2-000007.gqpack") == PackName("a1b2", 7)
    assert parse_shard_name(pack_name("a1b2", 7)) is None  # never listed as a shard
    for bad in ("a1b2-7.gqpack", "a1b2-0000007.gqpack", "a1b2-000007.jsonl", ".a1b2-000007.gqpack.1.tmp",
                "-000007.gqpack"):
        assert parse_pack_name(bad) is None, bad
    for writer, seq in (("", 1), ("a/b", 1), ("a\\b", 1), ("w", -1)):
        with pytest.raises(ValueError):
            pack_name(writer, seq)


@given(st.text(min_size=1).filter(lambda w: not {"/", "\\", "\x00"} & set(w)), st.integers(0, 10**9))
def test_every_pack_name_parses_back(writer: str, seq: int) -> None:
    assert parse_pack_name(pack_name(writer, seq)) == PackName(writer, seq)


# --- both stores ----------------------------------------------------------------------------
def items(n: int) -> list[Item]:
    return [{"key": f"{i:032x}", "index": i, "turn": None,
             "messages": [{"role": "user", "content": f"question {i} " + "words " * (i % 50)}]} for i in range(n)]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OutputStore]:
    if request.param == "local":
        yield LocalStore(str(tmp_path / "out"))
        return
    server: S3Server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_env")
    yield store_for(server.url("out/prefix"))


@pytest.mark.integration
def test_a_pack_goes_in_whole_and_a_job_reads_its_range_by_one_ranged_get(store: OutputStore) -> None:
    its = items(300)
    data = packs.write_pack(its, block_items=32)
    name = pack_name("w1", 1)
    where = store.put_pack("r1", name, data)
    assert where == store.pack_location("r1", name)
    assert where.endswith("r1/packs/w1-000001.gqpack")
    assert store.get_pack("r1", name) == data
    # the tail: footer and index in one read, with the pack's size
    tail, size = store.get_pack_tail("r1", name, TAIL_BYTES)
    assert size == len(data) and tail == data  # a small pack: all of it
    tail, size = store.get_pack_tail("r1", name, 400)
    assert size == len(data) and tail == data[-400:]
    index = packs.index_from_tail(tail, size, where)
    assert isinstance(index, packs.PackIndex)
    lo, hi = index.span(64, 40, where)
    span = store.get_pack_range("r1", name, lo, hi)
    assert span == data[lo:hi]
    assert packs.read_span(span, lo, index, 64, 40, where) == its[64:104]
    assert store.get_pack_range("r1", name, lo, lo) == b""
    # a range past the end comes back short, and the pack's checks name it
    assert store.get_pack_range("r1", name, len(data) - 5, len(data) + 100) == data[-5:]
    short = store.get_pack_range("r1", name, lo, hi - 1)
    with pytest.raises(PackTruncatedError, match=r"block at \d+: \d+ bytes, its index says"):
        packs.read_span(short, lo, index, 64, 40, where)
    # put again: replaced whole (a pack is written once; a retried put writes the same bytes)
    store.put_pack("r1", name, data)
    assert store.get_pack("r1", name) == data


@pytest.mark.integration
def test_a_missing_pack_and_a_name_that_is_not_a_pack(store: OutputStore) -> None:
    name = pack_name("w1", 2)
    with pytest.raises(PackNotFoundError, match="no pack .*r1/packs/w1-000002.gqpack"):
        store.get_pack("r1", name)
    with pytest.raises(PackNotFoundError):
        store.get_pack_range("r1", name, 0, 10)
    with pytest.raises(PackNotFoundError):
        store.get_pack_tail("r1", name, 10)
    assert issubclass(PackNotFoundError, StoreError)
    for call in (lambda: store.get_pack("r1", "w1-000002.jsonl"),
                 lambda: store.put_pack("r1", "../x-000001.gqpack", b"x")):
        with pytest.raises(StoreError, match="not a pack name"):
            call()
    with pytest.raises(ValueError):
        store.get_pack_range("r1", name, 5, 2)


@pytest.mark.integration
def test_a_pack_is_never_listed_as_a_shard(store: OutputStore) -> None:
    store.put_pack("r1", pack_name("w1", 1), packs.write_pack(items(3)))
    assert store.list_shards("r1") == []


def test_a_local_pack_left_half_written_is_not_a_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails part way leaves no pack under its name (and no temporary file)."""
    store = LocalStore(str(tmp_path))
    name = pack_name("w1", 1)

    def full(self: Path, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(StoreError, match="No space left"):
        store.put_pack("r1", name, b"x" * 100)
    monkeypatch.undo()
    assert list((tmp_path / "r1" / "packs").iterdir()) == []


@pytest.mark.integration
def test_the_s3_store_reads_the_tail_by_a_suffix_range(s3_server: S3Server, s3_env: dict[str, str]) -> None:
    """Only the bytes asked cross the wire: the object is larger than the tail read."""
    store = S3Store.from_url(s3_server.url("p"))
    data = packs.write_pack(items(2000), block_items=32)
    store.put_pack("r", pack_name("w", 0), data)
    head = s3_server.client().head_object(Bucket=s3_server.bucket, Key="p/r/packs/w-000000.gqpack")
    assert head["ContentLength"] == len(data)
    tail, size = store.get_pack_tail("r", pack_name("w", 0), 1000)
    assert (len(tail), size) == (1000, len(data))
