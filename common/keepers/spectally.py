"""The acceptance tallies: a run's speculative-decoding figures by category, counted once per item.

Key: genqueue:run:<run>:spec  hash  "<facet>\\x1f<label>\\x1f<answers|steps|drafted|accepted>" -> sum

Written only by the marking script (common/keepers/marks.py), in the same script as the marks:
each item newly marked done adds what its record's answers carry (common.acceptance.tally_fields),
so an item redone after a crash, or answered twice (an end-of-run copy, a lease lost and taken
again), counts once, as it is done once; a rebuild of the marks from the shipped shards rebuilds
the tallies with them, and deleting the run deletes them (its genqueue:run:<run>:* keys). The
overall figures are the source facet's sum (every answer is in one category of each facet).

This module spells the key, the encoding of one record's tallies for the script, and the read
into a common.acceptance.AcceptanceTable (`producer status`'s speculation section).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import redis

from genqueue.common.acceptance import AcceptanceTable, table_of_fields, tally_fields
from genqueue.common.keepers.keeper import run_key

#: Splits a field's facet, label and count name (labels have it replaced: acceptance.clean_label).
FIELD_SEP = "\x1f"
#: Ends each field and each amount of a record's tallies in the marking script's argument.
ARG_SEP = "\x1e"

#: The marking script's parts: LUA_ADD adds one item's tallies (its argument ARG, a Lua
#: expression: pairs "field<ARG_SEP>amount<ARG_SEP>", decimal 30 is ARG_SEP) to the script's
#: sums, LUA_FLUSH adds the sums to the hash KEYS[3] once per field at the end (a shard's items
#: share a few dozen fields: one HINCRBY each, not one per item and field).
LUA_ADD = """
    if {arg} ~= '' then
      for f, n in string.gmatch({arg}, '([^\\30]+)\\30(%d+)\\30') do
        tallies[f] = (tallies[f] or 0) + tonumber(n)
      end
    end"""
LUA_INIT = "local tallies = {}\n"
LUA_FLUSH = """for f, n in pairs(tallies) do
  redis.call('HINCRBY', KEYS[3], f, string.format('%.0f', n))
end
"""


class SpecTallies:
    """A run's acceptance tallies in Redis: their key, what a record adds, and their read."""

    def __init__(self, conn: redis.Redis | None = None) -> None:
        self.conn = conn

    @staticmethod
    def key(run: str) -> str:
        return run_key(run, "spec")

    @staticmethod
    def argument(rec: Mapping[str, Any]) -> str:
        """What record REC adds to its run's tallies, as the marking script reads it ("" for a
        record without figures)."""
        return "".join(f"{f}{ARG_SEP}{n}{ARG_SEP}" for f, n in tally_fields(rec, FIELD_SEP).items())

    def table(self, run: str) -> AcceptanceTable:
        """RUN's tallies as a table (empty when nothing with figures has shipped; garbage fields
        are left out)."""
        if self.conn is None:
            raise ValueError("SpecTallies.table needs a connection")
        raw = cast(dict[Any, Any], self.conn.hgetall(self.key(run)))
        fields: dict[str, int] = {}
        for k, v in raw.items():
            try:
                fields[k.decode() if isinstance(k, bytes) else str(k)] = int(v)
            except ValueError:
                continue
        return table_of_fields(fields, FIELD_SEP)
