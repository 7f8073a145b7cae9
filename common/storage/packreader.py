"""Reading a job's items from its pack (prompts by reference): from the host's disk cache of
whole packs when there is one, else the pack's index once and one ranged GET of the job's block.

With a disk cache (common/storage/packcache.py, `consumer run --pack-cache`) a pack not cached is
fetched whole, checked and renamed into the cache directory the host's consumers share; each
job's block is then read from the local file. Without one, per pack the reader fetches the tail
once (PACK_TAIL_BYTES: the footer and, mostly, the whole index; a larger index takes one more
ranged GET), and each job one ranged GET of its block. Either way the index of the last
PACK_INDEX_CACHE packs read stays in memory, and each block is decompressed and checked.

Errors: a pack that is not there raises PackNotFoundError, one that does not read as a pack a
PackError; both are the pack's fault, and its job fails with them (never a skip). A StoreError
is the store's trouble now (an outage): the job goes back to its queue. An index found bad is
dropped (the next read fetches it), a cached file found bad deleted and fetched again at once.
Thread-safe: the consumer reads from worker threads (the intake's, the end-of-run copies').

Counters (`counts()`, the consumer's genqueue_pack_reads): GETs by kind (whole packs, tails,
indexes, blocks), the bytes they brought, and the blocks read from the disk cache (hits) or after
fetching their pack (misses).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from genqueue.common.contracts import Item
from genqueue.common.errors import PackError, PackRangeError
from genqueue.common.packs import BlockEntry, PackIndex, decode_block, index_from_tail, parse_index, read_index
from genqueue.common.storage.base import PackStore
from genqueue.common.storage.packcache import PackCache

log = logging.getLogger(__name__)

#: Bytes of a pack's end fetched first: 64 KiB holds its footer and an index of 3,000 blocks (~100,000 items).
TAIL_BYTES = 64 * 1024
#: Pack indexes kept in memory (~20 KB each): the jobs a consumer holds come from a few packs.
INDEX_CACHE = 8


@dataclass(slots=True)
class PackCounts:
    """What reading packs cost since the reader was made (the module docstring's counters)."""

    whole_fetches: int = 0  # GETs of a whole pack (disk cache misses)
    ranged_fetches: int = 0  # ranged GETs: tails, indexes, blocks
    bytes_fetched: int = 0  # bytes those GETs brought
    cache_hits: int = 0  # blocks read from a pack already in the disk cache
    cache_misses: int = 0  # blocks whose pack was fetched whole first
    index_hits: int = 0  # blocks read with an index kept in memory


class PackReader:
    """Reads blocks of packs through STORE_FOR(output), keeping the last CACHE packs' indexes, and
    the packs themselves in DISK when given."""

    def __init__(self, store_for: Callable[[str], PackStore], *, cache: int = INDEX_CACHE,
                 tail_bytes: int = TAIL_BYTES, disk: PackCache | None = None) -> None:
        self._store_for = store_for
        self._stores: dict[str, PackStore] = {}
        self._indexes: OrderedDict[tuple[str, str, str], PackIndex] = OrderedDict()
        self._cache = max(1, cache)
        self._tail = tail_bytes
        self.disk = disk
        self._lock = threading.Lock()  # the caches and the counters; no read is made holding it
        self._counts = PackCounts()

    # --- counters -------------------------------------------------------------------------
    @property
    def fetches(self) -> int:
        """GETs made (whole packs, tails, indexes, blocks): what a job by reference costs."""
        with self._lock:
            return self._counts.whole_fetches + self._counts.ranged_fetches

    @property
    def index_hits(self) -> int:
        with self._lock:
            return self._counts.index_hits

    def counts(self) -> dict[str, int]:
        """The counters by name (PackCounts' fields)."""
        with self._lock:
            return asdict(self._counts)

    def _fetched(self, data: bytes, *, whole: bool = False) -> bytes:
        with self._lock:
            if whole:
                self._counts.whole_fetches += 1
            else:
                self._counts.ranged_fetches += 1
            self._counts.bytes_fetched += len(data)
        return data

    # --- the store and the indexes --------------------------------------------------------
    def _store(self, output: str) -> PackStore:
        with self._lock:
            store = self._stores.get(output)
        if store is None:
            store = self._store_for(output)
            with self._lock:
                store = self._stores.setdefault(output, store)
        return store

    def _remembered(self, key: tuple[str, str, str]) -> PackIndex | None:
        with self._lock:
            got = self._indexes.get(key)
            if got is not None:
                self._indexes.move_to_end(key)
                self._counts.index_hits += 1
            return got

    def _remember(self, key: tuple[str, str, str], index: PackIndex) -> None:
        with self._lock:
            self._indexes[key] = index
            self._indexes.move_to_end(key)
            while len(self._indexes) > self._cache:
                self._indexes.popitem(last=False)

    def _forget(self, key: tuple[str, str, str]) -> None:
        with self._lock:
            self._indexes.pop(key, None)

    def index(self, output: str, run: str, name: str) -> PackIndex:
        """The index of RUN's pack NAME at OUTPUT (kept in memory), from its tail in the store.
        Raises PackNotFoundError, PackError, StoreError."""
        key = (output, run, name)
        if (got := self._remembered(key)) is not None:
            return got
        store = self._store(output)
        where = store.pack_location(run, name)
        tail, size = store.get_pack_tail(run, name, self._tail)
        self._fetched(tail)
        found = index_from_tail(tail, size, where)
        if not isinstance(found, PackIndex):  # an index longer than the tail: one more GET
            raw = self._fetched(store.get_pack_range(run, name, found.index_offset,
                                                     found.index_offset + found.index_length))
            found = parse_index(raw, found, where)
        self._remember(key, found)
        return found

    # --- blocks ---------------------------------------------------------------------------
    def block(self, output: str, run: str, name: str, block: int) -> list[Item]:
        """The items of block number BLOCK of RUN's pack NAME at OUTPUT. Raises
        PackNotFoundError, PackError (PackRangeError: no such block), StoreError."""
        return self.placed_block(output, run, name, block)[0]

    def placed_block(self, output: str, run: str, name: str, block: int) -> tuple[list[Item], int]:
        """`block`, and the pack's ordinal of the block's first item (the slot of its place)."""
        if self.disk is not None:
            return self._block_on_disk(self.disk, output, run, name, block)
        index = self.index(output, run, name)
        store = self._store(output)
        where = store.pack_location(run, name)
        entry = _entry(index, block, where)
        frame = self._fetched(store.get_pack_range(run, name, entry.offset, entry.end))
        try:
            return decode_block(frame, entry, where), entry.first
        except PackError:
            self._forget((output, run, name))  # fetched again next time
            raise

    def _block_on_disk(self, disk: PackCache, output: str, run: str, name: str,
                       block: int) -> tuple[list[Item], int]:
        key = (output, run, name)
        store = self._store(output)
        where = store.pack_location(run, name)
        path = disk.path(store, run, name)
        fh = disk.open(path)
        if fh is None:
            with disk.fetching(path):
                fh = disk.open(path)  # another thread of ours may have fetched it meanwhile
                if fh is None:
                    return self._fetch_whole(disk, store, key, path, block, where)
        with fh:
            try:
                index = self._remembered(key) or self._file_index(key, fh, where)
                entry = _entry(index, block, where)
                fh.seek(entry.offset)
                items = decode_block(fh.read(entry.length), entry, where)
            except PackRangeError:
                raise  # the job asks a block the pack (checked) lacks: fetching again cannot help
            except PackError as e:
                log.warning("cached pack %s does not read (%s): removed, fetched again", path, e)
                self._forget(key)
                disk.discard(path)
            else:
                with self._lock:
                    self._counts.cache_hits += 1
                return items, entry.first
        with disk.fetching(path):
            return self._fetch_whole(disk, store, key, path, block, where)

    def _file_index(self, key: tuple[str, str, str], fh: IO[bytes], where: str) -> PackIndex:
        """The index of the cached pack open as FH (a local read of its tail), remembered."""
        size = fh.seek(0, 2)
        fh.seek(max(0, size - self._tail))
        found = index_from_tail(fh.read(), size, where)
        if not isinstance(found, PackIndex):
            fh.seek(found.index_offset)
            found = parse_index(fh.read(found.index_length), found, where)
        self._remember(key, found)
        return found

    def _fetch_whole(self, disk: PackCache, store: PackStore, key: tuple[str, str, str], path: Path, block: int,
                     where: str) -> tuple[list[Item], int]:
        """Fetch the pack whole, check its frame (header, footer, index), put it in the cache, and
        read BLOCK from memory. A block whose crc32 does not match fails its own job only (as a
        ranged read of it would): the other blocks of the pack are good, and are read from the
        cached file (which a bad read of that block removes and fetches again, at most once a
        job of that block)."""
        data = self._fetched(store.get_pack(key[1], key[2]), whole=True)
        index = read_index(data, where)  # a pack whose frame is bad: the pack's fault, never cached
        self._remember(key, index)
        disk.keep(path, data)
        entry = _entry(index, block, where)
        items = decode_block(data[entry.offset:entry.end], entry, where)
        with self._lock:
            self._counts.cache_misses += 1
        return items, entry.first


def _entry(index: PackIndex, block: int, where: str) -> BlockEntry:
    if not 0 <= block < len(index.blocks):
        raise PackRangeError(where, f"block {block} asked, the pack holds {len(index.blocks)}")
    return index.blocks[block]
