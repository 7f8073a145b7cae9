"""Reading a job's items from its pack (issue 34, by reference): the pack's index once, then
one ranged GET of the job's block.

Per pack the reader fetches the tail once (PACK_TAIL_BYTES: the footer and, mostly, the whole
index; a larger index takes one more ranged GET) and keeps the index in memory, for the last
PACK_INDEX_CACHE packs read (least recently used first out); each job then costs one ranged GET
of its block (about 36 KB for 32 items of 1-4 KB) and one decompression. Nothing is written to
disk (a shared disk cache of whole packs is a later step, docs/design.md).

Errors: a pack that is not there raises PackNotFoundError, one that does not read as a pack a
PackError (common/errors.py); both are the pack's fault, and its job fails with them (never a
skip). A StoreError is the store's trouble now (an outage, a timeout): the job goes back to its
queue. An index found bad is dropped from the cache, so the next read fetches it again.
Thread-safe: the consumer reads from worker threads (the intake's, the end-of-run copies').
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from genqueue.common import defaults
from genqueue.common.contracts import Item
from genqueue.common.errors import PackError, PackRangeError
from genqueue.common.packs import PackIndex, decode_block, index_from_tail, parse_index
from genqueue.common.storage.base import PackStore

TAIL_BYTES = defaults.PACK_TAIL_BYTES
INDEX_CACHE = defaults.PACK_INDEX_CACHE


class PackReader:
    """Reads blocks of packs through STORE_FOR(output), keeping the last CACHE packs' indexes."""

    def __init__(self, store_for: Callable[[str], PackStore], *, cache: int = INDEX_CACHE,
                 tail_bytes: int = TAIL_BYTES) -> None:
        self._store_for = store_for
        self._stores: dict[str, PackStore] = {}
        self._indexes: OrderedDict[tuple[str, str, str], PackIndex] = OrderedDict()
        self._cache = max(1, cache)
        self._tail = tail_bytes
        self._lock = threading.Lock()  # the cache and the counters; no read is made holding it
        self.fetches = 0  # GETs made (tails, indexes, blocks): what a job by reference costs
        self.index_hits = 0  # blocks read with a cached index

    def _store(self, output: str) -> PackStore:
        with self._lock:
            store = self._stores.get(output)
        if store is None:
            store = self._store_for(output)
            with self._lock:
                store = self._stores.setdefault(output, store)
        return store

    def index(self, output: str, run: str, name: str) -> PackIndex:
        """The index of RUN's pack NAME at OUTPUT (cached). Raises PackNotFoundError, PackError,
        StoreError."""
        key = (output, run, name)
        with self._lock:
            got = self._indexes.get(key)
            if got is not None:
                self._indexes.move_to_end(key)
                self.index_hits += 1
                return got
        store = self._store(output)
        where = store.pack_location(run, name)
        tail, size = store.get_pack_tail(run, name, self._tail)
        self._count()
        found = index_from_tail(tail, size, where)
        if not isinstance(found, PackIndex):  # an index longer than the tail: one more GET
            raw = store.get_pack_range(run, name, found.index_offset, found.index_offset + found.index_length)
            self._count()
            found = parse_index(raw, found, where)
        with self._lock:
            self._indexes[key] = found
            while len(self._indexes) > self._cache:
                self._indexes.popitem(last=False)
        return found

    def _count(self) -> None:
        with self._lock:
            self.fetches += 1

    def block(self, output: str, run: str, name: str, block: int) -> list[Item]:
        """The items of block number BLOCK of RUN's pack NAME at OUTPUT. Raises
        PackNotFoundError, PackError (PackRangeError: no such block), StoreError."""
        index = self.index(output, run, name)
        store = self._store(output)
        where = store.pack_location(run, name)
        if not 0 <= block < len(index.blocks):
            raise PackRangeError(where, f"block {block} asked, the pack holds {len(index.blocks)}")
        entry = index.blocks[block]
        frame = store.get_pack_range(run, name, entry.offset, entry.end)
        self._count()
        try:
            return decode_block(frame, entry, where)
        except PackError:
            with self._lock:
                self._indexes.pop((output, run, name), None)  # fetched again next time
            raise
