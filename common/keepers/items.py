"""A run's item table: which items are in the run, done and failed, in a few bytes an item.

Every item of a run has one entry, its 16-byte digest (runs.py `key_digest`) -> its state bits
(IN_RUN: a producer claimed it; DONE: a shipped shard holds its result; FAILED: a shipped shard
holds an error record of it), or for an item by reference its place in its pack; how the entries
are kept in Redis, and the Lua every script of the table shares, is itemlayout.py's. The table
holds the counts of the states, kept by the same scripts that change the states, in the same
call, so they agree at every moment (status reads them in O(1)).

ItemTable is the table's reader, and its writer outside the claim script (claims.py) and the
marking script (marks.py): its size, fixed once by the first writer from the run's expected
items (about ITEMS_PER_BUCKET items a bucket); the states of digests; setting and clearing
bits; the counts; every digest it holds; an export's coverage (`fill_missing`).

Earlier layouts read here: a table without `layout` keeps a hash a bucket (every primitive reads
and writes both), and a run made before the table has its three sets moved in (`migrate_sets`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import redis

from genqueue.common.keepers.itemlayout import (
    BLOBS,
    DEFAULT_BUCKETS,
    LAYOUT,
    LUA_FIX,
    LUA_ITEMS,
    MOVED,
    PACK_SLOTS,
    REBUILT,
    bucket_key,
    place_key,
    records,
)
from genqueue.common.keepers.keeper import RUN_KEY, RunKeeper, run_key

#: An item's state bits.
IN_RUN, DONE, FAILED = 1, 2, 4

#: Items per bucket of a run's item table: a listpack of 128 entries with room for a fuller bucket.
ITEMS_PER_BUCKET = 64
#: The most buckets a run's table gets (a billion items); a larger run's buckets grow instead.
MAX_BUCKETS = 1 << 24
#: Entries a bucket holds as a listpack when CONFIG GET does not say (Redis's default).
LISTPACK_ENTRIES = 128

#: The table's fields that count states (the scripts keep them).
COUNTS = ("in_run", "done", "failed", "failed_done", "in_run_done")


# KEYS: the table. ARGV: '1' to read nothing unless the table's marks were ever rebuilt (a job's
# first take: `ItemTable.states`), '0' to read; then digests. One byte per digest, '0' + its state
# bits: the answer is one string, not three integers an item; an empty one when nothing was read.
_STATES = LUA_ITEMS + """
if ARGV[1] == '1' and redis.call('HEXISTS', KEYS[1], '""" + REBUILT + """') == 0 then return '' end
local tab = items_table(KEYS[1], false)
local digests = {}
for i = 2, #ARGV do digests[i - 1] = ARGV[i] end
preload(tab, digests)
local out = {}
for i, d in ipairs(digests) do out[i] = string.char(48 + state_of(tab, d)) end
return table.concat(out)
"""

# KEYS: the table. ARGV: bits to set, bits to clear, then digests. Returns how many changed.
_CHANGE = LUA_ITEMS + """
local tab = items_table(KEYS[1], true)
local add, clear, changed = tonumber(ARGV[1]), tonumber(ARGV[2]), 0
local digests = {}
for i = 3, #ARGV do digests[i - 2] = ARGV[i] end
preload(tab, digests)
for i = 3, #ARGV do
  local old = change(tab, ARGV[i], add, clear)
  if bit.bor(bit.band(old, bit.bnot(clear)), add) ~= old then changed = changed + 1 end
end
flush(tab)
return changed
"""

# KEYS: the table, the export's seen set, its missing set. ARGV: the first bucket, the bucket
# after the last, the TTL of the missing set. Adds to the missing set every digest in the run
# (IN_RUN) of those buckets that the seen set lacks; returns how many it added.
_MISSING = LUA_ITEMS + """
local T = KEYS[1]
local tab = items_table(T, false)
local added = 0
for b = tonumber(ARGV[1]), tonumber(ARGV[2]) - 1 do
  local k = tab.prefix .. string.format('%x', b)
  local flat = {}
  if tab.blob then
    local blob = redis.pcall('GET', k)
    if type(blob) ~= 'string' then blob = '' end
    for d, v in pairs(decoded(blob)) do
      flat[#flat + 1] = d
      flat[#flat + 1] = v
    end
  else
    flat = redis.call('HGETALL', k)
  end
  for i = 1, #flat, 2 do
    local s = tonumber(flat[i + 1]) or 0
    if bit.band(s, 1) ~= 0 and redis.call('SISMEMBER', KEYS[2], flat[i]) == 0 then
      added = added + redis.call('SADD', KEYS[3], flat[i])
    end
  end
end
if added > 0 then redis.call('EXPIRE', KEYS[3], ARGV[3]) end
return added
"""

# KEYS: the table. ARGV: the buckets for a new table, its layout ('' for hashes). Fixes both
# once, together; returns the buckets in force.
_ENSURE = LUA_FIX + """
fix_size(KEYS[1], ARGV[1], ARGV[2])
return redis.call('HGET', KEYS[1], 'buckets')
"""

#: Buckets an export's coverage reads per script call (Redis is never held long).
_MISSING_BUCKETS = 64
#: Set members moved per round trip when an old run's sets are migrated into its item table.
_MIGRATE_PART = 4096


class ItemCounts(NamedTuple):
    """The table's counts of states (each kept by the scripts that change the states)."""

    in_run: int
    done: int  # whether or not in the run
    failed: int  # whether or not done too
    failed_done: int
    in_run_done: int


#: An entry at least this is an item's place, not its state bits (see LUA_ITEMS).
_PLACED = (IN_RUN | DONE | FAILED) + 1


def placed(pack: int, slot: int) -> int:
    """The entry of an item at SLOT of pack number PACK (in the run: the state is its bits)."""
    return (pack * PACK_SLOTS + slot) * 8 + IN_RUN


def state_at(bits: bytes, slot: int) -> int:
    """The state of the item at SLOT of a pack whose bits are BITS (a string as Redis keeps it):
    in the run, DONE when bit 2 x SLOT is set, FAILED when the bit after it is."""
    byte = bits[slot * 2 // 8] if slot * 2 // 8 < len(bits) else 0
    shift = 6 - (slot * 2 % 8)
    x = (byte >> shift) & 3
    return IN_RUN | (DONE if x & 2 else 0) | (FAILED if x & 1 else 0)


def _blob(raw: object) -> bytes:
    return raw if isinstance(raw, bytes) else b""


def buckets_for(expected_items: int) -> int:
    """The number of buckets for a run of about EXPECTED_ITEMS items: a power of two giving at
    most ITEMS_PER_BUCKET items a bucket (DEFAULT_BUCKETS at least, MAX_BUCKETS at most)."""
    n = DEFAULT_BUCKETS
    while n * ITEMS_PER_BUCKET < expected_items and n < MAX_BUCKETS:
        n *= 2
    return n


def counts_of(raw: object) -> ItemCounts:
    """The counts in a table hash as read (HGETALL), 0 for a field missing or not an integer."""
    got: dict[str, int] = {}
    for k, v in (raw.items() if isinstance(raw, dict) else []):
        name = k.decode() if isinstance(k, bytes) else str(k)
        try:
            got[name] = int(v)
        except ValueError:
            continue
    return ItemCounts(*(got.get(f, 0) for f in COUNTS))


class ItemTable(RunKeeper):
    """RUN's item table on CONN: its key, its size, the states of items, setting and clearing
    their bits outside the claim and mark scripts, the counts, and the digests it holds."""

    key_template = RUN_KEY + ":itemtable"

    def ensure(self, expected_items: int, *, hashes: bool = False) -> int:
        """Fix the number of buckets for a run of about EXPECTED_ITEMS items, unless it is fixed
        already (the first writer decides, once, and the layout with it: strings of records;
        HASHES, for tests, a hash a bucket as an earlier genqueue made them); returns the number
        in force."""
        layout = "" if hashes else BLOBS
        return int(self.conn.register_script(_ENSURE)(keys=[self.key(self.run)], args=[buckets_for(expected_items), layout]))

    def blobs(self) -> bool:
        """Whether the table keeps its buckets as strings of records (False: hashes, a table an
        earlier genqueue made, or none yet)."""
        return self.conn.hget(self.key(self.run), LAYOUT) in (BLOBS, BLOBS.encode())

    def entry(self, digest: bytes) -> int:
        """DIGEST's entry as stored (state bits, or its place; 0: none), in either layout."""
        n = self.buckets()
        if not n:
            return 0
        key = bucket_key(self.run, int.from_bytes(digest[:4], "big") % n)
        if not self.blobs():
            raw = self.conn.hget(key, digest)
            return int(raw) if raw is not None else 0
        return dict(records(_blob(self.conn.get(key)))).get(digest, 0)

    def listpack_entries(self) -> int:
        """The entries a bucket holds in Redis's compact encoding (CONFIG GET
        hash-max-listpack-entries; LISTPACK_ENTRIES when CONFIG is refused)."""
        try:
            got = (self.conn.config_get("hash-max-listpack-entries") or {}).get("hash-max-listpack-entries")
            return LISTPACK_ENTRIES if got is None else int(got)
        except (redis.exceptions.ResponseError, ValueError):
            return LISTPACK_ENTRIES

    def migrate_sets(self) -> int:
        """Move the marks of a run made before the item table (its `keys`, `done` and `failed`
        sets of digests) into the table, then delete the sets; how many entries it read (0: no
        such set, the usual case, one round trip). The sets are read in parts and the table's
        counts kept, so an upgrade in the middle of a run loses none of its marks."""
        old = [(run_key(self.run, name), bit) for name, bit in (("keys", IN_RUN), ("done", DONE), ("failed", FAILED))]
        if not self.conn.exists(*(k for k, _ in old)):
            return 0
        self.note_rebuilt()
        moved = 0
        for key, bit in old:
            part: list[bytes] = []
            for d in self.conn.sscan_iter(key, count=_MIGRATE_PART):
                part.append(d if isinstance(d, bytes) else str(d).encode())
                if len(part) >= _MIGRATE_PART:
                    moved += len(part)
                    self.change(part, add=bit)
                    part = []
            moved += len(part)
            self.change(part, add=bit)
            self.conn.delete(key)
        return moved

    def buckets(self) -> int:
        """How many buckets the table has (0: none fixed yet, nothing written)."""
        raw = self.conn.hget(self.key(self.run), "buckets")
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            return 0

    def states(self, digests: list[bytes], *, first_take: bool = False) -> bytes:
        """Each digest's state bits, one byte a digest, in one round trip. FIRST_TAKE: the items
        of a job no consumer took before, which only a rebuild (or a move from older sets) can
        have marked while the job waited: in a table never rebuilt they are read as 0 without a
        look at each (one command for the job instead of one an item)."""
        if not digests:
            return b""
        raw = self.conn.register_script(_STATES)(keys=[self.key(self.run)], args=["1" if first_take else "0", *digests])
        if not raw:
            return bytes(len(digests))
        return bytes(b - 48 for b in raw)

    def note_rebuilt(self) -> None:
        """Count a writing of marks other than by shipping (before it starts): from then on a
        job's first take reads its items' states too (`states`)."""
        self.conn.hincrby(self.key(self.run), REBUILT, 1)

    def distrust(self, packs: list[int]) -> None:
        """Mark PACKS (numbers) as packs whose slots the items' entries no longer vouch for (a
        re-claim moved items out of them, or they were named again after their entries were
        lost): a shard of their jobs is marked by each item's entry (the marking script)."""
        if packs:
            self.conn.hset(self.key(self.run), mapping={f"{MOVED}{n}": 1 for n in packs})

    def change(self, digests: list[bytes], *, add: int = 0, clear: int = 0) -> int:
        """Set ADD's bits and clear CLEAR's in each of DIGESTS (counts kept); how many changed."""
        if not digests:
            return 0
        return int(self.conn.register_script(_CHANGE)(keys=[self.key(self.run)], args=[add, clear, *digests]))

    def counts(self) -> ItemCounts:
        return counts_of(self.conn.hgetall(self.key(self.run)))

    def each(self) -> Iterator[tuple[bytes, int]]:
        """Every (digest, state) the table holds, a range of buckets a round trip (and, for the
        items placed in packs, one more for the packs' bits they name)."""
        for entries in self._entries():
            bits = self._place_bits({v for _, v in entries if v >= _PLACED})
            for d, v in entries:
                yield d, (state_at(bits.get(v // 8 // PACK_SLOTS, b""), v // 8 % PACK_SLOTS) if v >= _PLACED else v)

    def placed_in(self, packs: set[int]) -> dict[int, dict[int, bytes]]:
        """The items placed in PACKS (numbers): pack -> slot -> digest, from the entries alone
        (a reader whose pack cannot be read learns which items it held; a whole-table read)."""
        out: dict[int, dict[int, bytes]] = {p: {} for p in packs}
        for entries in self._entries():
            for d, v in entries:
                if v >= _PLACED and (pack := v // 8 // PACK_SLOTS) in out:
                    out[pack][v // 8 % PACK_SLOTS] = d
        return out

    def _entries(self) -> Iterator[list[tuple[bytes, int]]]:
        """The (digest, entry) records as stored, a range of buckets a round trip."""
        n, blobs = self.buckets(), self.blobs()
        for lo in range(0, n, _MISSING_BUCKETS):
            keys = [bucket_key(self.run, b) for b in range(lo, min(n, lo + _MISSING_BUCKETS))]
            if blobs:
                yield [e for raw in self.conn.mget(keys) for e in records(_blob(raw))]
                continue
            with self.conn.pipeline(transaction=False) as p:
                for key in keys:
                    p.hgetall(key)
                parts = p.execute()
            yield [((d if isinstance(d, bytes) else d.encode()), int(v)) for part in parts for d, v in part.items()]

    def _place_bits(self, values: set[int]) -> dict[int, bytes]:
        """The bits of the packs the placed entries VALUES name, by pack number (one round trip)."""
        packs = sorted({v // 8 // PACK_SLOTS for v in values})
        if not packs:
            return {}
        with self.conn.pipeline(transaction=False) as p:
            for pack in packs:
                p.get(place_key(self.run, pack))
            got = p.execute()
        return {pack: (raw if isinstance(raw, bytes) else b"") for pack, raw in zip(packs, got, strict=True)}

    def digests(self, bits: int = IN_RUN) -> set[bytes]:
        """The digests with every one of BITS set (for tests and tools: it holds them all)."""
        return {d for d, s in self.each() if s & bits == bits}

    def fill_missing(self, seen_key: str, missing_key: str, ttl: int) -> int:
        """Add to MISSING_KEY every digest in the run that SEEN_KEY lacks (the export's coverage),
        a range of buckets a call so Redis is never held long; how many were added."""
        n, added = self.buckets(), 0
        script = self.conn.register_script(_MISSING)
        for lo in range(0, n, _MISSING_BUCKETS):
            added += int(script(keys=[self.key(self.run), seen_key, missing_key], args=[lo, min(n, lo + _MISSING_BUCKETS), ttl]))
        return added
