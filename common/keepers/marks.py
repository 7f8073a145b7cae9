"""The mark store: the one owner of which items of a run have a record in a shipped shard.

Every read and write of the done and failed marks goes through its class, Marks(conn, run), Lua included
(they are bits of the run's item table, common/keepers/items.py, whose layout that module owns):
marking a shipped shard (and bumping its per-outcome counters), the consumer's look-up of a
job's items, the producer's item states and re-claim, the counts, and the rebuild from the
shards. Nothing outside it spells the keys' layout or the counters' names in a command, so a
change of how the marks are stored is a change of this file (and its tests) alone: status
reads `Marks.progress`, `producer runs` reads `Marks.totals`, and the counters' names are SHIPPED_*.

When a shard is shipped, the items of the records it holds are marked DONE (results) or FAILED
(error records) in the run's item table, in one round trip, before any job is acked on it.
A job that runs again (after a crash, a sweep, a requeue) skips the items already marked:
their records are shipped already. The marks are an optimisation over the truth, which stays
in the shipped shards: if they are lost (Redis flushed), nothing breaks, work is only redone.

Until issue 34 the marks were two sets of 16-byte digests (`genqueue:run:<run>:done` and
`:failed`), 80 bytes of Redis an item each; they are two bits of an item's entry now, and the
counts status reads are kept beside them by the same scripts. An item by reference has a place
(its pack, its slot: items.py), which its job tells the consumer (`Place`, carried with each
record to the shard's marks), and its marks are two bits of its pack's string: a shard's items
are marked with a few BITFIELDs a pack, not a command an item (the marking script says when a
place is trusted, and what is marked by entry instead).

With the marks, in the same script, each item newly marked adds one to its outcome's counter
(`shipped_outcome_<outcome>`, `shipped_failed_<class>` in the run's stats; the time, LAST_MARK_AT), and a regenerate
conversation with recorded tool turns one to what became of them (`shipped_tools_<ToolTurns>`):
so the outcomes `producer status` shows always sum to the items it calls done, at every moment,
and its tool-turn counts are export's (`record_tool_turns` is the one rule for both). A result's
speculative-decoding figures by category go to the run's tallies the same way, once per item
(common/keepers/spectally.py).

The producer's reads (`Marks.item_states`, `Marks.all_done`) read the item table in one call
each; its re-claim, which reads the marks too but writes a claim set, is the claims keeper's
(common/keepers/claims.py `Reclaim`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import redis

from genqueue.common import defaults
from genqueue.common.contracts import Note, ToolTurns
from genqueue.common.features.store import FeatureStore
from genqueue.common.keepers.featurecounts import FeatureCounts, Recounted
from genqueue.common.keepers.itemlayout import LUA_ITEMS, MOVED, PACK_SLOTS, PLACED_FROM, REBUILT
from genqueue.common.keepers.items import DONE, FAILED, IN_RUN, ItemTable, counts_of
from genqueue.common.keepers.keeper import RunKeeper, run_key
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.redismem import pipeline_read
from genqueue.common.keepers.runs import key_digest
from genqueue.common.keepers.spectally import LUA_ADD, LUA_FLUSH, LUA_INIT, SpecTallies
from genqueue.common.storage import ShardStore, read_manifest

log = logging.getLogger(__name__)

REBUILD_BATCH = defaults.MARKS_REBUILD_BATCH


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
_LUA_TRUSTED = """
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
#: a pack for the whole shard, the old bits answered so the counts stay exact (issue 34, step 8:
#: no Redis command an item). That holds while the run's pack table (KEYS[4]) names that pack
#: under that number, no re-queue moved items out of it (`moved:<number>` in the table's hash),
#: and it is numbered from `placed_from` on (a pack written before items had places, by an
#: earlier genqueue, is not): the items' entries then hold those places, as the claim wrote them. Otherwise, and for
#: an item without a place (inline, a leftover shard read back from disk, a rebuild), it is
#: marked by its entry (the buckets they touch read with one MGET and written with one MSET; in a
#: table an earlier genqueue made, one HINCRBY an item, `mark_one`), or its entry's place when it has one.
_MARK = LUA_ITEMS + _LUA_TRUSTED + """
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


class Place(NamedTuple):
    """Where an item by reference is in its run: slot SLOT of pack number PACK, named NAME."""

    pack: int
    name: str
    slot: int


#: The consumer's look-up of a job's items by their places. KEYS: the item table, the pack table.
#: ARGV: '1' for a job's first take (`ItemTable.states`: nothing read unless the marks were ever
#: rebuilt), the pack's number and name, then the items' slots. One byte an item, '1' when its
#: DONE bit is set; an empty answer when nothing was read; nil when the pack's slots are not
#: trusted (the marking script's rule), and the caller reads each item's entry instead.
_DONE_AT = LUA_ITEMS + _LUA_TRUSTED + """
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


@dataclass(slots=True)
class ShardMarks:
    """The item digests one shard holds, split by record kind, with each one's counter name
    (its outcome or error class; empty when unknown), a result's turns and its tool turns'
    counter name (empty when it had none)."""

    done: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    done_kind: list[str] = field(default_factory=list)
    failed_kind: list[str] = field(default_factory=list)
    done_turns: list[int] = field(default_factory=list)
    done_tools: list[str] = field(default_factory=list)
    done_spec: list[str] = field(default_factory=list)  # a result's acceptance tallies (SpecTallies.argument)
    done_features: list[int] = field(default_factory=list)  # the feature rows a result names (--capture)
    # Each item's place (its pack's number x PACK_SLOTS + its slot + 1; 0: none), and the names of
    # those packs by number: by reference the mark is at the place (the marking script).
    done_place: list[int] = field(default_factory=list)
    failed_place: list[int] = field(default_factory=list)
    packs: dict[int, str] = field(default_factory=dict)

    def add(self, item_key: str, *, error: bool, kind: str = "", turns: int = 0,
            tools: ToolTurns | None = None, spec: str = "", place: Place | None = None, features: int = 0) -> None:
        (self.failed if error else self.done).append(key_digest(item_key))
        if place is not None and 0 <= place.slot < PACK_SLOTS and place.pack > 0:
            (self.failed_place if error else self.done_place).append(place.pack * PACK_SLOTS + place.slot + 1)
            # one number under two names (jobs from both sides of a rewind in one shard): no name,
            # which the pack table never holds, so all of them are marked by entry
            prev = self.packs.get(place.pack)
            self.packs[place.pack] = place.name if prev is None or prev == place.name else ""
        else:
            (self.failed_place if error else self.done_place).append(0)
        (self.failed_kind if error else self.done_kind).append(
            (f"{SHIPPED_FAILED}{kind}" if error else f"{SHIPPED_OUTCOME}{kind}") if kind else "")
        if not error:
            self.done_turns.append(turns)
            self.done_tools.append(f"{SHIPPED_TOOLS}{tools.value}" if tools is not None else "")
            self.done_spec.append(spec)
            self.done_features.append(features)

    def add_record(self, rec: Mapping[str, object], place: Place | None = None) -> None:
        """Add the item of record REC (a result or an error record, by its `error` field), at
        PLACE when its job named it (by reference)."""
        key = rec["key"]
        if not isinstance(key, str):
            raise TypeError(f"a record's key is a string, not {type(key).__name__}")
        error = "error" in rec
        self.add(key, error=error, kind=record_kind(rec), turns=record_turns(rec),
                 tools=None if error else record_tool_turns(rec), spec="" if error else SpecTallies.argument(rec),
                 place=place, features=0 if error else record_feature_rows(rec))


def record_kind(rec: Mapping[str, object]) -> str:
    """The outcome of a result record, or the class of an error record ("" when neither)."""
    err = rec.get("error")
    if isinstance(err, dict):
        return str(err.get("class") or "")
    return str(rec.get("outcome") or "")


def record_turns(rec: Mapping[str, object]) -> int:
    """How many user turns a regenerate record answered (0 for any other record): the answers
    after tool results within a user turn (they have a `step`) are not turns of their own, so
    the count stays comparable with the run's user turns."""
    turns = rec.get("turns")
    return sum(1 for t in turns if not (isinstance(t, dict) and "step" in t)) if isinstance(turns, list) else 0


def record_feature_rows(rec: Mapping[str, object]) -> int:
    """How many feature rows (--capture's hidden states, or --logprobs's tables: a run stores one
    kind) a result record names: its answer's, or each regenerated turn's."""
    turns = rec.get("turns")
    answers = turns if isinstance(turns, list) else [rec]
    return sum(1 for a in answers if isinstance(a, Mapping)
               and any(isinstance(ref := a.get(f), Mapping) and "row" in ref for f in ("features", "logprobs")))


def record_tool_turns(rec: Mapping[str, object]) -> ToolTurns | None:
    """What became of a regenerate record's recorded tool turns (None: it had none, it stopped
    elsewhere, or it is no regenerate record): the one rule status and export count by.
    Regenerated to the end: tool results were spliced in and nothing stopped it."""
    turns = rec.get("turns")
    if not isinstance(turns, list):
        return None
    note, stopped = rec.get("note"), rec.get("stopped")
    stopped = stopped if isinstance(stopped, dict) else None
    if note == Note.TOOL_CALL_DIVERGED or (stopped is not None and stopped.get("reason") == Note.TOOL_CALL_DIVERGED):
        return ToolTurns.DIVERGED
    if note == Note.STOPPED_AT_TOOL_TURN or (stopped is not None and stopped.get("step")):
        return ToolTurns.STOPPED  # cut by the producer, or an answer after tool results failed or was cut
    if stopped is None and any(isinstance(t, dict) and t.get("tool_results_spliced") for t in turns):
        return ToolTurns.TO_END
    return None


def marks_of_file(path: Path) -> ShardMarks:
    """The marks of a shard on disk (a leftover of an earlier consumer): its records' keys."""
    marks = ShardMarks()
    with open(path, "rb") as fh:
        for line in fh:
            try:
                marks.add_record(orjson.loads(line))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    return marks


def _args(digests: list[bytes], kinds: list[str], turns: list[int] | None = None,
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


def _packs(packs: dict[int, str], places: list[int]) -> list[str | int]:
    """The marking script's packs: how many, then (number, name) each, of those PLACES name."""
    used = sorted({(p - 1) // PACK_SLOTS for p in places if p > 0} & packs.keys())
    return [len(used), *(x for n in used for x in (n, packs[n]))]


class Mark(StrEnum):
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Progress:
    """A run's items and marks read at one moment, with the counters the marking script bumps
    (and the run's other counters: its whole stats hash, garbage fields left out)."""

    items: int  # in the run (IN_RUN in its item table)
    done: int
    failed: int  # items with an error record, whether or not they have a result too
    failed_and_done: int  # an error record, then a result on a later attempt (0: Redis before 7.0)
    stats: dict[str, int]

    @property
    def last_mark_at(self) -> float | None:
        """When a shipped shard last marked an item newly (None: no marks, or marks older than it)."""
        return float(self.stats[LAST_MARK_AT]) if self.stats.get(LAST_MARK_AT) else None

    @property
    def failed_only(self) -> int:
        """Items with an error record and no result."""
        return max(self.failed - self.failed_and_done, 0)


# --- after a Redis loss (or a rewind): the marks, from the shipped shards -------------------
@dataclass(slots=True)
class Rebuilt:
    """What Marks.rebuild read."""

    shards: int = 0
    records: int = 0
    done: int = 0
    failed: int = 0
    unreadable: int = 0  # lines that are not a record with a key (a torn or foreign line)
    seconds: float = 0.0
    features: Recounted | None = None  # the feature counters, when the run's feature store was given

    def line(self) -> str:
        text = (f"{self.records:,} records in {self.shards:,} shards: {self.done:,} items done, "
                f"{self.failed:,} with an error record")
        if self.features is not None and self.features.shards:
            text += f"; {self.features.line()}"
        return text + (f", {self.unreadable:,} unreadable lines skipped" if self.unreadable else "")


class Marks(RunKeeper):
    """RUN's done and failed marks on CONN (in its item table, common/keepers/items.py): the
    marking of a shipped shard, the look-ups, the producer's reads and the rebuild from the
    shipped shards."""

    def __init__(self, conn: redis.Redis, run: str) -> None:
        super().__init__(conn, run)
        self.table = ItemTable(conn, run)

    # --- the consumers' writes and look-ups ------------------------------------------------
    def _send(self, p: Any, marks: ShardMarks, *, in_run: bool = False) -> None:
        """Queue on pipeline P the marking script's calls for MARKS: the results first, then the
        error records (one of an item with a result counts nowhere). IN_RUN: put the items in
        the run too (a rebuild)."""
        run, also = self.run, IN_RUN if in_run else 0
        keys = (ItemTable.key(run), run_key(run, "stats"), SpecTallies.key(run), PackTable.key(run))
        if marks.done:
            p.eval(_MARK, 4, *keys, DONE | also, *_packs(marks.packs, marks.done_place),
                   *_args(marks.done, marks.done_kind, marks.done_turns, marks.done_tools, marks.done_spec,
                          marks.done_place, marks.done_features))
        if marks.failed:
            p.eval(_MARK, 4, *keys, FAILED | also, *_packs(marks.packs, marks.failed_place),
                   *_args(marks.failed, marks.failed_kind, places=marks.failed_place))

    def mark_shipped(self, marks: ShardMarks, *, stamp: tuple[str, int, int] | None = None) -> int | None:
        """Record MARKS of a shipped shard of the run (one round trip). STAMP (key, value, expiry
        in seconds) is set after the marks: Redis holding the stamp holds the marks written before
        it. Returns the stamp it replaced (0 if none; None without STAMP or with nothing to mark):
        consumer/guards/rewind.py tells by it a Redis that lost writes."""
        if not marks.done and not marks.failed:
            return None
        with self.conn.pipeline(transaction=False) as p:
            self._send(p, marks)
            if stamp is not None:
                p.set(stamp[0], stamp[1], ex=stamp[2], get=True)
            out = p.execute()
        return int(out[-1] or 0) if stamp is not None else None

    def marks_of(self, item_keys: list[str]) -> list[Mark | None]:
        """For each item key, whether a shipped shard already holds its result (DONE), only an
        error record (FAILED), or nothing (None). One round trip."""
        states = self.table.states([key_digest(k) for k in item_keys])
        return [Mark.DONE if s & DONE else Mark.FAILED if s & FAILED else None for s in states]

    def done_of(self, item_keys: list[str], *, first_take: bool = False,
                places: Mapping[str, Place] | None = None) -> set[str]:
        """The item keys whose result a shipped shard already holds (marked DONE). One round trip.
        FIRST_TAKE: the items of a job no consumer took before (`ItemTable.states`): in a run whose
        marks were never rebuilt none can be done, and one command says so. PLACES: the items'
        places (a job by reference, every item in one pack): their pack's bits are read, a few
        commands for the job, when the marking script would trust that pack's slots; else each
        item's entry is read."""
        if item_keys and places and all(k in places for k in item_keys):
            first = places[item_keys[0]]
            if all(places[k].pack == first.pack and places[k].name == first.name for k in item_keys):
                raw = self.conn.register_script(_DONE_AT)(
                    keys=[ItemTable.key(self.run), PackTable.key(self.run)],
                    args=["1" if first_take else "0", first.pack, first.name, *(places[k].slot for k in item_keys)])
                if raw is not None:
                    return {k for k, c in zip(item_keys, bytes(raw), strict=False) if c == ord("1")}
        states = self.table.states([key_digest(k) for k in item_keys], first_take=first_take)
        return {k for k, s in zip(item_keys, states, strict=True) if s & DONE}

    # --- the producer's reads: item states, all done, counts -------------------------------
    def item_states(self, digests: list[bytes]) -> bytes:
        """Each item's state bits (IN_RUN, DONE, FAILED), one byte per digest, in one round trip."""
        return self.table.states(digests)

    def all_done(self) -> bool:
        """Whether every item in the run is DONE (one round trip)."""
        c = self.table.counts()
        return c.in_run == c.in_run_done

    def progress(self) -> Progress:
        """The run's Progress, in one transaction: the marks' counts and the outcome counters the
        same script bumps are read at one moment, so they agree."""
        # a full Redis refuses MULTI
        return self.progress_of(*pipeline_read(self.conn, self.stage_progress, raise_on_error=False))

    def stage_progress(self, p: Any) -> None:
        """Queue the reads of the run's Progress on P (two replies, for progress_of): a caller
        reads it in one transaction with its other reads (common/keepers/runstate.py)."""
        p.hgetall(ItemTable.key(self.run))
        p.hgetall(run_key(self.run, "stats"))

    @staticmethod
    def progress_of(table: Any, raw: Any) -> Progress:
        """The Progress from the two replies stage_progress queued (read with raise_on_error=False)."""
        c = counts_of(table)
        stats: dict[str, int] = {}
        for k, v in (raw.items() if isinstance(raw, dict) else []):
            try:
                stats[k.decode() if isinstance(k, bytes) else str(k)] = int(v)
            except ValueError:  # garbage in the hash: left out, as RunStore.stats does
                continue
        return Progress(c.in_run, c.done, c.failed, c.failed_done, stats)

    def totals(self) -> tuple[int, int, int]:
        """The run's items and its done and failed marks as stored (an item may be in both
        marks), one round trip: `producer runs`' figures."""
        c = self.table.counts()
        return c.in_run, c.done, c.failed

    # --- after a Redis loss (or a rewind): the marks, from the shipped shards --------------
    def rebuild(self, store: ShardStore, features: FeatureStore | None = None) -> Rebuilt:
        """Rebuild the run's DONE and FAILED marks, and its items (IN_RUN), from every record of its
        shipped shards (streamed: memory holds one batch of digests). The marks are written by
        the marking script the consumers ship with, so each item newly marked bumps the counters
        it would have bumped when its shard shipped (outcome or error class, turns, tool turns):
        after a Redis loss status shows the figures it showed before. Idempotent: marks only get
        added, and an item already marked counts nothing more. With FEATURES (the run's feature
        store), its feature counters too (rows, bytes, tokens, the capture budget's bytes), from
        the feature shards' indexes, each shard counted once (featurecounts.py)."""
        conn, run = self.conn, self.run
        t0 = time.perf_counter()
        out = Rebuilt()
        batch = ShardMarks()

        def flush() -> None:
            nonlocal batch
            if not batch.done and not batch.failed:
                return
            with conn.pipeline(transaction=False) as p:
                self._send(p, batch, in_run=True)
                p.execute()
            batch = ShardMarks()

        shards = list(store.list_shards(run))
        manifests = [read_manifest(store, run, shard) for shard in shards]
        # the table's size, if Redis has none yet: the shipped records, and room for the items
        # still to come (a rebuilt run is one being worked on)
        self.table.ensure(sum(m["records"] for m in manifests if m is not None) * 3 // 2)
        if shards:  # before any mark: a job waiting since may hold items done now (ItemTable.states)
            self.table.note_rebuilt()
        for shard, manifest in zip(shards, manifests, strict=True):
            out.shards += 1
            lines = 0
            with store.open(run, shard.name) as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    lines += 1
                    try:
                        rec = orjson.loads(line)
                        if not isinstance(rec, dict):
                            raise TypeError("a record is a JSON object")
                        batch.add_record(rec)
                    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                        out.unreadable += 1
                        continue
                    out.records += 1
                    if len(batch.done) + len(batch.failed) >= REBUILD_BATCH:
                        flush()
            if manifest is not None and manifest["records"] != lines:
                log.warning("shard %s holds %d records, its manifest says %d", shard.name, lines,
                            manifest["records"])
        flush()
        if features is not None:
            out.features = FeatureCounts(conn, run).rebuild(features)
        c = self.table.counts()
        out.done, out.failed = c.done, c.failed
        out.seconds = time.perf_counter() - t0
        return out
