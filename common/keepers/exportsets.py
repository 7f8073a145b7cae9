"""An export's scratch sets in Redis: the item keys it wrote (seen), and, once it is done, the
run's keys it found no record of (missing), computed by Redis whatever their number.

Keys: genqueue:run:<run>:export:<id>:seen     set  16-byte digests of the keys written
      genqueue:run:<run>:export:<id>:missing  set  the run's items minus seen (ItemTable.fill_missing)
Both expire after TEMP_KEY_TTL, so an export killed midway leaves nothing for long; the export
deletes them when it ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import NamedTuple

import redis

from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.keeper import RunKeeper, run_key

#: Seconds an export's temporary sets live: a day outlasts any export.
TEMP_KEY_TTL = 24 * 3600
#: Members per SSCAN of an export set (~160 KB a round trip).
_SCAN = 10_000


class ScratchKeys(NamedTuple):
    seen: str
    missing: str


class Coverage(NamedTuple):
    """How the export's seen set compares with the run's items."""

    enqueued: int  # the run's items
    seen: int  # keys the export wrote
    missing: int  # the run's items it wrote no record of (now in the missing set)


class ScratchSet:
    """One scratch set of an export (its seen or its missing set, by KEY, from
    ExportSets.keys) on CONN."""

    def __init__(self, conn: redis.Redis, key: str) -> None:
        self.conn = conn
        self.key = key

    def add(self, digests: list[bytes]) -> None:
        """Add DIGESTS (the set's lifetime renewed)."""
        with self.conn.pipeline(transaction=False) as p:
            p.sadd(self.key, *digests)
            p.expire(self.key, TEMP_KEY_TTL)
            p.execute()

    def members(self, digests: list[bytes]) -> list[bool]:
        """For each of DIGESTS, whether the set holds it."""
        return [bool(x) for x in self.conn.smismember(self.key, digests)] if digests else []

    def remove(self, digests: list[bytes]) -> None:
        self.conn.srem(self.key, *digests)

    def each_member(self) -> Iterator[bytes]:
        """Every digest the set holds (in parts: it may hold millions)."""
        for d in self.conn.sscan_iter(self.key, count=_SCAN):
            yield bytes(d)


class ExportSets(RunKeeper):
    """One export's two scratch sets of RUN on CONN: their keys (new ones unless KEYS is given),
    the coverage they compute, and their end."""

    def __init__(self, conn: redis.Redis, run: str, keys: ScratchKeys | None = None) -> None:
        super().__init__(conn, run)
        self.keys = self.new_keys(run) if keys is None else keys

    @staticmethod
    def new_keys(run: str) -> ScratchKeys:
        """A new export's two scratch keys for RUN."""
        seen = run_key(run, f"export:{uuid.uuid4().hex}:seen")
        return ScratchKeys(seen, seen.removesuffix(":seen") + ":missing")

    def coverage(self) -> Coverage:
        """Fill the missing set with the run's items the seen set lacks; the three counts."""
        conn, keys = self.conn, self.keys
        table = ItemTable(conn, self.run)
        enqueued = table.counts().in_run
        seen = int(conn.scard(keys.seen))
        conn.delete(keys.missing)
        missing = table.fill_missing(keys.seen, keys.missing, TEMP_KEY_TTL)
        return Coverage(enqueued, seen, missing)

    def drop(self) -> None:
        """Delete the export's scratch sets."""
        self.conn.delete(self.keys.seen, self.keys.missing)
