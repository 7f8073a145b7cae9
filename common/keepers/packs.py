"""A run's pack table: which pack of prompts each pack number names (jobs by reference).

A job by reference carries its pack's number in the run and its block's number in that pack
(common/keepers/rqaccess.py's PackRef, in the job's `meta`); this table turns the number into
the pack's name in the run's output store (common/storage/names.py's pack_name).

Keys:
  genqueue:run:<run>:packs      hash  pack number -> pack name; written in the MULTI/EXEC that
                                      queues the pack's jobs (common/keepers/claims.py's
                                      Claims.enqueue), so a job never names a number the table
                                      lacks
  genqueue:run:<run>:packs:seq  str   the last pack number given out (INCR): numbers are unique
                                      in the run however many producers race on it

The producer writes a pack to the store before the transaction that names it: a number given
out whose transaction never landed names no job, and its pack (if written) is left in the store,
named by no job.
"""

from __future__ import annotations

from collections.abc import Mapping

from redis.client import Pipeline

from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.keeper import RUN_KEY, RunKeeper, run_key


class PackTable(RunKeeper):
    """RUN's pack table on CONN: giving out pack numbers, naming them, reading them back."""

    key_template = RUN_KEY + ":packs"

    @staticmethod
    def seq_key(run: str) -> str:
        return run_key(run, "packs:seq")

    def allocate(self) -> int:
        """A pack number no other pack of the run has (1, 2, ...)."""
        return int(self.conn.incr(self.seq_key(self.run)))

    def stage(self, pipe: Pipeline, number: int, name: str) -> None:
        """Queue the write of NUMBER -> NAME on PIPE (the transaction that queues its jobs)."""
        pipe.hset(self.key(self.run), str(number), name)

    def name_of(self, number: int) -> str | None:
        """The name of pack NUMBER, or None when the table does not hold it."""
        raw = self.conn.hget(self.key(self.run), str(number))
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)

    def names(self) -> dict[int, str]:
        """Every pack of the run by number (entries that are not a number and a name are left out)."""
        out: dict[int, str] = {}
        for k, v in self.conn.hgetall(self.key(self.run)).items():
            ks = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
            if ks.isdigit():
                out[int(ks)] = v.decode(errors="replace") if isinstance(v, bytes) else str(v)
        return dict(sorted(out.items()))

    def put_back(self, packs: Mapping[int, str]) -> int:
        """Name again each of PACKS (run.json's, number -> name) the table lacks, and give numbers
        out from past the highest of them (module docstring). Returns the entries named again.
        Their items' entries in the item table went with Redis (or never were in the Redis a
        rewind restored): a shard of those packs' jobs is marked by entry, not at its slots
        (`ItemTable.distrust`)."""
        if not packs:
            return 0
        numbers = list(packs)
        with self.conn.pipeline(transaction=False) as p:
            for number in numbers:
                p.hsetnx(self.key(self.run), str(number), packs[number])
            added = [n for n, x in zip(numbers, p.execute(), strict=True) if int(x)]
        ItemTable(self.conn, self.run).distrust(added)
        self.conn.eval(_AT_LEAST, 1, self.seq_key(self.run), max(packs))
        return len(added)

    def count(self) -> int:
        """How many packs the run's table names (0: every job of the run is inline)."""
        return int(self.conn.hlen(self.key(self.run)))


#: SET KEYS[1] to ARGV[1] unless it holds a larger number already (racing producers' INCRs kept).
_AT_LEAST = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if n < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 0
"""
