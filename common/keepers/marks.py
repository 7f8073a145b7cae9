"""The mark store: the one owner of which items of a run have a record in a shipped shard.

Every read and write of the done and failed marks goes through Marks(conn, run): marking a
shipped shard (the marking script, markscript.py, which bumps the run's per-outcome counters
in the same call), the consumer's look-up of a job's items, the producer's item states, the
counts (`Marks.progress` for status, `Marks.totals` for `producer runs`), and the rebuild from
the shipped shards. The marks are two bits of an item's entry in the run's item table (items.py;
for an item by reference, of its pack's string, at the `Place` its job names). Nothing outside
this module and markscript.py spells the marks' layout or the counters' names in a command.

When a shard is shipped, the items of its records are marked DONE (results) or FAILED (error
records), in one round trip, before any job is acked on it; a job that runs again skips the
items already marked. The marks are an optimisation over the truth, which stays in the shipped
shards: if they are lost (Redis flushed), nothing breaks, work is only redone, and `rebuild`
puts them back with the counters they bumped. ShardMarks is what one shard marks: each record's
kind, turns, tool turns (`record_tool_turns`: the one rule status and export count by),
acceptance tallies and feature rows. The re-claim is the claims keeper's (claims.py `Reclaim`).
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

from genqueue.common.contracts import ToolTurns
from genqueue.common.features.store import FeatureStore
from genqueue.common.keepers.featurecounts import FeatureCounts, Recounted
from genqueue.common.keepers.itemlayout import PACK_SLOTS
from genqueue.common.keepers.items import DONE, FAILED, IN_RUN, ItemTable, counts_of
from genqueue.common.keepers.keeper import RunKeeper, run_key
from genqueue.common.keepers.markscript import (
    DONE_AT,
    LAST_MARK_AT,
    MARK,
    SHIPPED_FAILED,
    SHIPPED_OUTCOME,
    SHIPPED_TOOLS,
    item_args,
    pack_args,
)
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.redismem import pipeline_read
from genqueue.common.keepers.runs import key_digest
from genqueue.common.keepers.spectally import SpecTallies
from genqueue.common.records import record_feature_rows, record_kind, record_tool_turns, record_turns
from genqueue.common.storage import ShardStore, read_manifest

log = logging.getLogger(__name__)

#: Digests written per round trip when marks are rebuilt.
REBUILD_BATCH = 10_000


class Place(NamedTuple):
    """Where an item by reference is in its run: slot SLOT of pack number PACK, named NAME."""

    pack: int
    name: str
    slot: int


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
            p.eval(MARK, 4, *keys, DONE | also, *pack_args(marks.packs, marks.done_place),
                   *item_args(marks.done, marks.done_kind, marks.done_turns, marks.done_tools, marks.done_spec,
                          marks.done_place, marks.done_features))
        if marks.failed:
            p.eval(MARK, 4, *keys, FAILED | also, *pack_args(marks.packs, marks.failed_place),
                   *item_args(marks.failed, marks.failed_kind, places=marks.failed_place))

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
                raw = self.conn.register_script(DONE_AT)(
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
