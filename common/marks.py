"""Per-item done marks: which items of a run have a record in a shipped shard.

When a shard is shipped, the keys of the records it holds are added to the run's `done` set
(results) or `failed` set (error records), in one round trip, before any job is acked on it.
A job that runs again (after a crash, a sweep, a requeue) skips the items already marked:
their records are shipped already. The marks are an optimisation over the truth, which stays
in the shipped shards: if they are lost (Redis flushed), nothing breaks, work is only redone.

Keys (16-byte digests of the item keys, as in genqueue:run:<run>:keys):
  genqueue:run:<run>:done     set   items with a result record in a shipped shard
  genqueue:run:<run>:failed   set   items with an error record in a shipped shard

With the marks, in the same script, each item newly marked adds one to its outcome's counter
(`shipped_outcome_<outcome>`, `shipped_failed_<class>` in the run's stats): so the outcomes
`producer status` shows always sum to the items it calls done, at every moment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import orjson
import redis

from genqueue.common.runs import key_digest, run_key
from genqueue.common.storage import ShardStore, read_manifest

log = logging.getLogger(__name__)

#: Digests written per round trip when marks are rebuilt.
REBUILD_BATCH = 10_000


def done_key(run: str) -> str:
    return run_key(run, "done")


def failed_key(run: str) -> str:
    return run_key(run, "failed")


#: Marks the digests in ARGV (digest, counter name, turns, ...) in KEYS[1] (done) or, with
#: KEYS[3] (done) given, KEYS[1] (failed); each newly marked one adds 1 to its counter in KEYS[2]
#: and its regenerated turns to `shipped_turns` (an error record of an item that has a result
#: already counts nowhere).
_MARK = """
local added = 0
for i = 1, #ARGV, 3 do
  if redis.call('SADD', KEYS[1], ARGV[i]) == 1 then
    added = added + 1
    if ARGV[i + 1] ~= '' and (KEYS[3] == nil or redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 0) then
      redis.call('HINCRBY', KEYS[2], ARGV[i + 1], 1)
      if ARGV[i + 2] ~= '0' then
        redis.call('HINCRBY', KEYS[2], 'shipped_turns', ARGV[i + 2])
      end
    end
  end
end
return added
"""


@dataclass(slots=True)
class ShardMarks:
    """The item digests one shard holds, split by record kind, with each one's counter name
    (its outcome or error class; empty when unknown)."""

    done: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    done_kind: list[str] = field(default_factory=list)
    failed_kind: list[str] = field(default_factory=list)
    done_turns: list[int] = field(default_factory=list)

    def add(self, item_key: str, *, error: bool, kind: str = "", turns: int = 0) -> None:
        (self.failed if error else self.done).append(key_digest(item_key))
        (self.failed_kind if error else self.done_kind).append(
            (f"shipped_failed_{kind}" if error else f"shipped_outcome_{kind}") if kind else "")
        if not error:
            self.done_turns.append(turns)


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


def _triples(digests: list[bytes], kinds: list[str], turns: list[int] | None = None) -> list[bytes | str | int]:
    if len(kinds) != len(digests):  # marks built without kinds: nothing to count
        kinds = [""] * len(digests)
    if turns is None or len(turns) != len(digests):
        turns = [0] * len(digests)
    return [x for t in zip(digests, kinds, turns, strict=True) for x in t]


def mark_shipped(conn: redis.Redis, run: str, marks: ShardMarks, *,
                 stamp: tuple[str, int, int] | None = None) -> int | None:
    """Record MARKS of a shipped shard of RUN (one round trip). STAMP (key, value, expiry in
    seconds) is set after the marks: Redis holding the stamp holds the marks written before it.
    Returns the stamp it replaced (0 if none; None without STAMP or with nothing to mark):
    consumer/rewind.py tells by it a Redis that lost writes."""
    if not marks.done and not marks.failed:
        return None
    stats = run_key(run, "stats")
    with conn.pipeline(transaction=False) as p:
        if marks.done:
            p.eval(_MARK, 2, done_key(run), stats, *_triples(marks.done, marks.done_kind, marks.done_turns))
        if marks.failed:
            p.eval(_MARK, 3, failed_key(run), stats, done_key(run), *_triples(marks.failed, marks.failed_kind))
        if stamp is not None:
            p.set(stamp[0], stamp[1], ex=stamp[2], get=True)
        out = p.execute()
    return int(out[-1] or 0) if stamp is not None else None


class Mark(StrEnum):
    DONE = "done"
    FAILED = "failed"


def marks_of(conn: redis.Redis, run: str, item_keys: list[str]) -> list[Mark | None]:
    """For each item key, whether a shipped shard already holds its result (DONE), only an
    error record (FAILED), or nothing (None). One round trip."""
    if not item_keys:
        return []
    digests = [key_digest(k) for k in item_keys]
    with conn.pipeline(transaction=False) as p:
        p.smismember(done_key(run), digests)
        p.smismember(failed_key(run), digests)
        done, failed = p.execute()
    return [Mark.DONE if d else Mark.FAILED if f else None for d, f in zip(done, failed, strict=True)]


# --- after a Redis loss (or a rewind): the marks, from the shipped shards -------------------
@dataclass(slots=True)
class Rebuilt:
    """What rebuild_marks read."""

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


def rebuild_marks(conn: redis.Redis, run: str, store: ShardStore) -> Rebuilt:
    """Rebuild RUN's DONE and FAILED marks, and its keys set, from every record of its shipped
    shards (streamed: memory holds one batch of digests). Idempotent: marks only get added."""
    t0 = time.perf_counter()
    out = Rebuilt()
    done: set[bytes] = set()
    failed: set[bytes] = set()

    def flush() -> None:
        with conn.pipeline(transaction=False) as p:
            for key, digests in ((done_key(run), done), (failed_key(run), failed)):
                if digests:
                    p.sadd(key, *digests)
                    p.sadd(run_key(run, "keys"), *digests)
            p.execute()
        done.clear()
        failed.clear()

    for shard in store.list_shards(run):
        out.shards += 1
        manifest = read_manifest(store, run, shard)
        lines = 0
        with store.open(run, shard.name) as fh:
            for line in fh:
                if not line.strip():
                    continue
                lines += 1
                try:
                    rec = orjson.loads(line)
                    digest = bytes.fromhex(rec["key"])
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                    out.unreadable += 1
                    continue
                out.records += 1
                (failed if "error" in rec else done).add(digest)
                if len(done) + len(failed) >= REBUILD_BATCH:
                    flush()
        if manifest is not None and manifest["records"] != lines:
            log.warning("shard %s holds %d records, its manifest says %d", shard.name, lines, manifest["records"])
    flush()
    with conn.pipeline(transaction=False) as p:
        p.scard(done_key(run))
        p.scard(failed_key(run))
        out.done, out.failed = (int(n) for n in p.execute())
    out.seconds = time.perf_counter() - t0
    return out
