"""Reading a run's rq jobs, whatever Redis holds: good jobs out, bad ones counted and named.

Anything can sit under a run's rq keys (a job put there by hand or by another tool, a pickle,
garbage, a hash without data, an id whose hash is gone, fields rq does not parse, items that are
not items). Every reader of a run's jobs (export, status, the reconcile, delete, the dashboard)
goes through `read_jobs`: it yields the jobs genqueue can use (`RunJob`, its items checked field
by field) and notes every other entry in a `JobScan` (`BadJob`: id, place, reason), which the
command prints and puts in its --json. No caller sees an exception for what Redis holds.

Two depths: HEADERS checks what rq needs to load a job without moving payloads (status, delete);
ITEMS decodes the payload too, its function and every item (export, the reconcile). The header
check runs in Redis (_FAST, one round trip a batch); a field not in the exact shape rq writes is
handed to rq's own Job.restore, which decides. An ended job whose hash rq expired (its TTL) while
its id stays in a registry is EXPIRED, kept apart in `JobScan.expired`, never malformed. A job by
reference (no argument; its pack and block in its `meta`) has its items in a pack: a reader that
passes `items_of` (producer/packitems.py) gets them checked like inline ones; one that does not
gets the job noted, never silently empty. Jobs rq gave up on are rqfailed.py's.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson
import redis
from rq.job import Job, JobStatus

from genqueue.common.contracts import Item
from genqueue.common.errors import JobItemsUnreadableError
from genqueue.common.keepers.rqaccess import (
    REASON_CHARS,
    SERIALIZER,
    TASKS,
    JobPlace,
    PackRef,
    job_reference,
    place_members,
)

log = logging.getLogger(__name__)

#: Jobs read per round trip when a run's jobs are scanned: a few MB at most.
FETCH_BATCH = 500
#: Bad entries a one-line summary names (--json lists them all).
NAMED = 10
_KEY = re.compile(r"^[0-9a-f]{32}$")
_PICKLE = b"\x80"
#: _payload's answer for a payload with no argument: a job by reference, whose meta says the rest.
_BY_REFERENCE = "by reference"

#: Reads the items of a job by reference (a PackRef): raises when its pack cannot be read.
ItemsOf = Callable[[PackRef], list[Item]]

#: The places of jobs rq has ended, whose hashes it expires after their TTL (result_ttl,
#: failure_ttl) while their ids stay until a registry cleanup: an id there without a hash is
#: rq's own expiry, what each means for its items.
EXPIRED_WHY = {
    JobPlace.FINISHED: "finished; rq no longer keeps it (its result TTL passed): its items' marks say done",
    JobPlace.FAILED: "failed; rq no longer keeps it (its failure TTL passed): its items count as missing",
}

# KEYS: job hashes. ARGV[1]: '1' to return each payload; ARGV[2..]: the statuses rq knows.
# Per job two values: 'ok' and its data ('' without ARGV[1]); 'gone' (no hash); 'nothash' and
# the key's type; 'nodata'; or
# 'check': a field is not in the exact shape rq writes it, so Python asks rq's own loader.
# Everything accepted here rq's Job.restore accepts too (its dates, numbers, status, JSON and
# text fields, checked stricter than rq parses them); nothing else is decided here.
_FAST = """
local with_data = ARGV[1] == '1'
local known = {}
for i = 2, #ARGV do known[ARGV[i]] = true end
local dates = {'created_at', 'enqueued_at', 'started_at', 'ended_at', 'last_heartbeat'}
local ints = {'timeout', 'result_ttl', 'failure_ttl', 'ttl', 'number_of_retries', 'retries_left', 'repeats_left',
              'rate_limit_concurrency', 'allow_dependency_failures', 'enqueue_at_front_on_retry'}
local present_ints = {'success_callback_timeout', 'failure_callback_timeout', 'stopped_callback_timeout',
                      'enqueue_at_front'}
local jsons = {'dependency_ids', 'retry_intervals', 'repeat_intervals', 'webhooks'}
local texts = {'worker_name', 'success_callback_name', 'failure_callback_name', 'stopped_callback_name',
               'origin', 'description', 'group_id', 'rate_limit_key', 'dependency_id'}
local mdays = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31}
local function date_ok(v)
  local y, mo, d, h, mi, se = string.match(v, '^(%d%d%d%d)%-(%d%d)%-(%d%d)T(%d%d):(%d%d):(%d%d)%.%d%d%d%d%d%dZ$')
  if not y then
    y, mo, d, h, mi, se = string.match(v, '^(%d%d%d%d)%-(%d%d)%-(%d%d)T(%d%d):(%d%d):(%d%d)Z$')
  end
  if not y then return false end
  y, mo, d = tonumber(y), tonumber(mo), tonumber(d)
  if mo < 1 or mo > 12 or d < 1 or d > mdays[mo] or tonumber(h) > 23 or tonumber(mi) > 59 or tonumber(se) > 59 then
    return false
  end
  local leap = (y % 4 == 0 and y % 100 ~= 0) or y % 400 == 0
  return y >= 1 and not (mo == 2 and d == 29 and not leap)
end
local fields = {'status'}
for _, group in ipairs({dates, ints, present_ints, jsons, texts}) do
  for _, f in ipairs(group) do fields[#fields + 1] = f end
end
local function shape_ok(k)
  local got = redis.call('HMGET', k, unpack(fields))
  local v = {}
  for i, f in ipairs(fields) do v[f] = got[i] end
  local s = v['status']
  if s and s ~= '' and not known[s] then return false end
  for _, f in ipairs(dates) do
    if v[f] and v[f] ~= '' and not date_ok(v[f]) then return false end
  end
  for _, f in ipairs(ints) do
    if v[f] and v[f] ~= '' and not string.match(v[f], '^%d+$') then return false end
  end
  for _, f in ipairs(present_ints) do
    if v[f] and not string.match(v[f], '^%d+$') then return false end
  end
  for _, f in ipairs(jsons) do
    if v[f] and v[f] ~= '' and not (string.match(v[f], '^[%[%]%d, "%w%.:_%-]*$') and pcall(cjson.decode, v[f])) then
      return false
    end
  end
  for _, f in ipairs(texts) do
    if v[f] and string.find(v[f], '[\\128-\\255]') then return false end
  end
  return true
end
local out = {}
for _, k in ipairs(KEYS) do
  local kind = redis.call('TYPE', k).ok
  if kind == 'none' then
    out[#out + 1] = 'gone'; out[#out + 1] = ''
  elseif kind ~= 'hash' then
    out[#out + 1] = 'nothash'; out[#out + 1] = kind
  else
    local data = redis.call('HGET', k, 'data')
    if not data or data == '' then
      out[#out + 1] = 'nodata'; out[#out + 1] = ''
    elseif shape_ok(k) then
      out[#out + 1] = 'ok'; out[#out + 1] = with_data and data or ''
    else
      out[#out + 1] = 'check'; out[#out + 1] = ''
    end
  end
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
    items: list[Item]
    ref: PackRef | None = None  # a job by reference: where its items came from


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
    """The bad entries one command met, each once (by id), in the order met; and apart, the ids
    of ended jobs whose hashes rq expired (EXPIRED_WHY), which are no defect."""

    bad: dict[str, BadJob] = field(default_factory=dict)
    expired: dict[str, JobPlace] = field(default_factory=dict)

    def gone(self, job_id: str, place: JobPlace) -> None:
        """JOB_ID, listed in PLACE, has no hash: expired when PLACE is one rq ends jobs in, else a
        dangling id."""
        if place in EXPIRED_WHY:
            self.expired.setdefault(job_id, place)
        else:
            self.note(job_id, place, "no job hash (a dangling id)")

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
              depth: Depth = Depth.ITEMS, items_of: ItemsOf | None = None) -> Iterator[RunJob]:
    """The usable jobs of RUN in PLACES (ids read in one transaction; a job in two places is
    read once, in the first), a batch of jobs per round trip. Every other entry goes to SCAN.
    ITEMS_OF reads the items of a job by reference (module docstring)."""
    seen: set[str] = set()
    fast = conn.register_script(_FAST)
    args = ["1" if depth is Depth.ITEMS else "0", *(st.value for st in JobStatus)]
    for place, members in place_members(conn, run, list(places)):
        ids: list[str] = []
        for m in members:
            jid = _member_id(m, place, scan)
            if jid is not None and jid not in seen:
                seen.add(jid)
                ids.append(jid)
        for start in range(0, len(ids), FETCH_BATCH):
            batch = ids[start:start + FETCH_BATCH]
            out = fast(keys=[Job.key_for(j) for j in batch], args=args)
            for jid, verdict, data in zip(batch, out[::2], out[1::2], strict=True):
                good = _verdict(conn, jid, place, verdict, data, depth, scan, items_of)
                if good is not None:
                    yield good


def scan_jobs(conn: redis.Redis, run: str, places: Iterable[JobPlace] = tuple(JobPlace), *,
              scan: JobScan | None = None, depth: Depth = Depth.HEADERS) -> JobScan:
    """The bad entries of RUN's PLACES (every place by default), for a command that only names
    them: read_jobs with the good jobs dropped."""
    scan = JobScan() if scan is None else scan
    for _job in read_jobs(conn, run, places, scan=scan, depth=depth):
        pass
    return scan


class JobKind(StrEnum):
    """What one entry of a run's queue or registries is, for a reader that shows it (the dashboard)."""

    USABLE = "usable"  # a genqueue job, inline or by reference
    EXPIRED = "expired"  # an ended job whose hash rq expired (EXPIRED_WHY)
    MALFORMED = "malformed"


#: Why a job whose place is not known (its own page) has no hash.
GONE_WHY = "rq no longer keeps this job: an ended job's hash expires after its TTL"


def job_kind(conn: redis.Redis, job_id: str, place: JobPlace | None = None) -> tuple[JobKind, str]:
    """What the entry JOB_ID of PLACE is, and why when it is not usable (read_jobs' reasons, or
    EXPIRED_WHY). A job by reference is usable: its pack is not read here. Without PLACE (a job's
    own page, which does not know where it is listed), a job without a hash is EXPIRED (GONE_WHY)."""
    scan = JobScan()
    out = conn.register_script(_FAST)(keys=[Job.key_for(job_id)], args=["1", *(s.value for s in JobStatus)])
    if place is None and out[0] == b"gone":
        return JobKind.EXPIRED, GONE_WHY
    _verdict(conn, job_id, place or JobPlace.QUEUED, out[0], out[1], Depth.ITEMS, scan, _pack_not_read)
    if scan.bad:
        return JobKind.MALFORMED, next(iter(scan.bad.values())).reason
    if place is not None and scan.expired:
        return JobKind.EXPIRED, EXPIRED_WHY[place]
    return JobKind.USABLE, ""


def _pack_not_read(ref: PackRef) -> list[Item]:
    """The items of a job by reference for a reader that judges the job, not its pack: none read."""
    return []


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


def _verdict(conn: redis.Redis, jid: str, place: JobPlace, verdict: bytes, data: bytes, depth: Depth,
             scan: JobScan, items_of: ItemsOf | None) -> RunJob | None:
    if verdict == b"gone":
        scan.gone(jid, place)
        return None
    if verdict == b"nothash":
        scan.note(jid, place, f"the job's key is a {data.decode(errors='replace')}, not a hash")
        return None
    if verdict == b"nodata":
        scan.note(jid, place, "the job's hash holds no data")
        return None
    if verdict != b"ok":  # not in the shape rq writes: rq's own loader decides
        raw: dict[bytes, bytes] = conn.hgetall(Job.key_for(jid))  # type: ignore[assignment]  # bytes: no decoding
        if not raw:
            scan.gone(jid, place)
            return None
        if not raw.get(b"data"):
            scan.note(jid, place, "the job's hash holds no data")
            return None
        try:
            Job(jid, connection=conn, serializer=SERIALIZER).restore(raw)
        except Exception as e:  # noqa: BLE001 - whatever rq cannot load is named, not raised
            scan.note(jid, place, f"rq cannot load it ({type(e).__name__}: {str(e)[:120]})")
            return None
        data = raw[b"data"]
    if depth is Depth.HEADERS:
        return RunJob(jid, place, [])
    try:
        data = zlib.decompress(data)
    except zlib.error:
        pass  # rq's own fallback: stored uncompressed
    if data.startswith(_PICKLE):
        scan.note(jid, place, "payload is a pickle; genqueue jobs are JSON")
        return None
    why, items = _payload(data)
    if why == _BY_REFERENCE:
        return _by_reference(conn, jid, place, scan, items_of)
    if why is not None:
        scan.note(jid, place, why)
        return None
    return RunJob(jid, place, items)


def _by_reference(conn: redis.Redis, jid: str, place: JobPlace, scan: JobScan,
                  items_of: ItemsOf | None) -> RunJob | None:
    """The job JID with no argument: its reference from its meta, and its items through ITEMS_OF."""
    raw = conn.hget(Job.key_for(jid), "meta")
    try:
        meta = orjson.loads(raw) if raw else {}
        ref = job_reference([], {}, meta)
    except (orjson.JSONDecodeError, ValueError) as e:
        scan.note(jid, place, str(e)[:REASON_CHARS])
        return None
    if ref is None:
        return None  # not reached: no argument and no keyword is a reference or an error
    if items_of is None:
        scan.note(jid, place, f"a job by reference (pack {ref.pack}, block {ref.block}): its items are in a pack, "
                              "which this reader does not read")
        return None
    try:
        items = items_of(ref)
    except JobItemsUnreadableError as e:  # a reader that goes on without them: noted, never empty
        scan.note(jid, place, f"a job by reference (pack {ref.pack}, block {ref.block}): {e}"[:REASON_CHARS])
        return None
    for n, item in enumerate(items):
        why = item_defect(item)
        if why is not None:
            scan.note(jid, place, f"item {n} of pack {ref.pack} block {ref.block}: {why}")
            return None
    return RunJob(jid, place, items, ref)


def _payload(data: bytes) -> tuple[str | None, list[Item]]:
    """(None, items) of a genqueue payload, or (why not, [])."""
    try:
        decoded = orjson.loads(data)
    except orjson.JSONDecodeError:
        return "payload is not JSON (compressed or not)", []
    if not isinstance(decoded, list) or len(decoded) != 4:
        return "payload is not rq's [function, instance, args, kwargs]", []
    func, _instance, args, kwargs = decoded
    if not isinstance(func, str) or func not in TASKS:
        return f"names {str(func)[:80]!r}, not genqueue's task", []
    if kwargs:
        return "has keyword arguments; genqueue jobs carry one list of items", []
    if isinstance(args, list) and not args:
        return _BY_REFERENCE, []
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
