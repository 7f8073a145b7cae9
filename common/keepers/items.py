"""A run's item table: which items are in the run, done and failed, in a few bytes an item.

Every item of a run has one entry, its 16-byte digest (common/keepers/runs.py `key_digest`) ->
its state bits (IN_RUN: a producer claimed it; DONE: a shipped shard holds its result; FAILED:
a shipped shard holds an error record of it), in one of the run's buckets:

  genqueue:run:<run>:items:<bucket hex>  string  records of 22 bytes: a digest, then its entry
                                               (state bits 1-7, or the item's place) in 6
                                               big-endian bytes; in a table an earlier
                                               genqueue made (no `layout` in the table's
                                               hash), a hash digest -> entry
  genqueue:run:<run>:pk:<pack number>    string  the done and failed bits of the items placed
                                               in that pack, two a slot
  genqueue:run:<run>:itemtable           hash  buckets: how many bucket hashes (set once), and
                                               the counts of the states: in_run, done, failed,
                                               failed_done, in_run_done; rebuilt: how many times
                                               marks were written other than by shipping (a
                                               rebuild from the output, a move from older sets);
                                               moved:<pack>: a pack whose slots the entries no
                                               longer vouch for (`distrust`); layout: `blobs`
                                               (buckets as strings of records)

Why strings of records (issue 34, 2026-12-06): every script reads the buckets its digests fall
in with one MGET at its start (`preload`) and writes those it changed with one MSET at its end
(`flush`), finding and changing an entry in Lua; a slice's claim of 1,024 items or a shard's
marks by entry cost a handful of Redis commands instead of one an item (each digest has its own
bucket, so a hash a bucket needs an HSETNX, HGET or HINCRBY an item, which is what
`total_commands_processed` counts, Lua's calls included). A record is 22 bytes, about 24 of
Redis an item with the bucket's key (28 in the listpacks of hashes with places). A table made
by an earlier genqueue keeps its hashes: `LAYOUT` is set only with a new table's `buckets`
(`ensure`, or a writer's fallback), and every primitive below reads and writes either layout.

Items by reference have a place (issue 34, step 8): the claim that wins an item for pack number
P gives it slot S (0, 1, ... in the slice's order; the pack holds the items in that order) and
writes (P x PACK_SLOTS + S) x 8 + IN_RUN as its entry, an integer of at least 8 (a state is at
most 7). Such an item is in the run; its DONE and FAILED bits are bits 2S and 2S + 1 of the
string `pk:<P>`, so a shipped shard marks a pack's items with one BITFIELD (the marking script,
common/keepers/marks.py) instead of one command an item. Every reader by digest (`state_of`,
`each`) reads a placed entry's state there; every writer by digest (`change`, `mark_one`,
`add_in_run`) writes it there. An entry costs about 4 bytes more (a 32-bit integer in the
listpack instead of a small one).

Why buckets and not three sets (the run's keys, done and failed sets until issue 34):
a set of 16-byte members costs about 80 bytes of Redis a member, three of them 240 an item once
done; a small hash is stored as a listpack, its entries packed one after another, about 23 bytes
an item for all three states (measured: BENCHMARKS.md, "Redis bytes per item"). A hash stays a
listpack while it holds at most `hash-max-listpack-entries` entries (128 by default), so a run
has about one bucket per ITEMS_PER_BUCKET items, their number chosen once, from the size the
first writer expects (ItemTable.ensure; ITEMS_DEFAULT_BUCKETS when nobody said), and never
changed: an item's bucket is its digest's first four bytes modulo that number. A run that grows
far past what it expected keeps working; its buckets become hashtables (the memory of sets).

The counts are kept by the same scripts that change the states, in the same call, so they agree
with the states at every moment (status reads them in O(1) instead of counting the sets). Every
script that reads or writes the table includes LUA_ITEMS (the bucket of a digest, a state, a
change of state with its counts); the claims keeper's and the marks keeper's scripts are the
writers, this module's the readers. The scripts reach the bucket hashes by names they build
from the table's key, which a single Redis allows (rq needs one Redis, not a cluster, too).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import redis

from genqueue.common import defaults
from genqueue.common.keepers.keeper import RUN_KEY, RunKeeper, run_key

#: An item's state bits.
IN_RUN, DONE, FAILED = 1, 2, 4

ITEMS_PER_BUCKET = defaults.ITEMS_PER_BUCKET
DEFAULT_BUCKETS = defaults.ITEMS_DEFAULT_BUCKETS
MAX_BUCKETS = defaults.ITEMS_MAX_BUCKETS
PACK_SLOTS = defaults.PACK_SLOTS

#: The table's fields that count states (the scripts keep them).
COUNTS = ("in_run", "done", "failed", "failed_done", "in_run_done")

#: The table's fields naming the packs whose slots the entries do not vouch for: `moved:<pack>`.
MOVED = "moved:"
#: The table's field holding the lowest pack number a claim placed items in: a pack numbered
#: below it was written before items had places (an upgrade in the middle of a run), and its
#: items are marked by entry.
PLACED_FROM = "placed_from"
#: The table's field naming how its buckets are kept: BLOBS (a string of records a bucket, read
#: and written a call's buckets at a time) for a table made by this genqueue; none for a table
#: an earlier one made (a hash a bucket, digest -> entry), which keeps that layout.
LAYOUT = "layout"
BLOBS = "blobs"
DIGEST_BYTES = defaults.ITEMS_DIGEST_BYTES
VALUE_BYTES = defaults.ITEMS_VALUE_BYTES
RECORD_BYTES = DIGEST_BYTES + VALUE_BYTES
#: A bucket a call looks up or changes more often than this is decoded into a Lua table for the
#: rest of the call (many digests of one bucket in one call), so each look-up and change is O(1)
#: instead of a search and a copy of its string.
DECODE_AFTER = defaults.ITEMS_DECODE_AFTER

# The Lua shared by every script of the table. T is the table's key (the script's KEYS[n]); the
# bucket hashes are named from it. B is read once per call; a writer that finds none sets
# DEFAULT_BUCKETS (`ensure` first, with a size, is the rule; this is the fallback). `change`
# sets ADD's bits and clears CLEAR's, deleting an entry left with none, and keeps the counts in
# `delta`, which `flush` writes in one HINCRBY each at the end of the call; `mark_one` is
# `change(tab, d, M, 0)` for one bit M in one HINCRBY (the old state is the new one less M; the
# rare item that had M already gets a second HINCRBY that takes it back, and an entry that is
# not an integer, which HINCRBY refuses, goes through `change`, which reads it as 0; a placed
# entry, whose HINCRBY is taken back, too); `add_in_run` is `change(tab, d, IN_RUN, 0)` in one
# HSETNX for an item new to the table (the claim's case), writing PV, its place, when given.
# A placed entry's state is read at its place (`read_entry`, `state_at`) and written there
# (`set_state_at`) while it stays in the run; cleared out of the run, it becomes a plain state
# again (0: deleted). `place_of` and `placed_value` are the entry's encoding (module docstring).
# `entry_get` and `entry_set` read and write an entry in either layout: in strings of records,
# in the bucket's string as `preload` (one MGET for a call's digests) or a GET read it, written
# back by `flush` (one MSET); a digest that is not 16 bytes is no item of genqueue's there
# (`foreign`: never in the run, never changed).
# Fixes a new table's size and layout together, once (the first writer's): `ensure`, or a
# writer's fallback in `items_table`. LAYOUT '' leaves a table of hashes (tests of old tables).
_LUA_FIX = """
local function fix_size(T, n, layout)
  if redis.call('HSETNX', T, 'buckets', n) == 1 and layout ~= '' then
    redis.call('HSET', T, '""" + LAYOUT + """', layout)
  end
end
"""

LUA_ITEMS = _LUA_FIX + """
local function items_table(T, write)
  local run = string.sub(T, 1, #T - 9)
  local tab = {key = T, prefix = run .. 'items:', pk = run .. 'pk:', blobs = {}, maps = {}, adds = {}, ops = {},
               dirty = {}}
  local got = redis.call('HMGET', T, 'buckets', '""" + LAYOUT + """')
  local b = got[1]
  if not b and write then
    fix_size(T, '""" + str(DEFAULT_BUCKETS) + """', '""" + BLOBS + """')
    got = redis.call('HMGET', T, 'buckets', '""" + LAYOUT + """')
    b = got[1]
  end
  tab.n = tonumber(b or '0') or 0
  tab.blob = got[2] == '""" + BLOBS + """'
  tab.delta = {in_run = 0, done = 0, failed = 0, failed_done = 0, in_run_done = 0}
  return tab
end
local function bucket_of(tab, d)
  local b1, b2, b3, b4 = string.byte(d, 1, 4)
  return tab.prefix .. string.format('%x', ((((b1 or 0) * 256 + (b2 or 0)) * 256 + (b3 or 0)) * 256 + (b4 or 0)) % tab.n)
end
local function foreign(tab, d)
  return tab.blob and #d ~= """ + str(DIGEST_BYTES) + """
end
local function record_at(b, d)
  local i = 1
  while true do
    local s = string.find(b, d, i, true)
    if not s then return nil end
    if (s - 1) % """ + str(RECORD_BYTES) + """ == 0 then return s end
    i = s + 1
  end
end
local function value_at(b, s)
  local v = 0
  for _, x in ipairs({string.byte(b, s + """ + str(DIGEST_BYTES) + """, s + """ + str(RECORD_BYTES - 1) + """)}) do
    v = v * 256 + x
  end
  return v
end
local function value_bytes(v)
  local out = {}
  for i = """ + str(VALUE_BYTES) + """, 1, -1 do
    out[i] = v % 256
    v = math.floor(v / 256)
  end
  return string.char(unpack(out))
end
local function decoded(b)
  local map = {}
  for s = 1, #b - """ + str(RECORD_BYTES - 1) + """, """ + str(RECORD_BYTES) + """ do
    map[string.sub(b, s, s + """ + str(DIGEST_BYTES - 1) + """)] = value_at(b, s)
  end
  return map
end
local function loaded(tab, k, b)
  if type(b) ~= 'string' then b = '' end
  tab.blobs[k] = string.sub(b, 1, #b - #b % """ + str(RECORD_BYTES) + """)
  tab.adds[k] = {}
  tab.ops[k] = 0
end
local function preload(tab, digests)
  if not tab.blob or tab.n == 0 then return end
  local want, asked = {}, {}
  for _, d in ipairs(digests) do
    local k = bucket_of(tab, d)
    if tab.blobs[k] == nil and tab.maps[k] == nil and not asked[k] then
      asked[k] = true
      want[#want + 1] = k
    end
  end
  for i = 1, #want, 4096 do
    local part = redis.call('MGET', unpack(want, i, math.min(i + 4095, #want)))
    for j = 1, math.min(4096, #want - i + 1) do loaded(tab, want[i + j - 1], part[j]) end
  end
end
local function load(tab, k)
  if tab.blobs[k] == nil and tab.maps[k] == nil then loaded(tab, k, redis.pcall('GET', k)) end
  if tab.maps[k] == nil then
    tab.ops[k] = tab.ops[k] + 1
    if tab.ops[k] > """ + str(DECODE_AFTER) + """ then
      local m = decoded(tab.blobs[k])
      for x, y in pairs(tab.adds[k]) do m[x] = y end
      tab.maps[k], tab.blobs[k], tab.adds[k] = m, nil, nil
    end
  end
end
local function entry_get(tab, k, d)
  if not tab.blob then return tonumber(redis.call('HGET', k, d) or '0') or 0 end
  if foreign(tab, d) then return 0 end
  load(tab, k)
  local map = tab.maps[k]
  if map then return map[d] or 0 end
  local added = tab.adds[k][d]
  if added then return added end
  local b = tab.blobs[k]
  local s = record_at(b, d)
  if s then return value_at(b, s) end
  return 0
end
local function entry_set(tab, k, d, v)
  if not tab.blob then
    if v == 0 then redis.call('HDEL', k, d) else redis.call('HSET', k, d, v) end
    return
  end
  if foreign(tab, d) then return end
  load(tab, k)
  tab.dirty[k] = true
  local map = tab.maps[k]
  if map then
    if v == 0 then map[d] = nil else map[d] = v end
    return
  end
  local adds = tab.adds[k]
  if adds[d] then
    if v == 0 then adds[d] = nil else adds[d] = v end
    return
  end
  local b = tab.blobs[k]
  local s = record_at(b, d)
  if s then
    if v == 0 then
      tab.blobs[k] = string.sub(b, 1, s - 1) .. string.sub(b, s + """ + str(RECORD_BYTES) + """)
    else
      tab.blobs[k] = string.sub(b, 1, s + """ + str(DIGEST_BYTES - 1) + """) .. value_bytes(v) .. string.sub(b, s + """ + str(RECORD_BYTES) + """)
    end
  elseif v ~= 0 then
    adds[d] = v
  end
end
local function encoded(tab, k)
  local out = {}
  local map = tab.maps[k]
  if map then
    for d, v in pairs(map) do out[#out + 1] = d .. value_bytes(v) end
  else
    out[1] = tab.blobs[k]
    for d, v in pairs(tab.adds[k]) do out[#out + 1] = d .. value_bytes(v) end
  end
  return table.concat(out)
end
local function place_of(v)
  local p = math.floor(v / 8)
  return math.floor(p / """ + str(PACK_SLOTS) + """), p % """ + str(PACK_SLOTS) + """
end
local function placed_value(pack, slot)
  return (pack * """ + str(PACK_SLOTS) + """ + slot) * 8 + 1
end
local function state_at(tab, pack, slot)
  local x = redis.call('BITFIELD', tab.pk .. pack, 'GET', 'u2', slot * 2)[1]
  local s = 1
  if x >= 2 then s = s + 2 end
  if x % 2 == 1 then s = s + 4 end
  return s
end
local function set_state_at(tab, pack, slot, s)
  local x = 0
  if bit.band(s, 2) ~= 0 then x = x + 2 end
  if bit.band(s, 4) ~= 0 then x = x + 1 end
  redis.call('BITFIELD', tab.pk .. pack, 'SET', 'u2', slot * 2, x)
end
local function read_entry(tab, k, d)
  local v = entry_get(tab, k, d)
  if v >= 8 then
    local p, sl = place_of(v)
    return v, state_at(tab, p, sl)
  end
  return v, v
end
local function state_of(tab, d)
  if tab.n == 0 then return 0 end
  local _, s = read_entry(tab, bucket_of(tab, d), d)
  return s
end
local function count(tab, s, n)
  local dl = tab.delta
  local inr, dn, fl = bit.band(s, 1) ~= 0, bit.band(s, 2) ~= 0, bit.band(s, 4) ~= 0
  if inr then dl.in_run = dl.in_run + n end
  if dn then dl.done = dl.done + n end
  if fl then dl.failed = dl.failed + n end
  if fl and dn then dl.failed_done = dl.failed_done + n end
  if inr and dn then dl.in_run_done = dl.in_run_done + n end
end
local function change(tab, d, add, clear)
  if foreign(tab, d) then return 0 end
  local k = bucket_of(tab, d)
  local v, old = read_entry(tab, k, d)
  local new = bit.bor(bit.band(old, bit.bnot(clear)), add)
  if new ~= old then
    if v >= 8 and bit.band(new, 1) ~= 0 then
      local p, sl = place_of(v)
      set_state_at(tab, p, sl, new)
    else entry_set(tab, k, d, new) end
    count(tab, old, -1)
    count(tab, new, 1)
  end
  return old
end
local function mark_one(tab, d, m)
  if tab.blob then return change(tab, d, m, 0) end
  local k = bucket_of(tab, d)
  local new = redis.pcall('HINCRBY', k, d, m)
  if type(new) ~= 'number' then return change(tab, d, m, 0) end
  local old = new - m
  if old >= 8 then
    redis.call('HINCRBY', k, d, -m)
    return change(tab, d, m, 0)
  end
  if bit.band(old, m) ~= 0 then
    redis.call('HINCRBY', k, d, -m)
    return old
  end
  count(tab, old, -1)
  count(tab, new, 1)
  return old
end
local function add_in_run(tab, d, pv)
  if foreign(tab, d) then return 1 end
  local k = bucket_of(tab, d)
  if tab.blob then
    if entry_get(tab, k, d) == 0 then
      entry_set(tab, k, d, pv or 1)
      count(tab, 1, 1)
      return 0
    end
  elseif redis.call('HSETNX', k, d, pv or 1) == 1 then
    count(tab, 1, 1)
    return 0
  end
  local v, old = read_entry(tab, k, d)
  if bit.band(old, 1) == 0 then
    local new = bit.bor(old, 1)
    if pv then
      entry_set(tab, k, d, pv)
      local p, sl = place_of(pv)
      set_state_at(tab, p, sl, new)
    else
      entry_set(tab, k, d, new)
    end
    count(tab, old, -1)
    count(tab, new, 1)
  end
  return old
end
local function placing(tab, pack)
  local f = tonumber(redis.call('HGET', tab.key, '""" + PLACED_FROM + """') or '0') or 0
  if f == 0 or pack < f then redis.call('HSET', tab.key, '""" + PLACED_FROM + """', pack) end
end
local function flush(tab)
  for f, n in pairs(tab.delta) do
    if n ~= 0 then redis.call('HINCRBY', tab.key, f, n) end
  end
  tab.delta = {in_run = 0, done = 0, failed = 0, failed_done = 0, in_run_done = 0}
  local set, gone = {}, {}
  for k, _ in pairs(tab.dirty) do
    local b = encoded(tab, k)
    if b == '' then gone[#gone + 1] = k else set[#set + 1] = k; set[#set + 1] = b end
  end
  tab.dirty = {}
  for i = 1, #set, 4096 do redis.call('MSET', unpack(set, i, math.min(i + 4095, #set))) end
  for i = 1, #gone, 4096 do redis.call('DEL', unpack(gone, i, math.min(i + 4095, #gone))) end
end
"""

#: The table's field counting the times marks were written other than by a consumer shipping.
REBUILT = "rebuilt"

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
_ENSURE = _LUA_FIX + """
fix_size(KEYS[1], ARGV[1], ARGV[2])
return redis.call('HGET', KEYS[1], 'buckets')
"""

_MISSING_BUCKETS = defaults.ITEMS_SCAN_BUCKETS
_MIGRATE_PART = defaults.ITEMS_MIGRATE_PART


class ItemCounts(NamedTuple):
    """The table's counts of states (each kept by the scripts that change the states)."""

    in_run: int
    done: int  # whether or not in the run
    failed: int  # whether or not done too
    failed_done: int
    in_run_done: int


def bucket_key(run: str, bucket: int) -> str:
    return run_key(run, f"items:{bucket:x}")


def place_key(run: str, pack: int) -> str:
    """The done and failed bits of the items placed in pack number PACK of RUN (two a slot)."""
    return run_key(run, f"pk:{pack}")


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


def records(blob: bytes) -> list[tuple[bytes, int]]:
    """The (digest, entry) records of a bucket kept as a string (a torn tail left out)."""
    out = []
    for at in range(0, len(blob) - RECORD_BYTES + 1, RECORD_BYTES):
        out.append((blob[at:at + DIGEST_BYTES], int.from_bytes(blob[at + DIGEST_BYTES:at + RECORD_BYTES], "big")))
    return out


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
        hash-max-listpack-entries; defaults.ITEMS_LISTPACK_ENTRIES when CONFIG is refused)."""
        try:
            got = (self.conn.config_get("hash-max-listpack-entries") or {}).get("hash-max-listpack-entries")
            return defaults.ITEMS_LISTPACK_ENTRIES if got is None else int(got)
        except (redis.exceptions.ResponseError, ValueError):
            return defaults.ITEMS_LISTPACK_ENTRIES

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
