"""How much Redis memory an enqueue will take, known before it writes anything.

The input's first records are converted as the enqueue will convert them (nothing is written),
which gives items per input byte and prompt bytes per item; the input's whole size (a plain
file's bytes, a Parquet file's rows) scales that to the whole input; the items the run holds
already are taken off; common/redismem.run_bytes turns items and prompt bytes into Redis bytes
(the per-item figures measured in common/defaults.py). A compressed file or stdin has no size
to scale by: the estimate is then of the records looked at only, and says so.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from genqueue.common import defaults
from genqueue.common.keepers.redismem import Memory, RedisFullError, read_memory, room, run_bytes, size
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.items import Origin, make_items
from genqueue.producer.ingest.reader import RawRecord
from genqueue.producer.ingest.rejects import Rejected

log = logging.getLogger(__name__)

SAMPLE_RECORDS = defaults.MEMPLAN_SAMPLE_RECORDS
SAMPLE_BYTES = defaults.MEMPLAN_SAMPLE_BYTES

_COMPRESSED = (b"\x1f\x8b", b"\x28\xb5\x2f\xfd")
_PARQUET = b"PAR1"


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What the run will take of Redis, against what Redis has."""

    items: int  # items this enqueue is expected to add to the run
    bytes: int  # Redis bytes they take, once done
    whole: bool  # the estimate covers the whole input (False: only the records looked at)
    memory: Memory | None  # INFO memory (None: Redis does not answer INFO, or was not asked)
    asked: bool = True  # False: a dry run, Redis not asked

    @property
    def room(self) -> int | None:
        return room(self.memory) if self.memory is not None else None

    def line(self) -> str:
        est = f"about {size(self.bytes)} for {self.items:,} items" + ("" if self.whole else
                                                                       " (of the records looked at; compressed input)")
        if self.memory is None:
            return f"{est}; Redis's memory " + ("unknown (INFO refused)" if self.asked else "not asked (dry run)")
        if not self.memory.limited:
            return f"{est}; no maxmemory limit (Redis may take all of its host's memory), {size(self.memory.used)} used"
        return f"{est}; {size(self.memory.free or 0)} free of maxmemory {size(self.memory.maxmemory)}"


def sample(records: Iterator[RawRecord]) -> tuple[list[RawRecord], Iterator[RawRecord], bool]:
    """The first records (at most SAMPLE_RECORDS, SAMPLE_BYTES), RECORDS whole again, and
    whether those first records are all of them."""
    head: list[RawRecord] = []
    total = 0
    for rec in records:
        head.append(rec)
        total += rec.size
        if len(head) >= SAMPLE_RECORDS or total >= SAMPLE_BYTES:
            return head, itertools.chain(head, records), False
    return head, iter(head), True


def _input_scale(path: str, head: list[RawRecord], complete: bool) -> float | None:
    """How many times HEAD the whole input is (None: not known, a compressed file or stdin)."""
    if complete:
        return 1.0
    if path == "-" or not head:
        return None
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic == _PARQUET:
            import pyarrow.parquet as pq

            rows: int = pq.ParquetFile(path).metadata.num_rows
            return max(rows / len(head), 1.0)
        if magic.startswith(_COMPRESSED):
            return None
        # a record's bytes, and the newline or comma between records
        return max(os.path.getsize(path) / max(sum(r.size + 1 for r in head), 1), 1.0)
    except (OSError, ValueError, ImportError):
        return None


def plan(path: str, head: list[RawRecord], run: str, settings: RunSettings, origin: Origin | None,
         conn: redis.Redis | None, *, complete: bool = False, by_reference: bool = False) -> MemoryPlan:
    """The Redis memory an enqueue of PATH (its first records HEAD; COMPLETE: all of them) into
    RUN will take. BY_REFERENCE (`--prompts reference`): the jobs hold no prompt text (it goes
    to packs in the output), so only the bytes per item count (an upper bound: 47 B an item
    measured by reference at 1M items of 1-4 KB in jobs of 32, against 120 inline besides the
    prompt)."""
    origin = origin or Origin()
    items = prompt = 0
    for rec in head:
        if rec.error is not None:
            continue
        try:
            made = make_items(normalize(rec.value), settings.multi_turn, rec.index, origin.of(rec.value))
        except (Rejected, ValueError, TypeError, KeyError):  # the enqueue rejects it; nothing of it is queued
            continue
        items += len(made)
        prompt += sum(len(m.get("content") or "") for it in made for m in it["messages"])
    scale = _input_scale(path, head, complete)
    whole = scale is not None
    total = round(items * (scale or 1.0))
    have = RunStore(conn).item_count(run) if conn is not None else 0
    new = max(total - have, 0)
    per_prompt = prompt / items if items else 0.0
    memory = read_memory(conn) if conn is not None else None
    prompt_bytes = 0 if by_reference else round(new * per_prompt)
    return MemoryPlan(new, run_bytes(new, prompt_bytes), whole, memory, asked=conn is not None)


def refuse_unfit(p: MemoryPlan, run: str) -> None:
    """RedisFullError, with the numbers, when the run does not fit under Redis's maxmemory."""
    free = p.room
    if free is None or p.bytes <= free:
        return
    assert p.memory is not None
    raise RedisFullError(
        f"run {run} needs about {size(p.bytes)} of Redis ({p.items:,} items), but Redis has {size(free)} to give "
        f"(used {size(p.memory.used)} of maxmemory {size(p.memory.maxmemory)}, "
        f"{defaults.REDIS_MEMORY_HEADROOM:.0%} kept for the consumers): "
        f"nothing was written; raise maxmemory (`redis-cli CONFIG SET maxmemory ...`), free memory, or enqueue "
        "a smaller input")
