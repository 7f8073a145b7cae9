"""A run's claim sets: every write to them is here (one keeper, as rq keeps one class per registry).

A claim set (`genqueue:run:<run>:claim:<id>`) names the items one producer claimed and has not
yet put in jobs. It is made by the claim script (`Claims.claim`) or the re-claim script
(`Claims.reclaim`, the producer's requeue), and ends one of four ways, all written here:

- `Claims.enqueue`: the transaction that enqueues the claimed items' jobs deletes the claim set
  in the same MULTI/EXEC, so its absence proves the jobs are in (producer/enqueue/jobwriter.py);
- `Claims.take_over`: a claim set older than CLAIM_GRACE was left by a producer that died between
  its claim and its transaction; the reconcile deletes it and queues its items (producer/enqueue/reconcile.py);
- `Claims.release`: a claim whose items could not be enqueued gives them back to the run;
- `Claims.drop`: a re-claim that did not end in its transaction is dropped (it expires anyway).

No other module builds a claim key (tests/test_redis_owners.py holds that).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

import redis
from redis.client import Pipeline
from rq import Queue
from rq.queue import EnqueueData

from genqueue.common.eta import format_duration
from genqueue.common.keepers.itemlayout import LUA_ITEMS, MOVED, PACK_SLOTS
from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.rqaccess import drained, queue_name
from genqueue.common.keepers.runlock import RunLock
from genqueue.common.keepers.runs import LUA_CALL_IN_PARTS, RunLockedError
from genqueue.common.retryhint import enqueue_again_command

#: A crashed producer's claim set expires after this long: time for a reconcile to find its items.
CLAIM_TTL = 7 * 24 * 3600
#: A claim set older than this is a dead producer's (a live one enqueues within milliseconds): a reconcile takes it.
CLAIM_GRACE = 600
#: Keys per SCAN when a reconcile looks for other producers' claim sets.
_SCAN = 10_000


def claim_key(run: str, claim_id: str) -> str:
    """The key of claim CLAIM_ID's set in RUN (built here only)."""
    return run_key(run, f"claim:{claim_id}")


@dataclass(frozen=True, slots=True)
class Claim:
    """A claim set of some producer, as the reconcile found it."""

    id: str
    key: str
    ttl: int  # seconds left (>= 0)

    @property
    def age(self) -> int:
        """Seconds since it was made (its TTL is set once, to CLAIM_TTL)."""
        return max(CLAIM_TTL - self.ttl, 0)


@dataclass(frozen=True, slots=True)
class HeldClaims:
    """A run's claim sets at one moment (`Claims.held`): CLAIMS sets holding ITEMS items claimed
    and in no job yet, the oldest OLDEST_S seconds old; STALE of them older than CLAIM_GRACE,
    left by a producer that stopped between its claim and its transaction (the next reconcile
    of the run takes them over and queues their items)."""

    claims: int = 0
    items: int = 0
    oldest_s: int = 0
    stale: int = 0

    def line(self, again: str | None = None) -> str:
        """What they mean for the user, in one line; AGAIN: the enqueue that takes them over
        (None: "the run's next `producer enqueue`")."""
        what = f"{self.items:,} items in {self.claims:,} claim(s) of a producer, in no job yet"
        command = f"`{again}`" if again else "the run's next `producer enqueue`"
        if self.stale:
            return (f"{what}: it stopped between claiming them and queueing them ({format_duration(self.oldest_s)} "
                    f"ago); {command} takes them over and queues them")
        return (f"{what} (the oldest {format_duration(self.oldest_s)} old): an enqueue still running queues them; "
                f"if it was stopped, {command} from {format_duration(CLAIM_GRACE - self.oldest_s)} on "
                "takes them over and queues them")


class Requeue(IntEnum):
    """What a re-queue did with one item (the re-claim script's answer)."""

    SKIPPED = 0  # not in the run any more, or repeated in the slice
    QUEUED = 1  # this producer put it in a job
    DONE = 2  # a shipped shard holds its result by now
    FAILED = 3  # it has an error record and failed items are not retried


# The claim's and the re-claim's start: the digests from ARGV[FIRST] on (nil when a pack, PACK
# > 0, cannot hold them all: TOO_MANY), and which of them the claim set KEYS[2] holds already
# (an earlier send of the same script: their entries hold their places).
_LUA_SLICE = LUA_CALL_IN_PARTS + LUA_ITEMS + """
local TOO_MANY = 'a pack holds """ + str(PACK_SLOTS) + """ items at most'
local function slice_of(first, pack)
  local digests = {}
  for i = first, #ARGV do digests[#digests + 1] = ARGV[i] end
  if pack > 0 and #digests > """ + str(PACK_SLOTS) + """ then return nil, nil end
  local mine = {}
  if redis.call('EXISTS', KEYS[2]) == 1 then mine = call('SMISMEMBER', KEYS[2], digests) end
  return digests, mine
end
"""

#: The error the re-claim script answers when the caller's token no longer holds the lock.
LOCK_LOST = "GENQUEUE_LOCK_LOST"

# KEYS: the run's item table, this re-claim's claim set, the lock. ARGV: the claim set's TTL,
# the lock token, 1 to take items with an error record, the pack number the items go in (0:
# inline), the digests. Refused, before any write, unless the lock holds the token. A digest is
# this re-claim's (1) when an earlier send of it took it, or when it is in the run, not done and
# (unless retried) not failed; else 0 (not in the run, or repeated), 2 (done) or 3 (failed).
# Answers {codes, slots}: by reference each item taken gets a slot of the pack as the claim
# gives them (an earlier send's kept), and its entry is moved there with its state; the pack it
# leaves is noted in the table's hash (`moved:<pack>`), so a shard of that pack's jobs marks
# its items by their entries, not by its slots.
_RECLAIM = """
if redis.call('GET', KEYS[3]) ~= ARGV[2] then
  return redis.error_reply('""" + LOCK_LOST + """')
end
""" + _LUA_SLICE + """local tab = items_table(KEYS[1], false)
local pack = tonumber(ARGV[4]) or 0
local digests, mine = slice_of(5, pack)
if not digests then return redis.error_reply(TOO_MANY) end
preload(tab, digests)
local out, slots, add, seen, nxt = {}, {}, {}, {}, 0
if pack > 0 then
  for i, d in ipairs(digests) do
    if mine[i] == 1 then
      local v = entry_get(tab, bucket_of(tab, d), d)
      local _, sl = place_of(v)
      if sl + 1 > nxt then nxt = sl + 1 end
    end
  end
end
for i, d in ipairs(digests) do
  local code, slot = 0, 0
  local st = state_of(tab, d)
  if seen[d] then
    code = 0
  elseif mine[i] == 1 then
    code, slot = 1, 1
    if pack > 0 then
      local _, sl = place_of(entry_get(tab, bucket_of(tab, d), d))
      slot = sl + 1
    end
  elseif bit.band(st, 1) == 0 then
    code = 0
  elseif bit.band(st, 2) ~= 0 then
    code = 2
  elseif bit.band(st, 4) ~= 0 and ARGV[3] ~= '1' then
    code = 3
  else
    code, slot = 1, 1
    add[#add + 1] = d
    if pack > 0 then
      local k = bucket_of(tab, d)
      local v = entry_get(tab, k, d)
      if v >= 8 then
        local p = place_of(v)
        if p ~= pack then redis.call('HSET', tab.key, '""" + MOVED + """' .. p, 1) end
      end
      entry_set(tab, k, d, placed_value(pack, nxt))
      set_state_at(tab, pack, nxt, st)
      slot = nxt + 1
      nxt = nxt + 1
    end
  end
  seen[d] = true
  out[i] = code
  slots[i] = slot
end
flush(tab)
if pack > 0 and nxt > 0 then placing(tab, pack) end
if #add > 0 then call('SADD', KEYS[2], add) end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return {out, slots}
"""


class ReclaimLockLostError(redis.exceptions.ResponseError):
    """The re-claim was refused before any write: the caller's token no longer holds the lock."""


class Reclaim:
    """The re-claim script of one connection: puts items of a run that are still without a
    result (and, unless retried, without an error record) in a claim set, fenced by the lock."""

    def __init__(self, conn: redis.Redis) -> None:
        self._script = conn.register_script(_RECLAIM)

    def __call__(self, run: str, claim_id: str, *, ttl: int, token: str, retry_failed: bool,
                 digests: list[bytes], pack: int = 0) -> tuple[list[Requeue], list[int]]:
        """What became of each digest, and the slot of PACK each one taken has (0 inline), -1
        for the others (one round trip, safe to send twice). Raises
        ReclaimLockLostError, writing nothing, when the lock no longer holds TOKEN."""
        keys = [ItemTable.key(run), claim_key(run, claim_id), RunLock.key(run)]
        try:
            codes, slots = self._script(keys=keys, args=[ttl, token, int(retry_failed), pack, *digests])
        except redis.exceptions.ResponseError as e:
            if str(e).startswith(LOCK_LOST):
                raise ReclaimLockLostError(*e.args) from e
            raise
        return [Requeue(int(c)) for c in codes], [int(x) - 1 for x in slots]


#: The error the claim script answers while another producer holds the run's lock.
LOCKED = "GENQUEUE_LOCKED"

# KEYS: the run's item table, the claim set, the run's lock. ARGV: the claim set's TTL, the
# caller's lock token ('' for none), the pack number the items go in (0: inline, no pack), then
# the digests. Refused, before any write, while the lock is held by another token. A digest is
# this claim's when it was not in the run (then it is put in the run, IN_RUN, and in the claim
# set), or when an earlier send of this script claimed it. The answer, a digest: 0 when not this
# claim's, else its slot in the pack + 1 (1 inline): the slots this claim wins are 0, 1, ... in
# the digests' order, an earlier send's kept (their entries hold them) and new ones after them.
# The claim set is written with whole-list commands, in parts of 4096 (Lua's unpack limit); the
# table's buckets the slice touches are read with one MGET and written with one MSET (a table an
# earlier genqueue made, a hash a bucket: an entry at a time).
_CLAIM = """
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[2] then
  return redis.error_reply('GENQUEUE_LOCKED ' .. holder)
end
""" + _LUA_SLICE + """local tab = items_table(KEYS[1], true)
local pack = tonumber(ARGV[3]) or 0
local digests, mine = slice_of(4, pack)
if not digests then return redis.error_reply(TOO_MANY) end
preload(tab, digests)
local won, new, seen, nxt = {}, {}, {}, 0
for j, d in ipairs(digests) do
  won[j] = 0
  if mine[j] == 1 and not seen[d] then
    won[j] = 1
    if pack > 0 then
      local v = entry_get(tab, bucket_of(tab, d), d)
      local _, sl = place_of(v)
      won[j] = sl + 1
      if sl + 1 > nxt then nxt = sl + 1 end
    end
  end
  seen[d] = seen[d] or mine[j] == 1
end
for j, d in ipairs(digests) do
  if not seen[d] then
    seen[d] = true
    local pv = nil
    if pack > 0 then pv = placed_value(pack, nxt) end
    if bit.band(add_in_run(tab, d, pv), 1) == 0 then
      new[#new + 1] = d
      won[j] = 1
      if pack > 0 then
        won[j] = nxt + 1
        nxt = nxt + 1
      end
    end
  end
end
flush(tab)
if pack > 0 and nxt > 0 then placing(tab, pack) end
if #new > 0 then call('SADD', KEYS[2], new) end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return won
"""

# KEYS: the run's item table, the claim set. Takes the claimed digests out of the run again.
_RELEASE = LUA_ITEMS + """
local tab = items_table(KEYS[1], true)
local held = redis.call('SMEMBERS', KEYS[2])
preload(tab, held)
for _, d in ipairs(held) do change(tab, d, 0, 1) end
flush(tab)
redis.call('DEL', KEYS[2])
return #held
"""


class Claims:
    """The claim sets of runs on one connection: their keys, the scripts that write them, and
    every other write."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._claim = conn.register_script(_CLAIM)
        self._release = conn.register_script(_RELEASE)
        self._release_full = conn.register_script("#!lua flags=allow-oom\n" + _RELEASE)
        self._reclaim = Reclaim(conn)

    def claim(self, run: str, claim_id: str, digests: list[bytes], token: str | None = None) -> list[bool]:
        """Claim items for one producer: for each digest, True when it is this claim's (added to
        the run's keys now, or by an earlier send of this same claim), False when another
        producer or an earlier enqueue has it, or when it repeats a digest earlier in DIGESTS.
        Atomic, and safe to send twice. Raises RunLockedError, claiming nothing, while a producer
        other than the holder of TOKEN holds the run's lock."""
        return [x >= 0 for x in self.claim_slots(run, claim_id, digests, token=token)]

    def claim_slots(self, run: str, claim_id: str, digests: list[bytes], *, token: str | None = None,
                    pack: int = 0) -> list[int]:
        """`claim`, placing what it wins in pack number PACK (by reference; 0: inline): for each
        digest, its slot in the pack when it is this claim's (0, 1, ... in DIGESTS' order; 0
        inline), -1 when not. At most PACK_SLOTS digests with a pack."""
        if not digests:
            return []
        try:
            won = self._claim(keys=[ItemTable.key(run), claim_key(run, claim_id), RunLock.key(run)],
                              args=[CLAIM_TTL, token or "", pack, *digests])
        except redis.exceptions.ResponseError as e:
            if str(e).startswith(LOCKED):
                raise RunLockedError(str(e)[len(LOCKED):].strip()) from None
            raise
        return [int(x) - 1 for x in won]

    def release(self, run: str, claim_id: str) -> int:
        """Give back what a claim holds, when its items could not be enqueued (an error, Ctrl-C):
        a later enqueue queues them. Returns how many items it held. A full Redis (used memory
        past maxmemory, which a claim's own writes can take it to) refuses a script that writes;
        the release only frees memory, so it is sent again allowed to run then (Redis 7's
        `allow-oom`): left unreleased, the claim's items would sit in the run and in no job until
        a reconcile after CLAIM_GRACE, and the enqueue run again at once would count them queued."""
        keys = [ItemTable.key(run), claim_key(run, claim_id)]
        try:
            return int(self._release(keys=keys))
        except redis.exceptions.OutOfMemoryError:
            return int(self._release_full(keys=keys))

    def reclaim(self, run: str, claim_id: str, *, ttl: int, token: str, retry_failed: bool,
                digests: list[bytes], pack: int = 0) -> tuple[list[Requeue], list[int]]:
        """The re-claim script (Reclaim): what became of each digest, and its slot in PACK."""
        return self._reclaim(run, claim_id, ttl=ttl, token=token, retry_failed=retry_failed, digests=digests,
                             pack=pack)

    def others(self, run: str, own_prefix: str | None) -> Iterator[Claim]:
        """RUN's claim sets whose id does not start with OWN_PREFIX (this producer's own; None:
        every one), with their TTL; a set gone meanwhile, and a key without a TTL or not a set
        (not one of genqueue's: its readers would fail on it), is left out. A SCAN of the whole
        keyspace: not for every poll."""
        conn = self.conn
        prefix = claim_key(run, "")
        for raw in conn.scan_iter(match=prefix + "*", count=_SCAN):
            key = raw.decode() if isinstance(raw, bytes) else str(raw)
            if own_prefix is not None and key[len(prefix):].startswith(own_prefix):
                continue
            ttl = conn.ttl(key)
            if ttl < 0 or _text(conn.type(key)) != "set":  # gone meanwhile (-2), no TTL (-1) or no set: not one of ours
                continue
            yield Claim(key[len(prefix):], key, int(ttl))

    def held(self, run: str) -> HeldClaims:
        """What RUN's claim sets hold now: items claimed by a producer and in no job yet."""
        claims = items = oldest = stale = 0
        for claim in self.others(run, None):
            n = int(self.conn.scard(claim.key))
            if not n:
                continue
            claims, items, oldest = claims + 1, items + n, max(oldest, claim.age)
            stale += claim.age > CLAIM_GRACE
        return HeldClaims(claims, items, oldest, stale)

    def take_over(self, claim: Claim) -> int | None:
        """Delete CLAIM (atomically with counting it); how many items it held, None when another
        producer deleted it first."""
        with self.conn.pipeline(transaction=True) as p:
            p.scard(claim.key)
            p.delete(claim.key)
            n, deleted = p.execute()
        return int(n) if deleted else None

    def members(self, claim: Claim) -> list[bytes]:
        """The digests CLAIM holds."""
        return [d for d in self.conn.smembers(claim.key) if isinstance(d, bytes)]

    def exists(self, run: str, claim_id: str) -> bool:
        return bool(self.conn.exists(claim_key(run, claim_id)))

    def drop(self, run: str, claim_id: str) -> None:
        self.conn.delete(claim_key(run, claim_id))

    def enqueue(self, queue: Queue, jobs: Sequence[EnqueueData], run: str, claim_id: str, *,
                token: str | None = None, also: Callable[[Pipeline], None] | None = None) -> bool:
        """Enqueue JOBS (made of the items claim CLAIM_ID holds) and delete the claim set, in one
        MULTI/EXEC WATCHing the claim set; fenced by TOKEN, the run's lock too, which must still
        hold it. Returns False, enqueueing nothing, when the lock no longer holds TOKEN. Raises
        WatchError, ConnectionError or TimeoutError when the transaction may not have landed (the
        claim set, absent, says it did). ALSO queues more writes in the same MULTI (by reference:
        the run's pack table entry that names the jobs' pack, common/keepers/packs.py)."""
        ckey = claim_key(run, claim_id)
        # WATCH: should the client be set to retry (a URL option, another default), redis-py raises
        # instead of re-sending a transaction whose reply it lost, which would queue every job twice.
        with self.conn.pipeline(transaction=True) as pipe:
            if token is not None:
                pipe.watch(ckey, RunLock.key(run))  # type: ignore[no-untyped-call]
                if _text(pipe.get(RunLock.key(run))) != token:
                    return False
            else:
                pipe.watch(ckey)  # type: ignore[no-untyped-call]
            pipe.multi()
            queue.enqueue_many(jobs, pipeline=pipe)
            if also is not None:
                also(pipe)
            pipe.delete(ckey)
            pipe.execute()
        return True


def _text(value: object) -> str | None:
    return None if value is None else value.decode() if isinstance(value, bytes) else str(value)


def stalled_line(conn: redis.Redis, run: str, left: int, sources: Iterable[str]) -> str | None:
    """Why RUN's LEFT items (neither done nor failed) are in no job, and what queues them: a
    producer's claim not queued yet, jobs rq gave up on, else items lost from the queue. None
    while a job of RUN is live (queued, held, waiting in rq): then they may be in it."""
    idle, rq_failed_jobs = drained(conn, run)
    if not idle:
        return None
    held = Claims(conn).held(run)
    again = enqueue_again_command(run, sources)
    if held.items:
        return held.line(again)
    if rq_failed_jobs:
        jobs = f"{rq_failed_jobs:,} job" + ("s" if rq_failed_jobs != 1 else "")
        return (f"{left:,} items are in {jobs} rq gave up on (its failed registry): "
                f"`rq requeue -u \"$REDIS_URL\" -S rq.serializers.JSONSerializer --queue {queue_name(run)} --all` "
                "queues them again")
    return f"{left:,} items are in no job (lost from the queue): `{again}` queues them again"
