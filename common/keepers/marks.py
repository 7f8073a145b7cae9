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
counts status reads are kept beside them by the same scripts.

With the marks, in the same script, each item newly marked adds one to its outcome's counter
(`shipped_outcome_<outcome>`, `shipped_failed_<class>` in the run's stats), and a regenerate
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
from typing import Any

import orjson
import redis

from genqueue.common import defaults
from genqueue.common.contracts import Note, ToolTurns
from genqueue.common.keepers.items import DONE, FAILED, IN_RUN, LUA_ITEMS, ItemTable, counts_of, table_key
from genqueue.common.keepers.redismem import pipeline_read
from genqueue.common.keepers.runs import key_digest, run_key
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


#: Marks the items in ARGV: ARGV[1] the state bits to set (DONE or FAILED, with IN_RUN when a
#: rebuild puts the items in the run too), then per item (digest, counter name, turns,
#: tool-turns counter name, acceptance tallies), in the run's item table KEYS[1]; each item newly
#: marked adds 1 to its counter in KEYS[2] (unless it is an error record of an item with a
#: result already: that counts nowhere), its regenerated turns to `shipped_turns`, 1 to its
#: tool-turns counter, if any, and its tallies to KEYS[3] (common/keepers/spectally.py). The
#: sums are written at the end, one HINCRBY a counter (a shard's items share a handful), and a
#: consumer's mark (DONE or FAILED alone) is one HINCRBY an item (`mark_one`): about one Redis
#: command an item to finish, where it was an HGET, an HSET and one or two HINCRBYs.
_MARK = LUA_ITEMS + """
local added = 0
""" + LUA_INIT + """local tab = items_table(KEYS[1], true)
local bits = tonumber(ARGV[1])
local mark = bit.band(bits, 6)
local sums = {}
local function bump(f, n) sums[f] = (sums[f] or 0) + n end
for i = 2, #ARGV, 5 do
  local old
  if bits == mark then old = mark_one(tab, ARGV[i], mark) else old = change(tab, ARGV[i], bits, 0) end
  if bit.band(old, mark) == 0 then
    added = added + 1""" + LUA_ADD.format(arg="ARGV[i + 4]") + """
    if ARGV[i + 1] ~= '' and (mark == 2 or bit.band(old, 2) == 0) then
      bump(ARGV[i + 1], 1)
      if ARGV[i + 2] ~= '0' then bump('""" + SHIPPED_TURNS + """', tonumber(ARGV[i + 2]) or 0) end
      if ARGV[i + 3] ~= '' then bump(ARGV[i + 3], 1) end
    end
  end
end
flush(tab)
for f, n in pairs(sums) do redis.call('HINCRBY', KEYS[2], f, string.format('%.0f', n)) end
""" + LUA_FLUSH + """return added
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

    def add(self, item_key: str, *, error: bool, kind: str = "", turns: int = 0,
            tools: ToolTurns | None = None, spec: str = "") -> None:
        (self.failed if error else self.done).append(key_digest(item_key))
        (self.failed_kind if error else self.done_kind).append(
            (f"{SHIPPED_FAILED}{kind}" if error else f"{SHIPPED_OUTCOME}{kind}") if kind else "")
        if not error:
            self.done_turns.append(turns)
            self.done_tools.append(f"{SHIPPED_TOOLS}{tools.value}" if tools is not None else "")
            self.done_spec.append(spec)

    def add_record(self, rec: Mapping[str, object]) -> None:
        """Add the item of record REC (a result or an error record, by its `error` field)."""
        key = rec["key"]
        if not isinstance(key, str):
            raise TypeError(f"a record's key is a string, not {type(key).__name__}")
        error = "error" in rec
        self.add(key, error=error, kind=record_kind(rec), turns=record_turns(rec),
                 tools=None if error else record_tool_turns(rec), spec="" if error else SpecTallies.argument(rec))


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


def _quads(digests: list[bytes], kinds: list[str], turns: list[int] | None = None,
           tools: list[str] | None = None, spec: list[str] | None = None) -> list[bytes | str | int]:
    """The marking script's ARGV: (digest, counter, turns, tool-turns counter, tallies) per item."""
    if len(kinds) != len(digests):  # marks built without kinds: nothing to count
        kinds = [""] * len(digests)
    if turns is None or len(turns) != len(digests):
        turns = [0] * len(digests)
    if tools is None or len(tools) != len(digests):
        tools = [""] * len(digests)
    if spec is None or len(spec) != len(digests):
        spec = [""] * len(digests)
    return [x for t in zip(digests, kinds, turns, tools, spec, strict=True) for x in t]


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

    def line(self) -> str:
        text = (f"{self.records:,} records in {self.shards:,} shards: {self.done:,} items done, "
                f"{self.failed:,} with an error record")
        return text + (f", {self.unreadable:,} unreadable lines skipped" if self.unreadable else "")


class Marks:
    """RUN's done and failed marks on CONN (in its item table, common/keepers/items.py): the
    marking of a shipped shard, the look-ups, the producer's reads and the rebuild from the
    shipped shards."""

    def __init__(self, conn: redis.Redis, run: str) -> None:
        self.conn = conn
        self.run = run
        self.table = ItemTable(conn, run)

    # --- the consumers' writes and look-ups ------------------------------------------------
    def _send(self, p: Any, marks: ShardMarks, *, in_run: bool = False) -> None:
        """Queue on pipeline P the marking script's calls for MARKS: the results first, then the
        error records (one of an item with a result counts nowhere). IN_RUN: put the items in
        the run too (a rebuild)."""
        run, also = self.run, IN_RUN if in_run else 0
        keys = (table_key(run), run_key(run, "stats"), SpecTallies.key(run))
        if marks.done:
            p.eval(_MARK, 3, *keys, DONE | also,
                   *_quads(marks.done, marks.done_kind, marks.done_turns, marks.done_tools, marks.done_spec))
        if marks.failed:
            p.eval(_MARK, 3, *keys, FAILED | also, *_quads(marks.failed, marks.failed_kind))

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

    def done_of(self, item_keys: list[str], *, first_take: bool = False) -> set[str]:
        """The item keys whose result a shipped shard already holds (marked DONE). One round trip.
        FIRST_TAKE: the items of a job no consumer took before (`ItemTable.states`): in a run whose
        marks were never rebuilt none can be done, and one command says so."""
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
        run = self.run

        def build(p: Any) -> None:
            p.hgetall(table_key(run))
            p.hgetall(run_key(run, "stats"))

        # a full Redis refuses MULTI
        table, raw = pipeline_read(self.conn, build, raise_on_error=False)
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
    def rebuild(self, store: ShardStore) -> Rebuilt:
        """Rebuild the run's DONE and FAILED marks, and its items (IN_RUN), from every record of its
        shipped shards (streamed: memory holds one batch of digests). The marks are written by
        the marking script the consumers ship with, so each item newly marked bumps the counters
        it would have bumped when its shard shipped (outcome or error class, turns, tool turns):
        after a Redis loss status shows the figures it showed before. Idempotent: marks only get
        added, and an item already marked counts nothing more."""
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
        c = self.table.counts()
        out.done, out.failed = c.done, c.failed
        out.seconds = time.perf_counter() - t0
        return out
