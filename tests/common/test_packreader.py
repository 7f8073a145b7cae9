"""common/storage/packreader.py on a real local store: a job's block by one ranged read after
the pack's tail once, indexes kept for a few packs, an index longer than the tail, and the
errors a job by reference fails or waits on."""

from __future__ import annotations

from pathlib import Path

import pytest

from genqueue.common import packs
from genqueue.common.contracts import Item
from genqueue.common.errors import PackCorruptError, PackError, PackRangeError
from genqueue.common.storage import LocalStore, PackNotFoundError, PackStore
from genqueue.common.storage.packreader import PackReader


def items(n: int, first: int = 0) -> list[Item]:
    return [{"key": f"{i:032x}", "index": i, "messages": [{"role": "user", "content": f"q{i} " * 20}]}  # type: ignore[typeddict-item]
            for i in range(first, first + n)]


def pack_of(blocks: list[list[Item]]) -> bytes:
    w = packs.PackWriter()
    for b in blocks:
        w.add_block(b)
    return w.finish()


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "out")


def test_blocks_come_back_with_one_tail_read_per_pack(store: LocalStore) -> None:
    blocks = [items(8, 8 * b) for b in range(5)]
    store.put_pack("r", "w-000001.gqpack", pack_of(blocks))
    reader = PackReader(lambda out: store)
    for b in (3, 0, 4):
        assert reader.block("out", "r", "w-000001.gqpack", b) == blocks[b]
    assert reader.fetches == 1 + 3 and reader.index_hits == 2  # the tail once, then a GET a block


def test_the_index_cache_is_bounded_least_recently_used_first_out(store: LocalStore) -> None:
    for n in range(1, 4):
        store.put_pack("r", f"w-{n:06d}.gqpack", pack_of([items(2, 10 * n)]))
    reader = PackReader(lambda out: store, cache=2)
    for n in (1, 2, 1, 3):  # 3 pushes out 2, the least recently used
        reader.block("out", "r", f"w-{n:06d}.gqpack", 0)
    before = reader.fetches
    reader.block("out", "r", "w-000001.gqpack", 0)
    assert reader.fetches == before + 1  # 1 still cached: its block only
    reader.block("out", "r", "w-000002.gqpack", 0)
    assert reader.fetches == before + 3  # 2 was evicted: its tail again


def test_an_index_longer_than_the_tail_costs_one_more_read(store: LocalStore) -> None:
    blocks = [items(1, b) for b in range(40)]
    store.put_pack("r", "w-000001.gqpack", pack_of(blocks))
    reader = PackReader(lambda out: store, tail_bytes=64)
    assert reader.block("out", "r", "w-000001.gqpack", 39) == blocks[39]
    assert reader.fetches == 3


def test_what_fails_a_job_and_what_makes_it_wait(store: LocalStore, tmp_path: Path) -> None:
    reader = PackReader(lambda out: store)
    with pytest.raises(PackNotFoundError):
        reader.block("out", "r", "w-000009.gqpack", 0)
    store.put_pack("r", "w-000001.gqpack", pack_of([items(4)]))
    with pytest.raises(PackRangeError, match="block 1 asked"):
        reader.block("out", "r", "w-000001.gqpack", 1)
    # a block garbled after its index was read: a PackError, and the index is read again next time
    path = Path(store.pack_location("r", "w-000001.gqpack"))
    raw = bytearray(path.read_bytes())
    raw[packs.HEADER.size + 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(PackCorruptError):
        reader.block("out", "r", "w-000001.gqpack", 0)
    path.write_bytes(b"not a pack at all")
    with pytest.raises(PackError):
        reader.block("out", "r", "w-000001.gqpack", 0)


def test_a_store_per_output(store: LocalStore, tmp_path: Path) -> None:
    asked: list[str] = []

    def store_for(out: str) -> PackStore:
        asked.append(out)
        return store

    store.put_pack("r", "w-000001.gqpack", pack_of([items(2)]))
    reader = PackReader(store_for)
    reader.block("a", "r", "w-000001.gqpack", 0)
    reader.block("a", "r", "w-000001.gqpack", 0)
    assert asked == ["a"]
