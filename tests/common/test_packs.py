"""Packs (common/packs.py): items written into a pack come back by any range, from the whole pack
or from the bytes a ranged fetch gets, and a pack that is cut, garbled or of another version
raises its PackError class: never a silent skip, never wrong items."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genqueue.common import packs
from genqueue.common.contracts import Item
from genqueue.common.errors import (
    GenqueueError,
    PackCorruptError,
    PackError,
    PackRangeError,
    PackTruncatedError,
    PackVersionError,
)
from genqueue.common.packs import FOOTER, HEADER, Footer, PackIndex, PackWriter


def item(i: int, words: int = 30) -> Item:
    text = " ".join(f"w{(i * 7 + k) % 97}" for k in range(words))
    it: Item = {"key": f"{i:032x}", "index": i, "turn": None,
                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{text} ({i})"}]}
    if i % 5 == 0:
        it["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        it["source_seq"] = 1
    return it


ITEMS = [item(i) for i in range(100)]


def test_every_range_comes_back_from_the_whole_pack() -> None:
    data = packs.write_pack(ITEMS, block_items=8)
    index = packs.read_index(data, "p")
    assert index.items == 100 and len(index.blocks) == 13 and index.blocks[-1].count == 4
    for start, count in [(0, 1), (0, 100), (7, 2), (8, 8), (5, 32), (99, 1), (60, 40)]:
        assert packs.read_items(data, start, count, "p") == ITEMS[start:start + count]
        assert packs.read_items(data, start, count, "p", index=index) == ITEMS[start:start + count]


def test_a_range_comes_back_from_the_bytes_of_a_ranged_fetch_alone() -> None:
    """What a consumer does with S3: the tail (footer and index), then only its blocks' bytes."""
    data = packs.write_pack(ITEMS, block_items=8)
    tail = data[-packs.FOOTER.size - 3 * packs.ENTRY.size:]  # too short for the whole index
    got = packs.index_from_tail(tail, len(data), "p")
    assert isinstance(got, Footer)
    index = packs.parse_index(data[got.index_offset:got.index_offset + got.index_length], got, "p")
    assert packs.index_from_tail(data[-4096:], len(data), "p") == index
    lo, hi = index.span(10, 20, "p")
    assert (lo, hi) == (index.blocks[1].offset, index.blocks[3].end)
    assert packs.read_span(data[lo:hi], lo, index, 10, 20, "p") == ITEMS[10:30]
    with pytest.raises(PackRangeError):  # bytes that do not reach back to the block
        packs.read_span(data[lo + 1:hi], lo + 1, index, 10, 20, "p")


def test_blocks_as_the_caller_cuts_them_and_their_entries() -> None:
    w = PackWriter()
    e1 = w.add_block(ITEMS[:3])
    e2 = w.add_block(ITEMS[3:35])
    data = w.finish()
    assert (e1.first, e1.count, e2.first, e2.count) == (0, 3, 3, 32)
    assert e2.offset == e1.end and w.items == 35
    # an entry a job carries is enough to check and decode its block alone
    assert packs.decode_block(data[e2.offset:e2.end], e2, "p") == ITEMS[3:35]
    assert packs.read_index(data, "p").blocks == (e1, e2)
    with pytest.raises(RuntimeError):
        w.add_block(ITEMS[:1])
    with pytest.raises(ValueError):
        PackWriter().add_block([])


def test_an_empty_pack_reads_as_empty() -> None:
    data = packs.write_pack([])
    assert len(data) == packs.MIN_SIZE
    assert packs.read_index(data, "p") == PackIndex((), 0)
    with pytest.raises(PackRangeError):
        packs.read_items(data, 0, 1, "p")


@pytest.mark.parametrize(("start", "count"), [(-1, 2), (0, 0), (99, 2), (100, 1), (0, 101)])
def test_a_range_the_pack_does_not_hold_is_refused(start: int, count: int) -> None:
    data = packs.write_pack(ITEMS, block_items=16)
    with pytest.raises(PackRangeError, match="pack p: items"):
        packs.read_items(data, start, count, "p")


def test_every_cut_of_a_pack_is_an_error() -> None:
    data = packs.write_pack(ITEMS[:20], block_items=4)
    for n in range(len(data)):
        with pytest.raises(PackError):
            packs.read_items(data[:n], 0, 20, "p")
    assert isinstance(PackTruncatedError("p", "x"), GenqueueError)
    with pytest.raises(PackTruncatedError, match="pack s3://b/r/packs/x: no pack footer"):
        packs.read_index(data[:-1], "s3://b/r/packs/x")


def test_every_flipped_byte_is_an_error_or_changes_nothing() -> None:
    """One bad byte anywhere: the read raises, or (the reserved fields) gives the very items
    written. Never other items."""
    data = packs.write_pack(ITEMS[:12], block_items=4)
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x41
        try:
            got = packs.read_items(bytes(bad), 0, 12, "p")
        except PackError:
            continue
        assert got == ITEMS[:12], pos


def test_each_kind_of_damage_names_its_class() -> None:
    data = packs.write_pack(ITEMS, block_items=10)
    index = packs.read_index(data, "p")
    block = bytearray(data)
    block[index.blocks[2].offset + 5] ^= 1
    assert packs.read_items(bytes(block), 0, 20, "p") == ITEMS[:20]  # the damaged block is not read
    with pytest.raises(PackCorruptError, match="crc32 does not match"):
        packs.read_items(bytes(block), 20, 1, "p")
    idx = bytearray(data)
    idx[-FOOTER.size - 1] ^= 1
    with pytest.raises(PackCorruptError, match="index's crc32"):
        packs.read_index(bytes(idx), "p")
    with pytest.raises(PackVersionError, match="not a pack"):
        packs.read_index(b"PK\x03\x04" + data[4:], "p")
    v2_head = HEADER.pack(packs.MAGIC, 2, 0) + data[HEADER.size:]
    with pytest.raises(PackVersionError, match="format version 2"):
        packs.read_index(v2_head, "p")
    off, blocks, crc, items, _, res, magic = FOOTER.unpack(data[-FOOTER.size:])
    v2_foot = data[:-FOOTER.size] + FOOTER.pack(off, blocks, crc, items, 2, res, magic)
    with pytest.raises(PackVersionError):
        packs.read_index(v2_foot, "p")
    lying = data[:-FOOTER.size] + FOOTER.pack(off, blocks, crc, items + 1, 1, res, magic)
    with pytest.raises(PackCorruptError, match="the footer says 101 items"):
        packs.read_index(lying, "p")


def test_a_block_that_decodes_to_other_than_its_items_is_corrupt() -> None:
    """A frame with a valid crc32 and zstd checksum that holds the wrong thing (a writer's bug):
    still refused, by the count the index gives."""
    import zlib

    import zstandard

    frame = zstandard.ZstdCompressor().compress(b'[{"key": 1}]')
    entry = packs.BlockEntry(8, len(frame), 0, 2, zlib.crc32(frame))
    with pytest.raises(PackCorruptError, match="does not hold the 2 items"):
        packs.decode_block(frame, entry, "p")
    not_json = zstandard.ZstdCompressor().compress(b"\xff{")
    with pytest.raises(PackCorruptError, match="does not decode"):
        packs.decode_block(not_json, packs.BlockEntry(8, len(not_json), 0, 1, zlib.crc32(not_json)), "p")


def test_the_layout_is_what_the_docstring_says() -> None:
    data = packs.write_pack(ITEMS[:3], block_items=2)
    assert data[:4] == b"GQPK" and struct.unpack_from("<H", data, 4) == (1,)
    assert data[-4:] == b"GQPK" and (HEADER.size, FOOTER.size, packs.ENTRY.size) == (8, 28, 20)


_text = st.text(max_size=40)
_items = st.lists(st.builds(lambda i, t, s: {"key": f"{i:032x}", "index": i, "turn": None,
                                             "messages": [{"role": "user", "content": t}], "source": s},
                            st.integers(0, 10**6), _text, _text), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(_items, st.integers(1, 17), st.data())
def test_round_trip_of_any_items_and_range(items: list[Item], block_items: int, data: st.DataObject) -> None:
    pack = packs.write_pack(items, block_items=block_items, level=1)
    start = data.draw(st.integers(0, len(items) - 1))
    count = data.draw(st.integers(1, len(items) - start))
    index = packs.read_index(pack, "p")
    assert packs.read_items(pack, start, count, "p") == items[start:start + count]
    lo, hi = index.span(start, count, "p")
    assert packs.read_span(pack[lo:hi], lo, index, start, count, "p") == items[start:start + count]
