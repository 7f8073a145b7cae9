"""How consumers notice a Redis that lost marks: their stamps and the runs' rebuild states.

consumer/guards/rewind.py holds the policy; this module, the keys and their round trips:
  genqueue:marks_stamp:<worker>   str  a counter, set after each marks write of WORKER, in the
                                       same pipeline (common/keepers/marks.py Marks.mark_shipped's STAMP)
  genqueue:run:<run>:rebuild      str  "pending:<nonce>" while RUN's marks are to be rebuilt from
                                       its shipped shards, "done:<nonce>" once they are
Both are kept KEEP seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from genqueue.common.keepers.keeper import KEY_PREFIX, RUN_KEY, RunKeeper

#: Seconds the stamp and a finished rebuild's state are kept.
KEEP = 7 * 24 * 3600


@dataclass(frozen=True, slots=True)
class Look:
    """One look at Redis: its run_id (None when INFO is refused or not asked), the stamp it holds of one
    consumer (0 for none), and each run's rebuild state ("" for none)."""

    run_id: str | None
    stamp: int
    states: list[str]


class MarkStamp:
    """WORKER's marks stamp on CONN: its key, the look at it (with the runs' rebuild states), and
    the runs it marks pending when it finds the stamp gone back."""

    def __init__(self, conn: redis.Redis, worker: str) -> None:
        self.conn = conn
        self.worker = worker

    @staticmethod
    def key(worker: str) -> str:
        return f"{KEY_PREFIX}:marks_stamp:{worker}"

    def look(self, runs: list[str], *, server: bool = True) -> Look:
        """The worker's stamp, RUNS' rebuild states and (with SERVER) Redis's run_id, in one
        round trip."""
        with self.conn.pipeline(transaction=False) as p:
            if server:
                p.info("server")
            p.get(self.key(self.worker))
            for run in runs:
                p.get(RebuildState.key(run))
            # INFO may be refused (a managed Redis's ACL): the run_id only tells the log.
            answers = p.execute(raise_on_error=False)
        info = answers.pop(0) if server else None
        stamp, *states = answers
        for answer in (stamp, *states):
            if isinstance(answer, Exception):
                raise answer
        run_id = None if not isinstance(info, dict) else str(info.get("run_id"))
        return Look(run_id, int(_text(stamp) or 0), [_text(raw) or "" for raw in states])

    def mark_pending(self, runs: list[str], nonce: str, stamp: int) -> None:
        """RUNS' marks are to be rebuilt (state "pending:NONCE"); the worker's stamp is STAMP again."""
        with self.conn.pipeline(transaction=False) as p:
            for run in runs:
                p.set(RebuildState.key(run), f"pending:{nonce}")
            p.set(self.key(self.worker), stamp, ex=KEEP)
            p.execute()


class RebuildState(RunKeeper):
    """RUN's rebuild state on CONN: "pending:<nonce>", "done:<nonce>" or none."""

    key_template = RUN_KEY + ":rebuild"

    def get(self) -> str:
        """The run's rebuild state ("" for none)."""
        return _text(self.conn.get(self.key(self.run))) or ""

    def rebuilt(self, pending: str) -> None:
        """The run's marks are rebuilt: its state PENDING ("pending:<nonce>") becomes "done:<nonce>"."""
        self.conn.set(self.key(self.run), "done:" + pending.removeprefix("pending:"), ex=KEEP)

    def forget(self) -> None:
        """Drop the run's rebuild state (the run is gone: re-creating it rebuilds its marks)."""
        self.conn.delete(self.key(self.run))


def _text(raw: object) -> str | None:
    return raw.decode() if isinstance(raw, bytes) else None if raw is None else str(raw)
