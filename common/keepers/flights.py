"""The end of a run's offers: what each consumer still holds of it, for an idle one to duplicate.

When a run's queue is empty, an idle consumer can do nothing for the items another consumer
has in flight or waiting, except run them too. Each consumer that holds items of a run at its
end publishes them here (an offer: its rate per request and, per item, its job and how long it
has been in flight, or that it waits unsent); an idle consumer whose engine would finish one
sooner claims it and sends a copy (consumer/copies.py). Whichever answer ships first marks the
item done (common/keepers/marks.py); the other consumer sees the mark and cancels its copy.

Keys:
  genqueue:run:<run>:flights  hash   consumer -> its offer (JSON), refreshed every look while it
                                     holds items at the run's end; the key expires soon after
                                     the last offer, so a dead consumer's offer goes away
  genqueue:run:<run>:hedges   hash   item key -> the consumer that claimed its copy (one copy
                                     per item across the fleet at a time: a copy that ends
                                     without a result gives its claim back, and a consumer no
                                     longer live loses its claims); expires after the run's end
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import orjson

from genqueue.common.keepers.keeper import RUN_KEY, RunKeeper, run_key
from genqueue.common.keepers.runs import CONSUMERS
from genqueue.common.keepers.snapshots import STALE_AFTER

#: Seconds an offer of end-of-run copies counts (refreshed twice a second).
OFFER_TTL = 3.0
#: Seconds the claims of a run's copies are kept after the last claim.
CLAIMS_TTL = 600


@dataclass(frozen=True, slots=True)
class Flight:
    """One item a consumer holds of a run: in flight for AGE seconds, or unsent (AGE None)."""

    job_id: str
    key: str
    age: float | None


@dataclass(frozen=True, slots=True)
class Offer:
    """What consumer WORKER holds of a run, and how fast it answers (output tokens per second
    per request, 0 when it has not measured it yet); AT is when it wrote it (its clock)."""

    worker: str
    rate: float
    at: float
    flights: tuple[Flight, ...]


# Take the claim when it is free, or held by a consumer no longer live (not seen for
# STALE_AFTER seconds of Redis time, or never): a consumer killed while its copies ran would
# otherwise keep their items from every other idle one until the claims expire.
_CLAIM = """
local holder = redis.call('hget', KEYS[1], ARGV[1])
if holder then
  if holder == ARGV[2] then return 0 end
  local seen = redis.call('zscore', KEYS[2], holder)
  local now = redis.call('time')
  if seen and tonumber(seen) >= tonumber(now[1]) - tonumber(ARGV[3]) then return 0 end
end
redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
redis.call('expire', KEYS[1], ARGV[4])
return 1
"""


# The claims held by live consumers other than ARGV[1] (the rule _CLAIM takes them over by).
_CLAIMED_BY_OTHERS = """
local out = {}
local now = tonumber(redis.call('time')[1])
local claims = redis.call('hgetall', KEYS[1])
for i = 1, #claims, 2 do
  local holder = claims[i + 1]
  if holder ~= ARGV[1] then
    local seen = redis.call('zscore', KEYS[2], holder)
    if seen and tonumber(seen) >= now - tonumber(ARGV[2]) then out[#out + 1] = claims[i] end
  end
end
return out
"""


# Compare and delete: a claim is given back only by the consumer that holds it.
_RELEASE = "if redis.call('hget', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('hdel', KEYS[1], ARGV[1]) end return 0"


class Flights(RunKeeper):
    """The end of RUN's offers on CONN: its two keys, the consumers' offers and the copies' claims."""

    key_template = RUN_KEY + ":flights"

    @staticmethod
    def hedges_key(run: str) -> str:
        return run_key(run, "hedges")

    def offer(self, worker: str, rate: float, flights: list[Flight], *, now: float | None = None) -> None:
        """WORKER's offer for the run at NOW (Redis's clock as the consumer reads it,
        common/keepers/clock.py: every reader judges its age by its own; default the local clock).
        An empty FLIGHTS withdraws it."""
        conn, key = self.conn, self.key(self.run)
        if not flights:
            conn.hdel(key, worker)
            return
        body = orjson.dumps({"rate": rate, "at": time.time() if now is None else now,
                             "items": [[f.job_id, f.key, f.age] for f in flights]})
        p = conn.pipeline(transaction=False)
        p.hset(key, worker, body)
        p.pexpire(key, int(OFFER_TTL * 1000))
        p.execute()

    def offers(self, *, now: float | None = None) -> list[Offer]:
        """The current offers for the run at NOW (the clock offer was given; stale and
        unreadable ones left out)."""
        now = time.time() if now is None else now
        out: list[Offer] = []
        raw: dict[bytes, bytes] = self.conn.hgetall(self.key(self.run))  # type: ignore[assignment]
        for worker, body in raw.items():
            try:
                d = orjson.loads(body)
                at, rate = float(d["at"]), float(d["rate"])
                flights = tuple(Flight(str(j), str(k), None if a is None else float(a)) for j, k, a in d["items"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            if now - at > OFFER_TTL:
                continue
            out.append(Offer(worker.decode(errors="replace"), rate, at, flights))
        return out

    def claim(self, item_key: str, worker: str) -> bool:
        """Whether WORKER now holds the one copy of the run's ITEM_KEY (False: another live
        consumer has it, or WORKER already does)."""
        return bool(self.conn.eval(_CLAIM, 2, self.hedges_key(self.run), CONSUMERS, item_key, worker, STALE_AFTER,
                                   CLAIMS_TTL))

    def claimed(self) -> set[str]:
        """The item keys of the run whose copy some consumer has claimed."""
        return {k.decode(errors="replace") for k in self.conn.hkeys(self.hedges_key(self.run))}  # type: ignore[union-attr]

    def claimed_by_others(self, worker: str) -> set[str]:
        """The item keys of the run whose copy a live consumer other than WORKER holds: the items
        waiting at WORKER that another one is copying (a claim of a consumer gone is taken over
        by the next copier, and counts as free here)."""
        keys = self.conn.eval(_CLAIMED_BY_OTHERS, 2, self.hedges_key(self.run), CONSUMERS, worker, STALE_AFTER)
        return {k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in keys or []}

    def release(self, item_key: str, worker: str) -> bool:
        """WORKER gives back its claim on the copy of the run's ITEM_KEY (its copy ended without a
        result, or was never sent), so another consumer may copy the item; a claim another
        consumer holds is left alone. Whether a claim was given back."""
        return bool(self.conn.eval(_RELEASE, 1, self.hedges_key(self.run), item_key, worker))
