"""Read an input, convert it once, account for every record, and enqueue rq jobs.

Every non-blank input record ends in exactly one bucket:
  enqueued          it yields at least one item that this invocation put in a job
  already_enqueued  none of its items did, and one was in the run already: before this
                    invocation, or claimed by another producer racing on the same run
  duplicate         every item it yields was already yielded earlier in this invocation
  rejected          it cannot be used; the reason is a contracts.RejectReason
so that records == enqueued + already_enqueued + duplicates + rejected.

Nothing is written to Redis until the input was opened and its first record read, and the
run's settings were checked against an existing run of that name: a mistyped path or option
leaves no run behind. Items are claimed only right before their jobs are enqueued (jobwriter),
so a record's bucket is settled when its items are written; one byte per record keeps it.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from genqueue.common import defaults
from genqueue.common.contracts import Item, RejectReason
from genqueue.common.errors import InputError
from genqueue.common.runs import RunStore, key_digest
from genqueue.common.settings import RunSettings
from genqueue.producer.convert import normalize
from genqueue.producer.items import answer_lengths, estimate_cost, make_items
from genqueue.producer.jobwriter import JobWriter
from genqueue.producer.order import LongestFirst
from genqueue.producer.reader import RawRecord, iter_records
from genqueue.producer.rejects import Rejected, RejectsWriter

#: Records examined per Redis round trip for the already-enqueued check.
CHUNK = 4096
#: Items claimed and enqueued per slice (one claim script, one transaction): bounds what a
#: producer killed between the two leaves claimed and unqueued.
SLICE_ITEMS = 1024

# Per-record flags (one byte per input record, indexed by its position).
_CONVERTED, _NEW, _KNOWN = 1, 2, 4


@dataclass
class Summary:
    """What one `producer enqueue` did; `--json` prints it as one object."""

    run: str
    source: str
    fingerprint: str
    dry_run: bool
    records: int = 0
    enqueued: int = 0
    already_enqueued: int = 0
    duplicates: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    items: int = 0
    jobs: int = 0
    prompt_chars: int = 0
    rejects_path: str | None = None
    seconds: float = 0.0
    created_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Enqueuer:
    """Turns records into jobs. With writer=None (dry run) nothing touches Redis."""

    def __init__(
        self,
        run: str,
        settings: RunSettings,
        writer: JobWriter | None,
        *,
        batch_size: int = defaults.BATCH_SIZE,
        rejects: RejectsWriter | None = None,
        order: LongestFirst | None = None,
    ) -> None:
        self.run = run
        self.settings = settings
        self.writer = writer
        self.store = writer.store if writer is not None else None
        self.batch_size = batch_size
        self.slice = max(batch_size, SLICE_ITEMS - SLICE_ITEMS % batch_size)
        self.rejects = rejects
        self.order = order
        self.reasons: Counter[RejectReason] = Counter()
        self.counts = Counter[str]()
        self.flags = bytearray()
        # 64-bit prefixes of the item keys this invocation has yielded as new: ~60 bytes each
        # in memory, collision odds ~3e-8 at a million items.
        self._seen: set[int] = set()
        self._pending: list[Item] = []
        self._estimates: dict[str, int] = {}

    # --- per record -----------------------------------------------------------------
    def _reject(self, rec: RawRecord, reason: RejectReason, detail: str = "") -> None:
        self.reasons[reason] += 1
        if self.rejects is not None:
            self.rejects.write(rec.index, rec.line, rec.snippet, reason, detail)

    def _convert(self, rec: RawRecord) -> list[Item] | None:
        if rec.error is not None:
            self._reject(rec, rec.error)
            return None
        try:
            conv = normalize(rec.value)
            chars = conv.text_chars()
            if chars > self.settings.max_prompt_chars:
                raise Rejected(RejectReason.TOO_LONG, f"{chars} characters > limit {self.settings.max_prompt_chars}")
            items = make_items(conv, self.settings.multi_turn, rec.index)
            if self.order is not None:
                answers = answer_lengths(conv)
                self._estimates.update((it["key"], estimate_cost(it, answers)) for it in items)
            return items
        except Rejected as r:
            self._reject(rec, r.reason, r.detail)
            return None

    def process(self, records: Iterator[RawRecord]) -> None:
        chunk: list[tuple[int, list[Item]]] = []
        try:
            for rec in records:
                self.counts["records"] += 1
                if rec.index >= len(self.flags):
                    self.flags.extend(bytes(rec.index + 1 - len(self.flags)))
                items = self._convert(rec)
                if items is None:
                    continue
                self.flags[rec.index] = _CONVERTED
                chunk.append((rec.index, items))
                if len(chunk) >= CHUNK:
                    self._settle(chunk)
                    chunk = []
        except InputError:
            # The input broke part way (a truncated archive): what came before it still lands.
            self._settle(chunk)
            self._drain()
            raise
        self._settle(chunk)
        self._drain()

    def _settle(self, chunk: list[tuple[int, list[Item]]]) -> None:
        """Sort a chunk's items into known, duplicate and new (one Redis round trip), then
        write the new ones (or, longest first, hold them back)."""
        if not chunk:
            return
        known: list[bool] = []
        if self.store is not None:
            known = self.store.known_keys(self.run, [key_digest(it["key"]) for _, items in chunk for it in items])
        pos = 0
        for index, items in chunk:
            for it in items:
                if known and known[pos]:
                    self.flags[index] |= _KNOWN
                else:
                    h = int(it["key"][:16], 16)
                    if h not in self._seen:
                        self._seen.add(h)
                        if self.order is not None:
                            self.order.add(it, self._estimates.get(it["key"], 0))
                        else:
                            self._pending.append(it)
                pos += 1
        self._estimates.clear()
        self._write(final=False)

    def _drain(self) -> None:
        """Write what longest-first ordering held back, longest first; then the rest."""
        if self.order is not None:
            for items in self.order.longest_first():
                self._pending.extend(items)
                self._write(final=False)
            self.order.close()
        self._write(final=True)

    def _write(self, *, final: bool) -> None:
        """Write whole slices of the pending items (and, at the end, the rest)."""
        while self._pending and (final or len(self._pending) >= self.slice):
            ready, self._pending = self._pending[: self.slice], self._pending[self.slice :]
            if self.writer is None:
                won, jobs = [True] * len(ready), -(-len(ready) // self.batch_size)
            else:
                won, jobs = self.writer.write(ready)
            self.counts["jobs"] += jobs
            for it, ok in zip(ready, won, strict=True):
                if ok:
                    self.flags[it["index"]] |= _NEW
                    self.counts["items"] += 1
                    self.counts["prompt_chars"] += sum(len(m.get("content") or "") for m in it["messages"])
                else:
                    self.flags[it["index"]] |= _KNOWN

    def fill(self, summary: Summary) -> None:
        """Put the counts into SUMMARY: each converted record's bucket from its flags."""
        per_flag = {value: self.flags.count(value) for value in range(8)}
        summary.records = self.counts["records"]
        summary.enqueued = sum(n for f, n in per_flag.items() if f & _CONVERTED and f & _NEW)
        summary.already_enqueued = sum(n for f, n in per_flag.items() if f & _CONVERTED and f & _KNOWN and not f & _NEW)
        summary.duplicates = sum(n for f, n in per_flag.items() if f == _CONVERTED)
        summary.rejected = sum(self.reasons.values())
        summary.rejected_by_reason = {r.value: n for r, n in sorted(self.reasons.items())}
        summary.items = self.counts["items"]
        summary.jobs = self.counts["jobs"]
        summary.prompt_chars = self.counts["prompt_chars"]


def enqueue_file(
    path: str,
    run: str,
    settings: RunSettings,
    conn: redis.Redis | None,
    *,
    batch_size: int = defaults.BATCH_SIZE,
    rejects_path: str | None = None,
    max_record_bytes: int = defaults.MAX_RECORD_BYTES,
    progress: Callable[[Iterator[RawRecord]], Iterator[RawRecord]] | None = None,
    longest_first: bool = False,
) -> Summary:
    """Enqueue PATH into RUN (or, with conn=None, only count what would be enqueued)."""
    started = time.perf_counter()
    summary = Summary(run=run, source=source_id(path), fingerprint=settings.fingerprint, dry_run=conn is None)
    store = RunStore(conn) if conn is not None else None
    if store is not None:
        store.check(run, settings)  # a conflicting run is refused before the input is read
    records = iter_records(path, max_record_bytes=max_record_bytes)  # a missing file raises here
    first = next(records, None)
    if first is None:
        raise InputError(f"{'stdin' if path == '-' else path} holds no records: nothing to enqueue")
    if store is not None:
        summary.created_run = store.create_or_check(run, settings)
    records = itertools.chain([first], records)
    if progress is not None:
        records = progress(records)
    rejects = RejectsWriter(rejects_path) if rejects_path else None
    order = LongestFirst() if longest_first else None
    writer = JobWriter(run, conn, batch_size=batch_size) if conn is not None else None
    enq = Enqueuer(run, settings, writer, batch_size=batch_size, rejects=rejects, order=order)
    try:
        enq.process(records)
    finally:
        if rejects is not None:
            rejects.close()
        enq.fill(summary)
        summary.rejects_path = rejects.path if rejects is not None and rejects.written else None
        summary.seconds = round(time.perf_counter() - started, 3)
        if store is not None and summary.records:
            store.record_source(run, summary.source, summary.to_dict())
    return summary


def source_id(path: str) -> str:
    """A name for an input that is the same when the same file is enqueued again."""
    return "-" if path == "-" else os.path.abspath(path)
