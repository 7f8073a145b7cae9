"""An export's scratch sets in Redis: the item keys it wrote (seen), and, once it is done, the
run's keys it found no record of (missing), computed by Redis whatever their number.

Keys: genqueue:run:<run>:export:<id>:seen     set  16-byte digests of the keys written
      genqueue:run:<run>:export:<id>:missing  set  the run's keys set minus seen (SDIFFSTORE)
Both expire after TEMP_KEY_TTL, so an export killed midway leaves nothing for long; the export
deletes them when it ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import NamedTuple

import redis

from genqueue.common import defaults
from genqueue.common.keepers.runs import run_key

TEMP_KEY_TTL = defaults.EXPORTSETS_TEMP_KEY_TTL
_SCAN = defaults.EXPORTSETS_SCAN


class ScratchKeys(NamedTuple):
    seen: str
    missing: str


class Coverage(NamedTuple):
    """How the export's seen set compares with the run's keys set."""

    enqueued: int  # the run's items
    seen: int  # keys the export wrote
    missing: int  # the run's items it wrote no record of (now in the missing set)


def scratch_keys(run: str) -> ScratchKeys:
    """A new export's two scratch keys for RUN."""
    seen = run_key(run, f"export:{uuid.uuid4().hex}:seen")
    return ScratchKeys(seen, seen.removesuffix(":seen") + ":missing")


def add(conn: redis.Redis, key: str, digests: list[bytes]) -> None:
    """Add DIGESTS to the scratch set KEY (its lifetime renewed)."""
    with conn.pipeline(transaction=False) as p:
        p.sadd(key, *digests)
        p.expire(key, TEMP_KEY_TTL)
        p.execute()


def members(conn: redis.Redis, key: str, digests: list[bytes]) -> list[bool]:
    """For each of DIGESTS, whether the scratch set KEY holds it."""
    return [bool(x) for x in conn.smismember(key, digests)] if digests else []


def remove(conn: redis.Redis, key: str, digests: list[bytes]) -> None:
    conn.srem(key, *digests)


def each_member(conn: redis.Redis, key: str) -> Iterator[bytes]:
    """Every digest the scratch set KEY holds (in parts: it may hold millions)."""
    for d in conn.sscan_iter(key, count=_SCAN):
        yield bytes(d)


def coverage(conn: redis.Redis, run: str, keys: ScratchKeys) -> Coverage:
    """Fill the missing set of KEYS with RUN's keys the seen set lacks; the three counts."""
    items = run_key(run, "keys")
    enqueued = int(conn.scard(items))
    seen = int(conn.scard(keys.seen))
    missing = int(conn.sdiffstore(keys.missing, [items, keys.seen]))
    conn.expire(keys.missing, TEMP_KEY_TTL)
    return Coverage(enqueued, seen, missing)


def drop(conn: redis.Redis, keys: ScratchKeys) -> None:
    """Delete the export's scratch sets."""
    conn.delete(keys.seen, keys.missing)
