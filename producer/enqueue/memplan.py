"""How big a run an enqueue makes, known before it writes anything: the Redis memory it will
take, and where its jobs keep their items (`--prompts auto`).

The input's first records are converted as the enqueue will convert them (nothing is written),
which gives items per input byte and prompt bytes per item; the input's whole size (a plain
file's bytes, a Parquet file's rows) scales that to the whole input (`estimate`); the items the
run holds already are taken off; common/keepers/redismem.run_bytes turns items and prompt bytes
into Redis bytes (with the per-item figures measured). A compressed file or stdin has no size
to scale by: the estimate is then of the records looked at only, and says so.

`choose_prompts`: `--prompts inline|reference` is taken as given; `auto` (the default) keeps
the mode of a run that has one (an earlier enqueue's: its pack table, its sources' summaries,
or its run.json when Redis lost it), and otherwise queues by reference from
PROMPTS_REFERENCE_FROM items of the input's estimate, inline below it or when the size is not
known (stdin, a compressed file not read whole).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import redis

from genqueue.common import defaults
from genqueue.common.contracts import PromptMode
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.redismem import MEMORY_HEADROOM, Memory, RedisFullError, read_memory, room, run_bytes, size
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.common.storage.runfile import RunFile
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.items import Origin, make_items
from genqueue.producer.ingest.prefill import prefill_chars, prefill_item
from genqueue.producer.ingest.reader import RawRecord
from genqueue.producer.ingest.rejects import Rejected

log = logging.getLogger(__name__)

#: Records looked at for the memory estimate: a stable mean, a moment to convert.
SAMPLE_RECORDS = 4096
#: Bytes of input looked at for it at most.
SAMPLE_BYTES = 16 << 20

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
    by_reference: bool = False  # the jobs hold no prompt text (bytes counts none)

    @property
    def room(self) -> int | None:
        return room(self.memory) if self.memory is not None else None

    def fits(self) -> bool:
        """Whether the run fits Redis's room (True when Redis has no limit or was not asked)."""
        free = self.room
        return free is None or self.bytes <= free

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


@dataclass(frozen=True, slots=True)
class Estimate:
    """The items the whole input makes, from its first records."""

    items: int  # of the whole input (whole), or of the records looked at only
    prompt_chars: float  # prompt characters an item, on average
    whole: bool  # the estimate covers the whole input (False: stdin or a compressed file, not read whole)


def estimate(path: str, head: list[RawRecord], settings: RunSettings, origin: Origin | None, *,
             complete: bool = False) -> Estimate:
    """The items PATH (its first records HEAD; COMPLETE: all of them) makes under SETTINGS."""
    origin = origin or Origin()
    items = prompt = 0
    for rec in head:
        if rec.error is not None:
            continue
        try:
            made = ([prefill_item(rec.value, rec.index, origin.of(rec.value))] if settings.prefill is not None
                    else make_items(normalize(rec.value), settings.multi_turn, rec.index, origin.of(rec.value)))
        except (Rejected, ValueError, TypeError, KeyError):  # the enqueue rejects it; nothing of it is queued
            continue
        items += len(made)
        prompt += sum(len(m.get("content") or "") for it in made for m in it["messages"])
        prompt += sum(prefill_chars(it) for it in made)
    scale = _input_scale(path, head, complete)
    return Estimate(round(items * (scale or 1.0)), prompt / items if items else 0.0, scale is not None)


def plan(path: str, head: list[RawRecord], run: str, settings: RunSettings, origin: Origin | None,
         conn: redis.Redis | None, *, complete: bool = False, by_reference: bool = False,
         est: Estimate | None = None) -> MemoryPlan:
    """The Redis memory an enqueue of PATH (its first records HEAD; COMPLETE: all of them) into
    RUN will take (EST: its estimate, when made already). BY_REFERENCE (`--prompts reference`):
    the jobs hold no prompt text (it goes to packs in the output), so only the bytes per item
    count (an upper bound: 47 B an item measured by reference at 1M items of 1-4 KB in jobs of
    32, against 120 inline besides the prompt)."""
    if est is None:
        est = estimate(path, head, settings, origin, complete=complete)
    have = RunStore(conn).item_count(run) if conn is not None else 0
    new = max(est.items - have, 0)
    memory = read_memory(conn) if conn is not None else None
    prompt_bytes = 0 if by_reference else round(new * est.prompt_chars)
    return MemoryPlan(new, run_bytes(new, prompt_bytes), est.whole, memory, asked=conn is not None,
                      by_reference=by_reference)


class PromptsAsked(StrEnum):
    """What `producer enqueue --prompts` asks for: a mode, or auto (choose_prompts)."""

    AUTO = "auto"
    INLINE = "inline"
    REFERENCE = "reference"


class PromptsReason(StrEnum):
    """Why an enqueue's jobs keep their items where they do (`prompts_choice.reason` in --json)."""

    GIVEN = "given"  # --prompts inline|reference
    RUN = "run"  # auto: the run's own mode, which an earlier enqueue of it chose
    SIZE = "size"  # auto: the input's estimated items against PROMPTS_REFERENCE_FROM
    SIZE_UNKNOWN = "size_unknown"  # auto: stdin or a compressed file, its size not known: inline
    ROOM = "room"  # auto: inline would not fit Redis's room (maxmemory less what it holds); by reference it does
    EXPECTED = "expected"  # auto: the run's items as --expect-items says (a run fed in parts) against PROMPTS_REFERENCE_FROM


@dataclass(frozen=True, slots=True)
class PromptsChoice:
    """Where this enqueue's jobs keep their items, and why."""

    mode: PromptMode
    asked: PromptsAsked
    reason: PromptsReason
    estimated_items: int | None  # the input's items as auto estimated them (None: not estimated)
    reference_from: int  # auto's threshold (PROMPTS_REFERENCE_FROM, or --prompts-reference-from)
    inline_bytes: int | None = None  # ROOM: the Redis inline would take
    room: int | None = None  # ROOM: what Redis has to give
    expected_items: int | None = None  # EXPECTED: the run's items, all its parts, as --expect-items said

    def for_room(self, inline: MemoryPlan) -> PromptsChoice:
        """By reference instead of inline, since INLINE does not fit Redis's room."""
        return replace(self, mode=PromptMode.REFERENCE, reason=PromptsReason.ROOM, inline_bytes=inline.bytes,
                       room=inline.room)

    def why(self) -> str:
        """For people: `auto: ~1,200,000 items >= 200,000`."""
        if self.reason is PromptsReason.GIVEN:
            return f"--prompts {self.asked.value}"
        if self.reason is PromptsReason.RUN:
            how = "by reference" if self.mode is PromptMode.REFERENCE else "inline"
            return f"auto: the run's mode, kept (an earlier enqueue queued it {how})"
        if self.reason is PromptsReason.ROOM:
            return (f"auto: inline needs about {size(self.inline_bytes or 0)} of Redis, more than the "
                    f"{size(self.room or 0)} it has to give (~{self.estimated_items or 0:,} items): by reference")
        if self.reason is PromptsReason.EXPECTED:
            rel = ">=" if self.mode is PromptMode.REFERENCE else "<"
            return (f"auto: the run is expected to hold {self.expected_items or 0:,} items (--expect-items) {rel} "
                    f"{self.reference_from:,}")
        if self.reason is PromptsReason.SIZE_UNKNOWN:
            return (f"auto: the input's size is not known (stdin or compressed; ~{self.estimated_items or 0:,} items "
                    "in the records looked at): inline unless --prompts reference")
        rel = ">=" if self.mode is PromptMode.REFERENCE else "<"
        return f"auto: ~{self.estimated_items or 0:,} items {rel} {self.reference_from:,}"

    def fields(self) -> dict[str, Any]:
        """For --json (`prompts_choice`)."""
        out = {"asked": self.asked.value, "reason": self.reason.value, "estimated_items": self.estimated_items,
               "reference_from": self.reference_from, "why": self.why()}
        return out if self.expected_items is None else {**out, "expected_items": self.expected_items}


class BatchReason(StrEnum):
    """Why an enqueue's jobs hold as many items as they do (`batch_choice.reason` in --json)."""

    GIVEN = "given"  # --batch-size
    INLINE = "inline"  # BATCH_SIZE: an inline job carries its items, kept small
    REFERENCE = "reference"  # BATCH_SIZE_REFERENCE: by reference, a run of unknown or modest size
    RUN_SIZE = "run_size"  # by reference, grown with the run's items while it keeps JOBS_PER_RUN_MIN jobs


@dataclass(frozen=True, slots=True)
class BatchChoice:
    """Items per rq job for this enqueue (at most: a conversation's items share a job), and why."""

    size: int
    reason: BatchReason
    items: int | None  # the run's items it was chosen for (None: not known, or not asked)
    jobs_min: int = defaults.JOBS_PER_RUN_MIN

    def why(self) -> str:
        """For people: `by reference, ~1,200,000 items: the largest job that leaves 2,048 jobs or more`."""
        if self.reason is BatchReason.GIVEN:
            return f"--batch-size {self.size:,}"
        if self.reason is BatchReason.INLINE:
            return "inline"
        items = f"~{self.items:,} items" if self.items is not None else "the run's size not known"
        if self.reason is BatchReason.REFERENCE:
            return f"by reference, {items}"
        return f"by reference, {items}: the largest job that leaves {self.jobs_min:,} jobs or more"

    def fields(self) -> dict[str, Any]:
        """For --json (`batch_choice`)."""
        return {"size": self.size, "reason": self.reason.value, "items": self.items, "jobs_min": self.jobs_min,
                "why": self.why()}


def choose_batch(given: int | None, mode: PromptMode, est: Estimate, *, expected: int | None = None,
                 jobs_min: int = defaults.JOBS_PER_RUN_MIN) -> BatchChoice:
    """Items per job: GIVEN (--batch-size) when given; inline BATCH_SIZE; by reference
    BATCH_SIZE_REFERENCE, doubled up to BATCH_SIZE_REFERENCE_MAX while the run's items (EXPECTED,
    --expect-items, else EST's when it is of the whole input) still make JOBS_MIN jobs or more:
    rq's per-job Redis commands spread over more items where a run has jobs enough that a job
    held whole to its end costs the fleet nothing."""
    if given is not None:
        return BatchChoice(given, BatchReason.GIVEN, None, jobs_min)
    if mode is PromptMode.INLINE:
        return BatchChoice(defaults.BATCH_SIZE, BatchReason.INLINE, None, jobs_min)
    items = expected if expected is not None else (est.items if est.whole else None)
    size = defaults.BATCH_SIZE_REFERENCE
    while items is not None and size * 2 <= defaults.BATCH_SIZE_REFERENCE_MAX and items >= size * 2 * jobs_min:
        size *= 2
    reason = BatchReason.RUN_SIZE if size > defaults.BATCH_SIZE_REFERENCE else BatchReason.REFERENCE
    return BatchChoice(size, reason, items, jobs_min)


def run_mode(conn: redis.Redis, run: str, *, in_redis: bool, run_file: RunFile | None) -> PromptMode | None:
    """RUN's mode as its earlier enqueues left it (None: it has none yet). By reference once any
    enqueue of it was (run.json's rule): the run has packs, or a source's summary says so;
    inline when it has sources, or items, and none by reference. IN_REDIS: the run is in Redis
    (else RUN_FILE, its run.json, says, when Redis lost it)."""
    if in_redis:
        store = RunStore(conn)
        sources = store.sources(run)
        if PackTable(conn, run).count() or _by_reference(sources):
            return PromptMode.REFERENCE
        return PromptMode.INLINE if sources or store.item_count(run) else None
    if run_file is None:
        return None
    if run_file.prompts is PromptMode.REFERENCE or run_file.packs or _by_reference(run_file.sources):
        return PromptMode.REFERENCE
    return PromptMode.INLINE if run_file.sources else None


def _by_reference(sources: dict[str, dict[str, Any]]) -> bool:
    return any(s.get("prompts") == PromptMode.REFERENCE.value for s in sources.values() if isinstance(s, dict))


def choose_prompts(asked: PromptsAsked, est: Estimate, has: PromptMode | None, *,
                   reference_from: int = defaults.PROMPTS_REFERENCE_FROM,
                   expected: int | None = None) -> PromptsChoice:
    """Where the jobs keep their items: ASKED when it names a mode; for auto, the run's mode HAS
    when it has one, else by reference from REFERENCE_FROM items of EXPECTED (the whole run's,
    when --expect-items says: a run fed in parts) or of EST (inline when EST is not of the whole
    input)."""
    if asked is not PromptsAsked.AUTO:
        return PromptsChoice(PromptMode(asked.value), asked, PromptsReason.GIVEN, None, reference_from)
    if has is not None:
        return PromptsChoice(has, asked, PromptsReason.RUN, est.items, reference_from)
    if expected is not None:  # this input alone may hold more than the run was said to
        mode = PromptMode.REFERENCE if max(expected, est.items if est.whole else 0) >= reference_from \
            else PromptMode.INLINE
        return PromptsChoice(mode, asked, PromptsReason.EXPECTED, est.items, reference_from, expected_items=expected)
    if not est.whole:
        return PromptsChoice(PromptMode.INLINE, asked, PromptsReason.SIZE_UNKNOWN, est.items, reference_from)
    mode = PromptMode.REFERENCE if est.items >= reference_from else PromptMode.INLINE
    return PromptsChoice(mode, asked, PromptsReason.SIZE, est.items, reference_from)


def choose_by_room(choice: PromptsChoice, inline: MemoryPlan, by_reference: Callable[[], MemoryPlan]
                   ) -> tuple[PromptsChoice, MemoryPlan]:
    """Auto's last word: a run it chose inline by size that does not fit Redis's room, where by
    reference (BY_REFERENCE, its plan) it does, is queued by reference; else CHOICE and INLINE
    as they are (refuse_unfit says what to do when neither fits)."""
    if choice.asked is not PromptsAsked.AUTO or choice.mode is not PromptMode.INLINE \
            or choice.reason not in (PromptsReason.SIZE, PromptsReason.SIZE_UNKNOWN, PromptsReason.EXPECTED) \
            or inline.fits():
        return choice, inline
    ref = by_reference()
    return (choice.for_room(inline), ref) if ref.fits() else (choice, inline)


def refuse_unfit(p: MemoryPlan, run: str) -> None:
    """RedisFullError, with the numbers, when the run does not fit under Redis's maxmemory."""
    if p.fits():
        return
    free = p.room
    assert p.memory is not None and free is not None
    ref = run_bytes(p.items, 0)
    other = "" if p.by_reference or ref > free else \
        f", or queue it by reference (`--prompts reference`: about {size(ref)} of Redis, the prompts in packs)"
    raise RedisFullError(
        f"run {run} needs about {size(p.bytes)} of Redis ({p.items:,} items), but Redis has {size(free)} to give "
        f"(used {size(p.memory.used)} of maxmemory {size(p.memory.maxmemory)}, "
        f"{MEMORY_HEADROOM:.0%} kept for the consumers): "
        f"nothing was written; raise maxmemory (`redis-cli CONFIG SET maxmemory ...`), free memory{other}, or "
        "enqueue a smaller input")
