"""How consumers notice a Redis that lost marks: their stamps and the runs' rebuild states.

consumer/guards/rewind.py holds the policy; this module, the keys and their round trips:
  genqueue:marks_stamp:<worker>   str  a counter, set after each marks write of WORKER, in the
                                       same pipeline (common.marks.mark_shipped's STAMP)
  genqueue:run:<run>:rebuild      str  "pending:<nonce>" while RUN's marks are to be rebuilt from
                                       its shipped shards, "done:<nonce>" once they are
Both are kept KEEP seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from genqueue.common import defaults
from genqueue.common.defaults import KEY_PREFIX
from genqueue.common.keepers.runs import run_key

KEEP = defaults.MARKSTAMPS_KEEP


def stamp_key(worker: str) -> str:
    return f"{KEY_PREFIX}:marks_stamp:{worker}"


def state_key(run: str) -> str:
    return run_key(run, "rebuild")


@dataclass(frozen=True, slots=True)
class Look:
    """One look at Redis: its run_id (None when INFO is refused), the stamp it holds of one
    consumer (0 for none), and each run's rebuild state ("" for none)."""

    run_id: str | None
    stamp: int
    states: list[str]


def look(conn: redis.Redis, worker: str, runs: list[str]) -> Look:
    """Redis's run_id, WORKER's stamp and RUNS' rebuild states, in one round trip."""
    with conn.pipeline(transaction=False) as p:
        p.info("server")
        p.get(stamp_key(worker))
        for run in runs:
            p.get(state_key(run))
        # INFO may be refused (a managed Redis's ACL): the run_id only tells the log.
        info, stamp, *states = p.execute(raise_on_error=False)
    for answer in (stamp, *states):
        if isinstance(answer, Exception):
            raise answer
    run_id = None if isinstance(info, Exception) else str(info.get("run_id"))
    return Look(run_id, int(_text(stamp) or 0), [_text(raw) or "" for raw in states])


def mark_pending(conn: redis.Redis, worker: str, runs: list[str], nonce: str, stamp: int) -> None:
    """RUNS' marks are to be rebuilt (state "pending:NONCE"); WORKER's stamp is STAMP again."""
    with conn.pipeline(transaction=False) as p:
        for run in runs:
            p.set(state_key(run), f"pending:{nonce}")
        p.set(stamp_key(worker), stamp, ex=KEEP)
        p.execute()


def rebuild_state(conn: redis.Redis, run: str) -> str:
    """RUN's rebuild state ("" for none)."""
    return _text(conn.get(state_key(run))) or ""


def mark_rebuilt(conn: redis.Redis, run: str, pending: str) -> None:
    """RUN's marks are rebuilt: its state PENDING ("pending:<nonce>") becomes "done:<nonce>"."""
    conn.set(state_key(run), "done:" + pending.removeprefix("pending:"), ex=KEEP)


def forget_state(conn: redis.Redis, run: str) -> None:
    """Drop RUN's rebuild state (the run is gone: re-creating it rebuilds its marks)."""
    conn.delete(state_key(run))


def _text(raw: object) -> str | None:
    return raw.decode() if isinstance(raw, bytes) else None if raw is None else str(raw)
