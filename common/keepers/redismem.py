"""Redis memory: the eviction policy genqueue needs, what a run will take, and a full Redis.

genqueue's state lives only in Redis (runs, marks, rq's jobs and registries): a Redis that evicts
keys under memory pressure (any `maxmemory-policy` but `noeviction`) drops run records and jobs
in silence, so `producer enqueue` and every consumer's pre-flight refuse one. The volatile-*
policies evict only keys with a TTL, but rq and genqueue give TTLs to keys that must live while
a run does (job results, claims, worker and run-lock keys, leases' heartbeats): refused too.

A Redis at its `maxmemory` under `noeviction` answers every read and refuses every write that
may grow memory ("OOM command not allowed when used memory > 'maxmemory'"), a MULTI even of
reads. Such a refusal is not applied (a command, a MULTI/EXEC and a script's first write are
refused whole), so the caller may send it again once memory is freed: `is_oom` tells it apart.

Everything here reads what `INFO memory` says (used_memory, maxmemory, maxmemory_policy): a
managed Redis that renames CONFIG still answers INFO. One that forbids even that gets a warning,
not a refusal: genqueue cannot see, and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from genqueue.common.errors import GenqueueError, UserError

#: Bytes of Redis a queued item takes besides its prompt (docs/decisions.md, "Measured tunables").
BYTES_PER_ITEM = 120
#: Bytes of Redis a byte of prompt takes inline: the upper end measured, prose compresses less.
BYTES_PER_PROMPT_BYTE = 0.5
#: Share of maxmemory a new run may not take: leases, snapshots and registries grow with the run.
MEMORY_HEADROOM = 0.1

#: The one policy under which Redis never drops a key to make room.
NOEVICTION = "noeviction"

#: What Redis says when it refuses a write for memory (the error's text, with or without "OOM").
_OOM_TEXT = "used memory > 'maxmemory'"


class RedisEvictsError(UserError):
    """Redis's maxmemory-policy evicts keys: genqueue's runs and jobs would be dropped in silence."""


class RedisFullError(UserError):
    """Redis has not the memory a run needs under its maxmemory: refused before any write."""


class RedisFilledError(GenqueueError):
    """Redis filled up part way through a write (what came before stands); exit status 1."""


@dataclass(frozen=True, slots=True)
class Memory:
    """What INFO memory says."""

    used: int  # used_memory, bytes
    maxmemory: int  # 0: no limit
    policy: str | None  # maxmemory_policy (None: not reported)

    @property
    def limited(self) -> bool:
        return self.maxmemory > 0

    @property
    def free(self) -> int | None:
        """Bytes left under maxmemory (None: no limit)."""
        return max(self.maxmemory - self.used, 0) if self.limited else None

    @property
    def full(self) -> bool:
        return self.limited and self.used >= self.maxmemory


def is_oom(e: BaseException) -> bool:
    """Whether E is Redis refusing a write because it is at its maxmemory (not applied)."""
    if isinstance(e, redis.exceptions.OutOfMemoryError):
        return True
    return isinstance(e, redis.exceptions.ResponseError) and _OOM_TEXT in str(e)


def read_memory(conn: redis.Redis) -> Memory | None:
    """INFO memory's figures; None when this Redis does not answer INFO (a managed one that
    forbids it). The policy, absent from a very old INFO, is asked of CONFIG GET."""
    try:
        info: dict[str, Any] = conn.info("memory")
    except redis.exceptions.ResponseError:
        return None
    policy = info.get("maxmemory_policy")
    if policy is None:
        try:
            policy = (conn.config_get("maxmemory-policy") or {}).get("maxmemory-policy")
        except redis.exceptions.ResponseError:
            policy = None
    return Memory(int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)),
                  str(policy) if policy is not None else None)


def check_policy(conn: redis.Redis, *, warn: Callable[[str], None]) -> Memory | None:
    """Refuse (RedisEvictsError) a Redis whose maxmemory-policy evicts keys; WARN when the
    policy cannot be read. Returns what INFO memory said (None when it could not be read)."""
    mem = read_memory(conn)
    if mem is None or mem.policy is None:
        warn("cannot read Redis's maxmemory-policy (INFO memory and CONFIG GET refused): if it evicts keys, "
             "runs and jobs can vanish; make sure it is noeviction")
        return mem
    if mem.policy != NOEVICTION:
        which = "keys with a TTL (rq and genqueue set TTLs on jobs, claims, locks and workers)" \
            if mem.policy.startswith("volatile-") else "any key (runs and jobs among them)"
        raise RedisEvictsError(
            f"Redis's maxmemory-policy is {mem.policy}: it evicts {which} when memory runs short, losing runs in "
            f"silence; set it to noeviction (`redis-cli CONFIG SET maxmemory-policy noeviction`, and "
            f"`maxmemory-policy noeviction` in redis.conf)")
    return mem


def run_bytes(items: int, prompt_bytes: int) -> int:
    """Redis bytes ITEMS queued items of PROMPT_BYTES prompt text in all take, once done."""
    per_item = BYTES_PER_ITEM
    return int(items * per_item + prompt_bytes * BYTES_PER_PROMPT_BYTE)


def room(mem: Memory) -> int | None:
    """Bytes a new run may take: what is free under maxmemory less the headroom kept for the
    consumers' leases, snapshots and rq's registries (None: no limit)."""
    if not mem.limited:
        return None
    return max(mem.maxmemory - int(mem.maxmemory * MEMORY_HEADROOM) - mem.used, 0)


def size(n: float) -> str:
    """N bytes, for people."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"  # pragma: no cover


def full_line(mem: Memory) -> str:
    """What to say of a full Redis: used against maxmemory."""
    return f"Redis is full: used {size(mem.used)} of maxmemory {size(mem.maxmemory)} (policy {mem.policy})"


def full_now(conn: redis.Redis) -> Memory | None:
    """What INFO memory says when Redis is at its maxmemory; None when it is not (or is silent)."""
    try:
        mem = read_memory(conn)
    except redis.exceptions.RedisError:
        return None
    return mem if mem is not None and mem.full else None


def pipeline_read(conn: redis.Redis, build: Callable[[Any], None], *, raise_on_error: bool = True) -> list[Any]:
    """Run the reads BUILD queues on a pipeline in one MULTI/EXEC (a consistent read); a full
    Redis refuses any MULTI, so then again without one: reads still answer, only writes fail."""
    try:
        with conn.pipeline(transaction=True) as p:
            build(p)
            return list(p.execute(raise_on_error=raise_on_error))
    except redis.exceptions.ResponseError as e:
        if not is_oom(e):
            raise
    with conn.pipeline(transaction=False) as p:
        build(p)
        return list(p.execute(raise_on_error=raise_on_error))
