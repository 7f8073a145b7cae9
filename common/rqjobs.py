"""Reading a run's rq jobs, whatever Redis holds: good jobs out, bad ones counted and named.

Anything can sit under a run's rq keys: a job put there by hand or by another tool, a pickle,
compressed garbage, a hash without data, an id in a list or registry whose hash is gone, a
date or status rq does not parse, items that are not a list, items that are not objects or
lack fields. Every reader of a run's jobs (export, status, the reconcile, delete, the
dashboard) goes through `read_jobs`: it yields the jobs genqueue can use, typed (`RunJob`, its
items checked field by field), and notes every other entry in a `JobScan` (`BadJob`: id,
place, reason), which the command prints (`N malformed job(s) skipped: <id> (<reason>), ...`)
and puts in its --json. No caller sees an exception for what Redis holds.

Two depths. HEADERS checks what rq needs to load a job (its hash, data, status, dates and
numbers, through rq's own Job.restore) without moving payloads: a Lua script returns each hash
with its data cut to two bytes. ITEMS decodes the payload too (zlib'd JSON; a pickle is named
as one), its function and every item. Status and delete read headers (cheap at every poll of a
million-item run); export and the reconcile read the payloads they need anyway.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson
import redis
from rq.job import Job

from genqueue.common.contracts import Item
from genqueue.common.rqaccess import REASON_CHARS, SERIALIZER, TASKS, JobPlace, job_failure, place_members

log = logging.getLogger(__name__)

_FETCH_BATCH = 500
#: How many bad entries a one-line summary names (the --json lists them all).
NAMED = 10
_KEY = re.compile(r"^[0-9a-f]{32}$")
_PICKLE = b"\x80"

# KEYS: job hashes. Each hash flattened, its data field cut to 2 bytes; {} for a missing hash.
_HEADERS = """
local out = {}
for i, k in ipairs(KEYS) do
  local h = redis.call('HGETALL', k)
  for j = 2, #h, 2 do
    if h[j - 1] == 'data' then h[j] = string.sub(h[j], 1, 2) end
  end
  out[i] = h
end
return out
"""


class Depth(StrEnum):
    HEADERS = "headers"  # what rq needs to load the job; no payload moved
    ITEMS = "items"  # and its payload: function, arguments, every item


@dataclass(frozen=True, slots=True)
class RunJob:
    """A job of the run genqueue can use: where it is, and (at Depth.ITEMS) its checked items."""

    id: str
    place: JobPlace
    job: Job
    items: list[Item]


@dataclass(frozen=True, slots=True)
class BadJob:
    """An entry of a run's queue or registries that is not a usable genqueue job."""

    id: str
    place: JobPlace
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "place": self.place.value, "reason": self.reason}


@dataclass(slots=True)
class JobScan:
    """The bad entries one command met, each once (by id), in the order met."""

    bad: dict[str, BadJob] = field(default_factory=dict)

    def note(self, job_id: str, place: JobPlace, reason: str) -> None:
        if job_id not in self.bad:  # the command prints them in one line; each one on -vv
            log.debug("job %s (%s) skipped: %s", job_id, place.value, reason)
            self.bad[job_id] = BadJob(job_id, place, reason[:REASON_CHARS])

    @property
    def count(self) -> int:
        return len(self.bad)

    def to_list(self) -> list[dict[str, str]]:
        return [b.to_dict() for b in self.bad.values()]

    def line(self, verb: str = "skipped") -> str:
        """`N malformed job(s) skipped: <id> (<reason>), ...`, or "" when there is none."""
        return malformed_line(self.to_list(), verb)


def malformed_line(bad: list[dict[str, str]], verb: str = "skipped") -> str:
    """The one-line summary of BAD (JobScan.to_list()), naming the first NAMED."""
    if not bad:
        return ""
    named = ", ".join(f"{b['id']} ({b['place']}: {b['reason']})" for b in bad[:NAMED])
    more = f", and {len(bad) - NAMED} more (see --json)" if len(bad) > NAMED else ""
    return f"{len(bad)} malformed job(s) {verb}: {named}{more}"


def refused_line(refused: dict[str, str], run: str) -> str:
    """`N refused by consumers: <id> (<reason>), ...; clear them with ...`, or ""."""
    if not refused:
        return ""
    named = ", ".join(f"{j} ({why})" for j, why in list(refused.items())[:NAMED])
    more = f", and {len(refused) - NAMED} more (see --json)" if len(refused) > NAMED else ""
    return (f"{len(refused)} job(s) refused by consumers: {named}{more}; clear them with "
            f"`{CLEAR_REFUSED.format(run=run)}`")


#: The command that clears a run's refused jobs (lifecycle.py's delete --refused-only).
CLEAR_REFUSED = "producer delete --run {run} --refused-only"


def read_jobs(conn: redis.Redis, run: str, places: Iterable[JobPlace], *, scan: JobScan,
              depth: Depth = Depth.ITEMS) -> Iterator[RunJob]:
    """The usable jobs of RUN in PLACES (ids read in one transaction; a job in two places is
    read once, in the first), a batch of jobs per round trip. Every other entry goes to SCAN."""
    seen: set[str] = set()
    headers = conn.register_script(_HEADERS) if depth is Depth.HEADERS else None
    for place, members in place_members(conn, run, list(places)):
        ids: list[str] = []
        for m in members:
            jid = _member_id(m, place, scan)
            if jid is not None and jid not in seen:
                seen.add(jid)
                ids.append(jid)
        for start in range(0, len(ids), _FETCH_BATCH):
            batch = ids[start:start + _FETCH_BATCH]
            if headers is not None:
                raws = [_pairs(h) for h in headers(keys=[Job.key_for(j) for j in batch])]
            else:
                with conn.pipeline(transaction=False) as p:
                    for jid in batch:
                        p.hgetall(Job.key_for(jid))
                    raws = p.execute()
            for jid, raw in zip(batch, raws, strict=True):
                good = _check(conn, jid, place, raw, depth, scan)
                if good is not None:
                    yield good


def job_defect(conn: redis.Redis, job_id: str, place: JobPlace = JobPlace.QUEUED) -> str | None:
    """Why the job JOB_ID is no usable genqueue job (the reasons read_jobs gives), or None."""
    scan = JobScan()
    raw: dict[bytes, bytes] = conn.hgetall(Job.key_for(job_id))  # type: ignore[assignment]  # bytes: no decode_responses
    _check(conn, job_id, place, raw, Depth.ITEMS, scan)
    return next(iter(scan.bad.values())).reason if scan.bad else None


def failed_reason(job: Job) -> str:
    """Why rq gave up on JOB, its last line (rq keeps whole tracebacks); a result stream that
    cannot be read says so instead."""
    try:
        text = job_failure(job) or "failed in rq"
    except Exception as e:  # noqa: BLE001 - a garbage result stream must not hide the job's items
        text = f"failed in rq (its result is unreadable: {type(e).__name__})"
    lines = text.strip().splitlines() or ["failed in rq"]
    return lines[-1][:REASON_CHARS]


# --- checks ------------------------------------------------------------------------------
def _member_id(member: object, place: JobPlace, scan: JobScan) -> str | None:
    try:
        text = member.decode() if isinstance(member, bytes) else str(member)
    except UnicodeDecodeError:
        scan.note(repr(member)[:80], place, "id is not UTF-8 text")
        return None
    if place is JobPlace.STARTED:  # the started registry holds "<job id>:<execution id>"
        text = text.rsplit(":", 1)[0] if ":" in text else text
    if not text:
        scan.note(repr(member)[:80], place, "empty id")
        return None
    return text


def _pairs(flat: Any) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True)) if isinstance(flat, list) else {}


def _check(conn: redis.Redis, jid: str, place: JobPlace, raw: dict[bytes, bytes], depth: Depth,
           scan: JobScan) -> RunJob | None:
    if not raw:
        scan.note(jid, place, "no job hash (a dangling id)")
        return None
    data = raw.get(b"data")
    if not data:
        scan.note(jid, place, "the job's hash holds no data")
        return None
    job = Job(jid, connection=conn, serializer=SERIALIZER)
    try:
        job.restore(raw)
    except Exception as e:  # noqa: BLE001 - rq's own loader decides what it can load
        scan.note(jid, place, f"rq cannot load it ({type(e).__name__}: {str(e)[:120]})")
        return None
    if depth is Depth.HEADERS:
        return RunJob(jid, place, job, [])
    if job.data.startswith(_PICKLE):  # restore() has undone rq's zlib
        scan.note(jid, place, "payload is a pickle; genqueue jobs are JSON")
        return None
    why, items = _payload(job.data)
    if why is not None:
        scan.note(jid, place, why)
        return None
    return RunJob(jid, place, job, items)


def _payload(data: bytes) -> tuple[str | None, list[Item]]:
    """(None, items) of a genqueue payload, or (why not, [])."""
    try:
        decoded = orjson.loads(data)  # restore() has undone the zlib, or kept raw bytes
    except orjson.JSONDecodeError:
        return "payload is not JSON (compressed or not)", []
    if not isinstance(decoded, list) or len(decoded) != 4:
        return "payload is not rq's [function, instance, args, kwargs]", []
    func, _instance, args, kwargs = decoded
    if func not in TASKS:
        return f"names {str(func)[:80]!r}, not genqueue's task", []
    if kwargs:
        return "has keyword arguments; genqueue jobs carry one list of items", []
    if not isinstance(args, list) or len(args) != 1 or not isinstance(args[0], list):
        return "arguments are not a list of items", []
    items = args[0]
    if not items:
        return "carries no items", []
    for n, item in enumerate(items):
        why = item_defect(item)
        if why is not None:
            return f"item {n}: {why}", []
    return None, items


def item_defect(item: Any) -> str | None:
    """Why ITEM is not one the producer's readers can use (the fields export and the reconcile
    read), or None."""
    if not isinstance(item, dict):
        return f"a {type(item).__name__}, not an object"
    key = item.get("key")
    if not isinstance(key, str) or not _KEY.match(key):
        return "key is not 32 hex characters"
    index = item.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        return "index is not a non-negative integer"
    turn = item.get("turn")
    if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool)):
        return "turn is not an integer or null"
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return "messages is not a non-empty list of objects"
    return None
