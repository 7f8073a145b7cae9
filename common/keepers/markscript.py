"""The marking script: the one Lua that writes a shipped shard's marks and bumps its counters.

MARK marks a shard's items DONE (results) or FAILED (error records) in the run's item table
(itemlayout.py), in one call, and in the same call adds each item newly marked to the run's
counters (SHIPPED_*, LAST_MARK_AT in its stats hash) and its acceptance tallies (spectally.py):
so the outcomes `producer status` shows always sum to the items it calls done. An item by
reference is marked at its place, its pack's bits, while the pack's slots are trusted
(LUA_TRUSTED); any other is marked by its entry. DONE_AT is the consumer's look-up of a job's
items by their places under the same rule. item_args and pack_args build MARK's arguments;
marks.py's Marks sends it.
"""

from __future__ import annotations

from genqueue.common.keepers.itemlayout import LUA_ITEMS, MOVED, PACK_SLOTS, PLACED_FROM, REBUILT
from genqueue.common.keepers.spectally import LUA_ADD, LUA_FLUSH, LUA_INIT

#: The run's counters (in genqueue:run:<run>:stats) the marking script bumps: one per outcome of
#: a newly done item, one per class of a newly failed one, the turns regenerated, and one per
#: ToolTurns of a newly done conversation with recorded tool turns.
SHIPPED_OUTCOME = "shipped_outcome_"
SHIPPED_FAILED = "shipped_failed_"
SHIPPED_TURNS = "shipped_turns"
SHIPPED_TOOLS = "shipped_tools_"
#: The feature rows (--capture, --logprobs) the results of newly done items name: a run's distinct rows, each
#: counted once as its item is done once (a redone answer's second row, or a row whose record was
#: lost with its consumer, counts nowhere here).
SHIPPED_FEATURES = "shipped_feature_rows"
#: When an item was last newly marked by a shipped shard (Redis's clock, whole seconds; a rebuild
#: from the shards does not move it): a run that is over ended then, and its rate is over the
#: time it ran, not until now.
LAST_MARK_AT = "last_mark_at"


# Whether the slots of pack number N (named NAME in the pack table P) are vouched for by the
# entries of the item table T: numbered from `placed_from` (FROM, read once a call with
# `placed_from`; 0: no pack has places), named NAME in the pack table, and no re-claim moved
# items out of it (`moved:<n>`). The marking script and the look-up by place share this rule.
LUA_TRUSTED = """
local function placed_from(T)
  return tonumber(redis.call('HGET', T, '""" + PLACED_FROM + """') or '0') or 0
end
local function trusted(T, P, from, n, name)
  return from > 0 and tonumber(n) >= from and redis.call('HGET', P, n) == name
    and redis.call('HEXISTS', T, '""" + MOVED + """' .. n) == 0
end
"""


#: Marks the items in ARGV: ARGV[1] the state bits to set (DONE or FAILED, with IN_RUN when a
#: rebuild puts the items in the run too), ARGV[2] how many packs follow, then each pack's
#: (number, name), then per item (digest, counter name, turns, tool-turns counter name,
#: acceptance tallies, place: its pack's number x PACK_SLOTS + its slot + 1, 0 for none, feature
#: rows), in the run's item table KEYS[1]; each item newly marked adds 1 to its counter in KEYS[2]
#: (unless it is an error record of an item with a result already: that counts nowhere), its
#: regenerated turns to `shipped_turns`, its feature rows to SHIPPED_FEATURES, 1 to its
#: tool-turns counter, if any, and its tallies to KEYS[3]
#: (common/keepers/spectally.py). The sums are written at the end, one HINCRBY a counter (a
#: shard's items share a handful).
#:
#: An item with a place is marked at its place: its pack's bits (`pk:<number>`), a few BITFIELDs
#: a pack for the whole shard, the old bits answered so the counts stay exact (no Redis command an
#: item). That holds while the run's pack table (KEYS[4]) names that pack
#: under that number, no re-queue moved items out of it (`moved:<number>` in the table's hash),
#: and it is numbered from `placed_from` on (a pack written before items had places, by an
#: earlier genqueue, is not): the items' entries then hold those places, as the claim wrote them. Otherwise, and for
#: an item without a place (inline, a leftover shard read back from disk, a rebuild), it is
#: marked by its entry (the buckets they touch read with one MGET and written with one MSET; in a
#: table an earlier genqueue made, one HINCRBY an item, `mark_one`), or its entry's place when it has one.
MARK = LUA_ITEMS + LUA_TRUSTED + """
local added = 0
""" + LUA_INIT + """local tab = items_table(KEYS[1], true)
local bits = tonumber(ARGV[1])
local mark = bit.band(bits, 6)
local sums = {}
local function bump(f, n) sums[f] = (sums[f] or 0) + n end
local npacks = tonumber(ARGV[2])
local first = 3 + 2 * npacks
local good = {}
local from = 0
if npacks > 0 then from = placed_from(KEYS[1]) end
for j = 0, npacks - 1 do
  local n, name = ARGV[3 + 2 * j], ARGV[4 + 2 * j]
  if trusted(KEYS[1], KEYS[4], from, n, name) then
    good[tonumber(n)] = {}
  end
end
local olds = {}
if bits == mark then
  for i = first, #ARGV, 7 do
    local place = tonumber(ARGV[i + 5]) or 0
    if place > 0 then
      local group = good[math.floor((place - 1) / """ + str(PACK_SLOTS) + """)]
      if group then group[#group + 1] = i end
    end
  end
  local mine, other = 0, 1
  if mark == 4 then mine, other = 1, 0 end
  for n, group in pairs(good) do
    for lo = 1, #group, 500 do
      local args = {}
      for g = lo, math.min(lo + 499, #group) do
        local slot = (tonumber(ARGV[group[g] + 5]) - 1) % """ + str(PACK_SLOTS) + """
        args[#args + 1] = 'GET'; args[#args + 1] = 'u1'; args[#args + 1] = slot * 2 + other
        args[#args + 1] = 'SET'; args[#args + 1] = 'u1'; args[#args + 1] = slot * 2 + mine; args[#args + 1] = 1
      end
      local r = redis.call('BITFIELD', tab.pk .. n, unpack(args))
      for g = lo, math.min(lo + 499, #group) do
        local k = (g - lo) * 2
        local o, m = r[k + 1], r[k + 2]
        local old = 1
        if mark == 2 then old = old + 2 * m + 4 * o else old = old + 4 * m + 2 * o end
        if m == 0 then
          count(tab, old, -1)
          count(tab, bit.bor(old, mark), 1)
        end
        olds[group[g]] = old
      end
    end
  end
end
local rest = {}
for i = first, #ARGV, 7 do
  if olds[i] == nil then rest[#rest + 1] = ARGV[i] end
end
preload(tab, rest)
for i = first, #ARGV, 7 do
  local old = olds[i]
  if old == nil then
    if bits == mark then old = mark_one(tab, ARGV[i], mark) else old = change(tab, ARGV[i], bits, 0) end
  end
  if bit.band(old, mark) == 0 then
    added = added + 1""" + LUA_ADD.format(arg="ARGV[i + 4]") + """
    if ARGV[i + 1] ~= '' and (mark == 2 or bit.band(old, 2) == 0) then
      bump(ARGV[i + 1], 1)
      if ARGV[i + 2] ~= '0' then bump('""" + SHIPPED_TURNS + """', tonumber(ARGV[i + 2]) or 0) end
      if ARGV[i + 3] ~= '' then bump(ARGV[i + 3], 1) end
      if ARGV[i + 6] ~= '0' then bump('""" + SHIPPED_FEATURES + """', tonumber(ARGV[i + 6]) or 0) end
    end
  end
end
flush(tab)
for f, n in pairs(sums) do redis.call('HINCRBY', KEYS[2], f, string.format('%.0f', n)) end
if added > 0 and bits == mark then
  -- in whole seconds (the stats are integers), rounded up: the run's start (a fraction of a second)
  -- is never after its end, so a run shorter than a second still shows its rate
  local now = redis.call('TIME')
  redis.call('HSET', KEYS[2], '""" + LAST_MARK_AT + """', tonumber(now[1]) + (tonumber(now[2]) > 0 and 1 or 0))
end
""" + LUA_FLUSH + """return added
"""


#: The consumer's look-up of a job's items by their places. KEYS: the item table, the pack table.
#: ARGV: '1' for a job's first take (`ItemTable.states`: nothing read unless the marks were ever
#: rebuilt), the pack's number and name, then the items' slots. One byte an item, '1' when its
#: DONE bit is set; an empty answer when nothing was read; nil when the pack's slots are not
#: trusted (the marking script's rule), and the caller reads each item's entry instead.
DONE_AT = LUA_ITEMS + LUA_TRUSTED + """
if ARGV[1] == '1' and redis.call('HEXISTS', KEYS[1], '""" + REBUILT + """') == 0 then return '' end
local n = ARGV[2]
if not trusted(KEYS[1], KEYS[2], placed_from(KEYS[1]), n, ARGV[3]) then return false end
local tab = items_table(KEYS[1], false)
local out = {}
for lo = 4, #ARGV, 500 do
  local args = {}
  for i = lo, math.min(lo + 499, #ARGV) do
    args[#args + 1] = 'GET'; args[#args + 1] = 'u1'; args[#args + 1] = tonumber(ARGV[i]) * 2
  end
  local r = redis.call('BITFIELD', tab.pk .. n, unpack(args))
  for _, b in ipairs(r) do out[#out + 1] = tostring(b) end
end
return table.concat(out)
"""


def item_args(digests: list[bytes], kinds: list[str], turns: list[int] | None = None,
          tools: list[str] | None = None, spec: list[str] | None = None,
          places: list[int] | None = None, features: list[int] | None = None) -> list[bytes | str | int]:
    """The marking script's items: (digest, counter, turns, tool-turns counter, tallies, place,
    feature rows) each."""
    if len(kinds) != len(digests):  # marks built without kinds: nothing to count
        kinds = [""] * len(digests)
    if turns is None or len(turns) != len(digests):
        turns = [0] * len(digests)
    if tools is None or len(tools) != len(digests):
        tools = [""] * len(digests)
    if spec is None or len(spec) != len(digests):
        spec = [""] * len(digests)
    if places is None or len(places) != len(digests):
        places = [0] * len(digests)
    if features is None or len(features) != len(digests):
        features = [0] * len(digests)
    return [x for t in zip(digests, kinds, turns, tools, spec, places, features, strict=True) for x in t]


def pack_args(packs: dict[int, str], places: list[int]) -> list[str | int]:
    """The marking script's packs: how many, then (number, name) each, of those PLACES name."""
    used = sorted({(p - 1) // PACK_SLOTS for p in places if p > 0} & packs.keys())
    return [len(used), *(x for n in used for x in (n, packs[n]))]
