"""A producer's claim sets after the claim: put into jobs, taken over, dropped.

A claim set (`genqueue:run:<run>:claim:<id>`, common/keepers/runs.py) names the items one producer
claimed and has not yet put in jobs. It is made by the claim script (`RunStore.claim`, or the
re-claim of common/keepers/marks.py) and ends one of three ways, all written here:

- `enqueue_claimed`: the transaction that enqueues the claimed items' jobs deletes the claim
  set in the same MULTI/EXEC, so its absence proves the jobs are in (producer/jobwriter.py);
- `take_over`: a claim set older than CLAIM_GRACE was left by a producer that died between its
  claim and its transaction; the reconcile deletes it and queues its items (producer/reconcile.py);
- `drop_claim`: a re-claim that did not end in its transaction is dropped (it expires anyway).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import redis
from rq import Queue
from rq.queue import EnqueueData

from genqueue.common.keepers.runs import claim_key, lock_key


@dataclass(frozen=True, slots=True)
class Claim:
    """A claim set of some producer, as the reconcile found it."""

    id: str
    key: str
    ttl: int  # seconds left (>= 0)


def other_claims(conn: redis.Redis, run: str, own_prefix: str) -> Iterator[Claim]:
    """RUN's claim sets whose id does not start with OWN_PREFIX (this producer's own), with their
    TTL; a set gone meanwhile, or without a TTL (not one of genqueue's), is left out."""
    prefix = claim_key(run, "")
    for raw in conn.scan_iter(match=prefix + "*", count=10_000):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        if key[len(prefix):].startswith(own_prefix):
            continue
        ttl = conn.ttl(key)
        if ttl < 0:  # gone meanwhile (-2), or no TTL (-1: not one of ours)
            continue
        yield Claim(key[len(prefix):], key, int(ttl))


def take_over(conn: redis.Redis, claim: Claim) -> int | None:
    """Delete CLAIM (atomically with counting it); how many items it held, None when another
    producer deleted it first."""
    with conn.pipeline(transaction=True) as p:
        p.scard(claim.key)
        p.delete(claim.key)
        n, deleted = p.execute()
    return int(n) if deleted else None


def claim_members(conn: redis.Redis, claim: Claim) -> list[bytes]:
    """The digests CLAIM holds."""
    return [d for d in conn.smembers(claim.key) if isinstance(d, bytes)]


def claim_exists(conn: redis.Redis, run: str, claim_id: str) -> bool:
    return bool(conn.exists(claim_key(run, claim_id)))


def drop_claim(conn: redis.Redis, run: str, claim_id: str) -> None:
    conn.delete(claim_key(run, claim_id))


def enqueue_claimed(conn: redis.Redis, queue: Queue, jobs: Sequence[EnqueueData], run: str, claim_id: str, *,
                    token: str | None = None) -> bool:
    """Enqueue JOBS (made of the items claim CLAIM_ID holds) and delete the claim set, in one
    MULTI/EXEC WATCHing the claim set; fenced by TOKEN, the run's lock too, which must still
    hold it. Returns False, enqueueing nothing, when the lock no longer holds TOKEN. Raises
    WatchError, ConnectionError or TimeoutError when the transaction may not have landed (the
    claim set, absent, says it did)."""
    ckey = claim_key(run, claim_id)
    # WATCH: should the client be set to retry (a URL option, another default), redis-py raises
    # instead of re-sending a transaction whose reply it lost, which would queue every job twice.
    with conn.pipeline(transaction=True) as pipe:
        if token is not None:
            pipe.watch(ckey, lock_key(run))  # type: ignore[no-untyped-call]
            if _text(pipe.get(lock_key(run))) != token:
                return False
        else:
            pipe.watch(ckey)  # type: ignore[no-untyped-call]
        pipe.multi()
        queue.enqueue_many(jobs, pipeline=pipe)
        pipe.delete(ckey)
        pipe.execute()
    return True


def _text(value: object) -> str | None:
    return None if value is None else value.decode() if isinstance(value, bytes) else str(value)
