"""The item table's layout in Redis, and the Lua every script of the table shares.

A run's keys: `itemtable`, a hash (`buckets`, fixed once by the first writer; the state counts;
REBUILT, MOVED `<pack>`, PLACED_FROM, LAYOUT); `items:<bucket hex>` (bucket_key), a string of
RECORD_BYTES records: a digest, then its entry in VALUE_BYTES big-endian bytes; and `pk:<pack>`
(place_key), the done and failed bits of the items placed in that pack, two a slot. A digest's
bucket is its first four bytes modulo `buckets`.

An entry is an item's state bits (items.py IN_RUN, DONE, FAILED: 1-7), or for an item by
reference its place, (pack x PACK_SLOTS + slot) x 8 + IN_RUN: its done and failed bits are then
bits 2 x slot and 2 x slot + 1 of `pk:<pack>`, so a shipped shard marks a pack's items with one
BITFIELD. LUA_ITEMS is in every script that reads or writes the table (items.py's readers, the
claims' and the marks' writers): it finds a bucket, reads and changes an entry, keeps the counts
in the same call, and writes the buckets it changed in one MSET at the end. The scripts name the
buckets from the table's key, which one Redis allows (rq needs one Redis, not a cluster, too).
"""

from __future__ import annotations

from genqueue.common.keepers.keeper import run_key

#: Buckets of a run whose first writer did not say its size, and the fewest any run gets.
DEFAULT_BUCKETS = 1024
#: Items a pack holds at most: an item's place (pack x PACK_SLOTS + slot) fits a 32-bit listpack integer.
PACK_SLOTS = 2048

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
#: Bytes of an item's digest in a bucket's records.
DIGEST_BYTES = 16
#: Bytes of an item's entry (state bits, or its place): a place up to pack 2**34.
VALUE_BYTES = 6
RECORD_BYTES = DIGEST_BYTES + VALUE_BYTES
#: A bucket a call looks up or changes more often than this is decoded into a Lua table for the
#: rest of the call (many digests of one bucket in one call), so each look-up and change is O(1)
#: instead of a search and a copy of its string.
DECODE_AFTER = 32

#: The table's field counting the times marks were written other than by a consumer shipping.
REBUILT = "rebuilt"

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
LUA_FIX = """
local function fix_size(T, n, layout)
  if redis.call('HSETNX', T, 'buckets', n) == 1 and layout ~= '' then
    redis.call('HSET', T, '""" + LAYOUT + """', layout)
  end
end
"""

LUA_ITEMS = LUA_FIX + """
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


def bucket_key(run: str, bucket: int) -> str:
    return run_key(run, f"items:{bucket:x}")


def place_key(run: str, pack: int) -> str:
    """The done and failed bits of the items placed in pack number PACK of RUN (two a slot)."""
    return run_key(run, f"pk:{pack}")


def records(blob: bytes) -> list[tuple[bytes, int]]:
    """The (digest, entry) records of a bucket kept as a string (a torn tail left out)."""
    out = []
    for at in range(0, len(blob) - RECORD_BYTES + 1, RECORD_BYTES):
        out.append((blob[at:at + DIGEST_BYTES], int.from_bytes(blob[at + DIGEST_BYTES:at + RECORD_BYTES], "big")))
    return out
