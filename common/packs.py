"""Packs: a run's converted items, written once, compressed, and read back by range (pure).

By reference (`--prompts reference`) the producer writes its items into packs in the run's output
store (common/storage/names.py names them) and a job names a pack and a block instead of carrying
its items. This module is the format alone: bytes in, bytes out, no I/O. Layout, little-endian:

    header   b"GQPK", u16 version, u16 reserved                           (8 bytes)
    blocks   one zstd frame each (content size and content checksum on):
             the orjson of a JSON array of the block's items
    index    one entry per block: u64 offset, u32 length, u32 items, u32 crc32 of the frame
    footer   u64 index offset, u32 blocks, u32 crc32 of the index, u32 items,
             u16 version, u16 reserved, b"GQPK"                            (28 bytes)

The footer is at the end so a reader holding only the pack's size can fetch its tail, then the
blocks it needs (a ranged GET); a block's entry (offset, length, crc32) is all a reader needs to
check and decode it alone. Every read checks what it reads: the magic and version, the index's
crc32, each block's crc32 (and zstd's own checksum), and that a block holds as many items as
its entry says. A pack that fails raises a PackError subclass naming the pack; nothing is ever
skipped. Why this format: docs/decisions.md, "Packs: a zstd frame a block, an index at the end".
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from itertools import accumulate

import orjson
import zstandard

from genqueue.common import defaults
from genqueue.common.contracts import Item
from genqueue.common.errors import PackCorruptError, PackRangeError, PackTruncatedError, PackVersionError

#: zstd level of a pack's blocks: zstd's default, faster than rq's zlib 1 and 11% smaller (BENCHMARKS.md, "Packs").
PACK_ZSTD_LEVEL = 3
#: Items per block, the unit a reader fetches: an inline job's worth, so a job's range is one ranged GET (~36 KB).
PACK_BLOCK_ITEMS = defaults.BATCH_SIZE


class PackFormat(IntEnum):
    """The format versions this genqueue reads (a header's and a footer's u16); it writes the
    last. A change of layout is a new member, read beside the old ones."""

    V1 = 1


MAGIC = b"GQPK"
VERSION = max(PackFormat)
READABLE = frozenset(int(v) for v in PackFormat)
HEADER = struct.Struct("<4sHH")
ENTRY = struct.Struct("<QIII")
FOOTER = struct.Struct("<QIIIHH4s")
#: The smallest pack: a header, no blocks, an empty index, a footer.
MIN_SIZE = HEADER.size + FOOTER.size


def _versions() -> str:
    return "version " + ", ".join(str(v) for v in sorted(READABLE))


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """One block of a pack: where its frame is, its items (FIRST is the pack's ordinal of its
    first item) and the crc32 of its frame."""

    offset: int
    length: int
    first: int
    count: int
    crc32: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class Footer:
    """What a pack's last FOOTER.size bytes say: where its index is and how long."""

    index_offset: int
    blocks: int
    index_crc32: int
    items: int

    @property
    def index_length(self) -> int:
        return self.blocks * ENTRY.size


@dataclass(frozen=True, slots=True)
class PackIndex:
    """A pack's blocks in order, and how many items it holds."""

    blocks: tuple[BlockEntry, ...]
    items: int

    def blocks_for(self, start: int, count: int, where: str) -> tuple[BlockEntry, ...]:
        """The blocks holding items START..START+COUNT-1 of the pack. PackRangeError when the
        pack does not hold them all (or the range is empty)."""
        if start < 0 or count <= 0 or start + count > self.items:
            raise PackRangeError(where, f"items {start}..{start + count - 1} asked, the pack holds 0..{self.items - 1}")
        lo = _bisect_first(self.blocks, start)
        hi = _bisect_first(self.blocks, start + count - 1)
        return self.blocks[lo:hi + 1]

    def span(self, start: int, count: int, where: str) -> tuple[int, int]:
        """The byte range [lo, hi) of the pack that holds items START..START+COUNT-1: what a
        ranged GET fetches for one job."""
        blocks = self.blocks_for(start, count, where)
        return blocks[0].offset, blocks[-1].end


def _bisect_first(blocks: tuple[BlockEntry, ...], item: int) -> int:
    """The position of the block holding item ordinal ITEM (blocks are in item order)."""
    lo, hi = 0, len(blocks) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks[mid].first <= item:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- writing ---------------------------------------------------------------------------
class PackWriter:
    """Builds one pack in memory, a block at a time: `add_block` per block (a job's items, or
    any run of items), then `finish` for the pack's bytes. One writer, one pack."""

    def __init__(self, *, level: int = PACK_ZSTD_LEVEL) -> None:
        self._zstd = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        self._buf = bytearray(HEADER.pack(MAGIC, VERSION, 0))
        self._entries: list[BlockEntry] = []
        self._items = 0
        self._done = False

    @property
    def items(self) -> int:
        return self._items

    @property
    def size(self) -> int:
        """Bytes written so far (the blocks; the index and footer add ENTRY.size a block and
        FOOTER.size): a caller can cut packs by size."""
        return len(self._buf)

    def add_block(self, items: Sequence[Item]) -> BlockEntry:
        """Append ITEMS as one block; returns its entry (which a job can carry)."""
        if self._done:
            raise RuntimeError("this pack is finished")
        if not items:
            raise ValueError("a block holds at least one item")
        frame = self._zstd.compress(orjson.dumps(list(items)))
        entry = BlockEntry(len(self._buf), len(frame), self._items, len(items), zlib.crc32(frame))
        self._buf += frame
        self._entries.append(entry)
        self._items += len(items)
        return entry

    def finish(self) -> bytes:
        """The pack: header, blocks, index, footer."""
        self._done = True
        index = b"".join(ENTRY.pack(e.offset, e.length, e.count, e.crc32) for e in self._entries)
        index_offset = len(self._buf)
        self._buf += index
        self._buf += FOOTER.pack(index_offset, len(self._entries), zlib.crc32(index), self._items, VERSION, 0, MAGIC)
        return bytes(self._buf)


def write_pack(items: Iterable[Item], *, block_items: int = PACK_BLOCK_ITEMS,
               level: int = PACK_ZSTD_LEVEL) -> bytes:
    """A pack of ITEMS in blocks of BLOCK_ITEMS (the last may be shorter)."""
    if block_items < 1:
        raise ValueError(f"blocks of at least one item, not {block_items}")
    w = PackWriter(level=level)
    block: list[Item] = []
    for it in items:
        block.append(it)
        if len(block) == block_items:
            w.add_block(block)
            block = []
    if block:
        w.add_block(block)
    return w.finish()


# --- reading ---------------------------------------------------------------------------
def read_footer(tail: bytes, size: int, where: str) -> Footer:
    """The footer of a pack of SIZE bytes from TAIL, its last bytes (at least FOOTER.size)."""
    if size < MIN_SIZE or len(tail) < FOOTER.size:
        raise PackTruncatedError(where, f"{size} bytes, shorter than the {MIN_SIZE} of an empty pack")
    index_offset, blocks, crc, items, version, _, magic = FOOTER.unpack_from(tail, len(tail) - FOOTER.size)
    if magic != MAGIC:
        raise PackTruncatedError(where, "no pack footer at its end (cut short, or not a pack)")
    if version not in READABLE:
        raise PackVersionError(where, f"format version {version}; this genqueue reads {_versions()}")
    footer = Footer(index_offset, blocks, crc, items)
    if index_offset < HEADER.size or index_offset + footer.index_length + FOOTER.size != size:
        raise PackCorruptError(where, f"its footer places an index of {blocks} blocks at {index_offset}, "
                                      f"which does not end where the {size}-byte pack does")
    return footer


def parse_index(raw: bytes, footer: Footer, where: str) -> PackIndex:
    """The index from RAW, its bytes as FOOTER places them, checked against the footer."""
    if len(raw) != footer.index_length:
        raise PackTruncatedError(where, f"index of {len(raw)} bytes, the footer says {footer.index_length}")
    if zlib.crc32(raw) != footer.index_crc32:
        raise PackCorruptError(where, "the index's crc32 does not match its footer")
    entries: list[BlockEntry] = []
    firsts = accumulate((c for _, _, c, _ in ENTRY.iter_unpack(raw)), initial=0)
    prev_end = HEADER.size
    for (offset, length, count, crc), first in zip(ENTRY.iter_unpack(raw), firsts, strict=False):
        if offset != prev_end or count == 0:
            raise PackCorruptError(where, f"block {len(entries)} of its index is out of place")
        entries.append(BlockEntry(offset, length, first, count, crc))
        prev_end = offset + length
    total = entries[-1].first + entries[-1].count if entries else 0
    if prev_end != footer.index_offset or total != footer.items:
        raise PackCorruptError(where, f"its index covers {total} items ending at byte {prev_end}; "
                                      f"the footer says {footer.items} items, index at {footer.index_offset}")
    return PackIndex(tuple(entries), total)


def read_index(data: bytes, where: str) -> PackIndex:
    """The index of a whole pack DATA (held in memory or read from a file), its header checked."""
    if len(data) >= HEADER.size:
        magic, version, _ = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise PackVersionError(where, "not a pack (no GQPK header)")
        if version not in READABLE:
            raise PackVersionError(where, f"format version {version}; this genqueue reads {_versions()}")
    footer = read_footer(data[-FOOTER.size:], len(data), where)
    return parse_index(data[footer.index_offset:footer.index_offset + footer.index_length], footer, where)


def index_from_tail(tail: bytes, size: int, where: str) -> PackIndex | Footer:
    """The index from TAIL, the last bytes of a pack of SIZE bytes: a PackIndex when TAIL holds
    the whole index, else the Footer, which says which bytes to fetch for it (parse_index)."""
    footer = read_footer(tail, size, where)
    need = footer.index_length + FOOTER.size
    if len(tail) < need:
        return footer
    start = len(tail) - need
    return parse_index(tail[start:start + footer.index_length], footer, where)


def decode_block(frame: bytes, entry: BlockEntry, where: str) -> list[Item]:
    """The items of one block from FRAME, its bytes, checked against its ENTRY."""
    if len(frame) != entry.length:
        raise PackTruncatedError(where, f"block at {entry.offset}: {len(frame)} bytes, its index says {entry.length}")
    if zlib.crc32(frame) != entry.crc32:
        raise PackCorruptError(where, f"block at {entry.offset}: crc32 does not match its index")
    try:
        items = orjson.loads(zstandard.ZstdDecompressor().decompress(frame))
    except (zstandard.ZstdError, orjson.JSONDecodeError) as e:
        raise PackCorruptError(where, f"block at {entry.offset} does not decode: {e}") from None
    if not isinstance(items, list) or len(items) != entry.count or not all(isinstance(i, dict) for i in items):
        raise PackCorruptError(where, f"block at {entry.offset} does not hold the {entry.count} items its index says")
    return items


def read_span(span: bytes, span_offset: int, index: PackIndex, start: int, count: int, where: str) -> list[Item]:
    """Items START..START+COUNT-1 from SPAN, the pack's bytes from SPAN_OFFSET on (a ranged
    fetch of index.span(...), or the whole pack with SPAN_OFFSET 0)."""
    out: list[Item] = []
    for entry in index.blocks_for(start, count, where):
        lo = entry.offset - span_offset
        if lo < 0:
            raise PackRangeError(where, f"block at {entry.offset} lies before the bytes given (from {span_offset})")
        items = decode_block(span[lo:lo + entry.length], entry, where)
        out += items[max(start - entry.first, 0):start + count - entry.first]
    return out


def read_items(data: bytes, start: int, count: int, where: str, *, index: PackIndex | None = None) -> list[Item]:
    """Items START..START+COUNT-1 of the whole pack DATA (its INDEX, when the caller keeps it)."""
    return read_span(data, 0, index if index is not None else read_index(data, where), start, count, where)
