"""Read an input, convert it once, account for every record, and enqueue rq jobs.

Re-running the same command is the reconcile (producer/reconcile.py): it enqueues exactly the
items that have no shipped result and are not queued, held or scheduled in rq. Every non-blank
input record ends in exactly one bucket, the first that applies to one of its items:
  enqueued          this invocation put it in a job: new to the run, or in the run with no
                    result and no live job (lost from rq: `rq empty`, a Redis restart, a
                    producer killed between claim and enqueue)
  retried_failed    --retry-failed put it in a job again: it had only an error record, or its
                    job was in rq's failed registry
  already_queued    it is in a live job (queued, being dequeued, started, scheduled), or
                    another producer racing on the run has claimed it
  already_failed    it has only an error record (or its job failed in rq); left alone without
                    --retry-failed
  already_done      a shipped shard holds its result
  duplicate         every item it yields was already yielded earlier in this invocation
  rejected          it cannot be used; the reason is a contracts.RejectReason
so that records == enqueued + retried_failed + already_queued + already_failed + already_done
+ duplicates + rejected. `already_enqueued` = already_queued + already_failed + already_done
(the one bucket those three were before the reconcile), so records == enqueued +
retried_failed + already_enqueued + duplicates + rejected too.

Nothing is written to Redis until the input was opened and its first record read, and the
run's settings were checked against an existing run of that name (or against the run.json its
output holds, when Redis lost the run: runsetup.py): a mistyped path or option leaves no run
behind. Items are claimed only right before their jobs are enqueued (jobwriter), so a record's
bucket is settled when its items are written; one byte per record keeps it. The slices are
written by ENQUEUE_WRITERS threads while the input is read on (a pack's PUT to a store far away
no longer waits in line), their transactions in the order the slices were read; a record's
bucket is counted from its slice's answer only, and a slice that fails stops the enqueue.

Where the jobs keep their items (`--prompts`, issue 34) is settled with the Redis estimate,
before anything is written (memplan.choose_prompts): inline in Redis, or by reference in packs
in the run's output; `auto` keeps the run's mode, else chooses by the input's estimated size.
The summary's `prompts` and `prompts_choice` say which and why.

Cost: a re-run reads its input and asks Redis each item's state in the run's item table (one
round trip per chunk of records); the queue view (every live job's payload) is read only when
an item in the run is not done, once, under the run's lock (common/keepers/runlock.py). When
nothing can need doing it reads nothing: the input file is byte for byte the one of this
source's last complete enqueue (same digest), made into items the same way (settings, options),
and either every item of the run is done (then every record that was not rejected is
already_done), or none of them is lost: under the lock, every item that is not done is queued
(a live job, a young claim) or failed, as the queue view and the item table say, where each
record is one item of the run (its only source, no duplicates), each record then counted by its
item's state (issue 34: a hundred million items read from Redis, not 300 GB of input). The
summary says `input_unchanged` (a digest of the file, a second or two per GB, instead of
converting it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from genqueue.common import defaults
from genqueue.common.contracts import Item, PromptMode, RejectReason
from genqueue.common.errors import InputError, UserError, WriteFailedError
from genqueue.common.keepers.items import ItemTable, buckets_for
from genqueue.common.keepers.marks import Marks
from genqueue.common.keepers.redismem import RedisFilledError, check_policy, full_line, is_oom, read_memory
from genqueue.common.keepers.runlock import RunLock
from genqueue.common.keepers.runs import RunStore, key_digest
from genqueue.common.keepers.runsources import RunSources
from genqueue.common.settings import RunSettings
from genqueue.common.storage import probe_output, store_for
from genqueue.producer.enqueue import memplan
from genqueue.producer.enqueue.estimate import estimated_tokens, output_chars
from genqueue.producer.enqueue.jobwriter import JobWriter, Requeue, record_batches, same_record
from genqueue.producer.enqueue.memplan import PromptsAsked
from genqueue.producer.enqueue.order import LongestFirst
from genqueue.producer.enqueue.reconcile import (
    DONE,
    FAILED,
    IN_RUN,
    QueueView,
    add_to_run,
    as_int,
    derivation,
    input_digest,
    input_head,
    items_in_run,
    other_input,
    same_input,
    take_view,
)
from genqueue.producer.enqueue.runsetup import Note, RunSetup, prepare
from genqueue.producer.ingest.conversation import Conversation
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.inputcheck import checked
from genqueue.producer.ingest.items import STOPPED_AT_TOOL_TURN, Origin, answer_lengths, estimate_cost, make_items
from genqueue.producer.ingest.prefill import prefill_item
from genqueue.producer.ingest.reader import RawRecord, iter_records
from genqueue.producer.ingest.rejects import Rejected, RejectsWriter
from genqueue.producer.ingest.sources import bind
from genqueue.producer.outfiles import OUTPUT_DIR, REJECTS, probe, refuse_replacing
from genqueue.producer.packitems import PackItems

log = logging.getLogger(__name__)

CHUNK = defaults.ENQUEUE_CHUNK
SLICE_ITEMS = defaults.ENQUEUE_SLICE_ITEMS
WRITES_IN_FLIGHT = defaults.ENQUEUE_WRITES_IN_FLIGHT
WRITERS = defaults.ENQUEUE_WRITERS


class _SliceNotTried(Exception):
    """A slice handed to the writer's thread after one before it failed: nothing of it was
    claimed or queued."""

# Per-record flags (one byte per input record, indexed by its position); a record's bucket is
# its highest-priority flag (Enqueuer.fill).
_CONVERTED, _NEW, _RETRIED, _QUEUED, _FAILED, _DONE = 1, 2, 4, 8, 16, 32


@dataclass
class Summary:
    """What one `producer enqueue` did; `--json` prints it as one object."""

    run: str
    source: str
    fingerprint: str
    dry_run: bool
    records: int = 0
    enqueued: int = 0
    retried_failed: int = 0
    already_queued: int = 0
    already_failed: int = 0
    already_done: int = 0
    already_enqueued: int = 0  # already_queued + already_failed + already_done
    duplicates: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    items: int = 0  # items this invocation put in jobs: new, requeued and retried
    requeued: int = 0  # of them: in the run with no result and no live job
    retried: int = 0  # of them: with an error record, or a failed job (--retry-failed)
    jobs: int = 0
    prompt_chars: int = 0
    rejects_path: str | None = None
    seconds: float = 0.0
    created_run: bool = False
    recreated_run: bool = False  # Redis had lost the run: re-created from its output's run.json
    marks_rebuilt: dict[str, int] | None = None  # shards, records, done, failed
    settings_updated: dict[str, Any] | None = None  # from, to (fingerprints), changed
    queue_view: dict[str, Any] | None = None  # what the reconcile read of the queue, when it had to
    input_unchanged: bool = False  # the input was not read: see the module docstring ("Cost")
    #: when the input was not read while items are still to do: the run's items done, queued and
    #: failed as its item table and the queue view say (reconcile.items_in_run)
    items_in_run: dict[str, float] | None = None
    input_digest: str | None = None  # blake2b of the input file (None for stdin)
    #: the input's first records, to know the file again (reconcile.input_head: records, digest)
    input_head: dict[str, Any] | None = None
    derivation: str | None = None  # what made its items: the settings, the reading options
    complete: bool = False  # the whole input was read
    priority: int = 0  # the run's priority now (--priority sets it; not part of the recipe)
    user_turns: int = 0  # user turns in the records converted (status: the multi-turn rule's input)
    multi_turn_records: int = 0  # of those records: with more than one user turn
    stopped_at_tool_turn: int = 0  # items cut at a tool turn (regenerate)
    # the run's output tokens as the input's original answers say (estimate.py): of every
    # item converted from this input, not only those queued now; None when it has no answers
    estimated_output_tokens: int | None = None
    # Redis memory, estimated before anything was written (producer/memplan.py)
    redis_memory: str | None = None  # the estimate against what Redis has, for people
    redis_estimate_bytes: int | None = None
    redis_free_bytes: int | None = None  # under maxmemory; None: no limit, or not known
    # where this enqueue's jobs keep their items (--prompts): in Redis, or in packs in the output
    prompts: str = PromptMode.INLINE.value
    # and why (memplan.PromptsChoice.fields): asked (auto, inline, reference), reason (a
    # memplan.PromptsReason), estimated_items, reference_from, why (the summary's words)
    prompts_choice: dict[str, Any] | None = None
    packs: int = 0  # packs written (by reference)
    batch_size: int = defaults.BATCH_SIZE  # items per job, at most (--batch-size, or as batch_choice says)
    # and why (memplan.BatchChoice.fields): size, reason (a memplan.BatchReason), items, jobs_min, why
    batch_choice: dict[str, Any] | None = None

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
        origin: Origin | None = None,
        retry_failed: bool = False,
    ) -> None:
        self.run = run
        self.retry_failed = retry_failed
        self.view: QueueView | None = None  # taken, under the run's lock, when first needed
        self.queue_view: dict[str, Any] | None = None
        self.origin = origin or Origin()
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
        # Whether the run's item table was empty when this invocation began (read once, before
        # its first claim; None until then): then no item state needs reading (_settle).
        self._fresh: bool | None = None
        self._pending: list[Item] = []
        self._estimates: dict[str, int] = {}
        self._group: list[Item] = []  # longest first: the items taken of the record at hand
        # Items already in the run that this invocation puts in jobs again -> _NEW (lost) or
        # _RETRIED (failed, --retry-failed); written through JobWriter.requeue.
        self._requeue: dict[int, int] = {}
        # The slices being written (claim, pack, transaction), in order, in the writer's thread
        # while this one reads on: each one's items and its write's answer (_write, _settle_write).
        self._writing: deque[tuple[list[Item], Future[tuple[list[bool], int]]]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._write_failed = threading.Event()  # a slice's write failed: the ones after it are not tried
        self._abandoned = threading.Event()  # the reading stopped: slices not yet claimed are not
        self._last_written: threading.Event | None = None  # set once the last slice handed out is written

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
            if self.settings.prefill is not None:  # a capture pass: its lines are rows (ingest/prefill.py)
                return [prefill_item(rec.value, rec.index, self.origin.of(rec.value))]
            conv = normalize(rec.value)
            chars = conv.text_chars()
            if chars > self.settings.max_prompt_chars:
                raise Rejected(RejectReason.TOO_LONG, f"{chars} characters > limit {self.settings.max_prompt_chars}")
            items = make_items(conv, self.settings.multi_turn, rec.index, self.origin.of(rec.value))
            self._count_turns(conv, items)
            answers = answer_lengths(conv)
            self._count_answers(items, answers)
            if self.order is not None:
                self._estimates.update((it["key"], estimate_cost(it, answers)) for it in items)
            return items
        except Rejected as r:
            self._reject(rec, r.reason, r.detail)
            return None

    def _count_turns(self, conv: Conversation, items: list[Item]) -> None:
        """What the multi-turn rule meets: records with several user turns, and the items cut
        at a tool turn (`producer status` shows them beside what the consumers generated)."""
        users = sum(m["role"] == "user" for m in conv.messages)
        self.counts["user_turns"] += users
        self.counts["multi_turn_records"] += users > 1
        self.counts["stopped_at_tool_turn"] += sum(it.get("note") == STOPPED_AT_TOOL_TURN for it in items)

    def _count_answers(self, items: list[Item], answers: list[int]) -> None:
        for it in items:
            chars = output_chars(it, answers)
            self.counts["output_items"] += 1
            self.counts["output_answered"] += chars > 0
            self.counts["output_chars"] += chars

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
        """Sort a chunk's items (one Redis round trip): done, new to the run, or in the run and
        not done (then the queue view says queued, failed or lost); then write what is to be
        queued (or, longest first, hold it back)."""
        if not chunk:
            return
        flat = [(index, it) for index, items in chunk for it in items]
        if self.writer is None:
            for pos, (index, it) in enumerate(flat):
                self._take(index, it, None)
                self._close_group(flat, pos)
        else:
            conn = self.writer.conn
            if self._fresh is None:  # before this invocation's first claim
                self._fresh = not any(Marks(conn, self.run).totals())
            # A run whose table held nothing when this invocation began holds only what it
            # claimed since (each once: _seen), or what a racing producer claimed (its claim
            # answers that): its states need no read, which is one Redis command an item.
            states = bytes(len(flat)) if self._fresh else Marks(conn, self.run).item_states(
                [key_digest(it["key"]) for _, it in flat])
            if self.view is None and any(st & (IN_RUN | DONE) == IN_RUN for st in states):
                self._take_view()
            orphans: list[bytes] = []
            for pos, ((index, it), st) in enumerate(zip(flat, states, strict=True)):
                if st & DONE:
                    self.flags[index] |= _DONE
                    if not st & IN_RUN:
                        orphans.append(key_digest(it["key"]))
                elif not st & IN_RUN:
                    self._take(index, it, None)
                else:
                    assert self.view is not None
                    k = as_int(it["key"])
                    if k in self.view.live:
                        self.flags[index] |= _QUEUED
                    elif st & FAILED or k in self.view.failed:
                        if self.retry_failed:
                            self._take(index, it, _RETRIED)
                        else:
                            self.flags[index] |= _FAILED
                    else:  # in the run, no result, no job: lost from rq, or an abandoned claim
                        self._take(index, it, _NEW)
                self._close_group(flat, pos)
            add_to_run(conn, self.run, orphans)
        self._estimates.clear()
        self._write(final=False)

    def _close_group(self, flat: list[tuple[int, Item]], pos: int) -> None:
        """Longest first: after a record's last item (FLAT[POS]), hand what was taken of it to
        the order as one group, at the sum of its items' costs (producer/order.py)."""
        if self.order is None or not self._group:
            return
        if pos + 1 < len(flat) and flat[pos + 1][0] == flat[pos][0]:
            return
        est = self._estimates
        self.order.add_group(self._group, sum(est.get(it["key"], 0) for it in self._group))
        self._group = []

    def _take(self, index: int, it: Item, requeue: int | None) -> None:
        """Put IT on the way to a job (new to the run: REQUEUE None), once per invocation."""
        h = int(it["key"][:16], 16)
        if h in self._seen:
            return
        self._seen.add(h)
        if requeue is not None:
            self._requeue[as_int(it["key"])] = requeue
        if self.order is not None:
            self._group.append(it)  # a record's items go to the order together (_settle)
        else:
            self._pending.append(it)

    def _take_view(self) -> None:
        assert self.writer is not None
        self._settle_write()  # a claim in flight would wait on the lock taken below for ever
        self.writer.lock.acquire()
        # jobs by reference (issue 34): their items are read from their packs
        items_of = PackItems(self.writer.conn, self.run, self.settings.output).items_of
        self.view = take_view(self.writer.conn, self.run, self.writer.claim_prefix, items_of=items_of)
        self.queue_view = view_summary(self.view)

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
            end, pend = self.slice, self._pending
            while end < len(pend) and same_record(pend[end], pend[end - 1]):
                end += 1  # a record's items stay in one slice, so in one job (jobwriter.py)
            ready, self._pending = pend[:end], pend[end:]
            if self.writer is None:
                self.counts["jobs"] += len(record_batches(ready, self.batch_size))
                for it in ready:
                    self._queued(it, _NEW)
                continue
            new = [it for it in ready if as_int(it["key"]) not in self._requeue]
            if new:
                while len(self._writing) >= WRITES_IN_FLIGHT:
                    self._settle_write(oldest=True)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="gq-enqueue-write")
                written = threading.Event()
                self._writing.append((new, self._pool.submit(self._write_slice, new, self._last_written, written)))
                self._last_written = written
            again = [it for it in ready if as_int(it["key"]) in self._requeue]
            if again:
                self._settle_write()
                codes, jobs = self.writer.requeue(again, retry_failed=self.retry_failed)
                self.counts["jobs"] += jobs
                for it, code in zip(again, codes, strict=True):
                    kind = self._requeue.pop(as_int(it["key"]))
                    if code is Requeue.QUEUED:
                        self._queued(it, kind)
                        self.counts["retried" if kind == _RETRIED else "requeued"] += 1
                    else:
                        self.flags[it["index"]] |= _REQUEUE_OUTCOME[code]

        if final:
            self._settle_write()

    def _write_slice(self, items: list[Item], before: threading.Event | None,
                     written: threading.Event) -> tuple[list[bool], int]:
        """A writer's thread: claim ITEMS, write their pack, and enqueue their jobs once the slice
        handed out BEFORE them is written (JobWriter.write's turn), then set WRITTEN; unless a
        slice before them failed (then nothing of them is claimed: _SliceNotTried)."""
        assert self.writer is not None
        try:
            if self._write_failed.is_set() or self._abandoned.is_set():
                raise _SliceNotTried
            try:
                return self.writer.write(items, turn=None if before is None else lambda: self._turn(before))
            except BaseException:
                self._write_failed.set()
                raise
        finally:
            written.set()

    def _turn(self, before: threading.Event) -> None:
        """A slice's turn to queue its jobs: once the slice before it is written; not at all
        once a slice failed (JobWriter.write gives its claim back; its pack is left unnamed)."""
        before.wait()
        if self._write_failed.is_set():
            raise _SliceNotTried

    def _settle_write(self, *, oldest: bool = False) -> None:
        """Wait for the slices in flight (OLDEST: the oldest only) and count what they queued, in
        the order they were written; raises what a write raised (its claim given back, as
        JobWriter.write does). Slices are written while the next chunk is read and converted: the
        packs' PUTs and the slices' transactions overlap the input's reading instead of adding
        to it; a record's bucket is settled only here, from the write's answer, so the counts
        never hold a slice that did not land."""
        while self._writing:
            new, fut = self._writing[0]
            try:
                won, jobs = fut.result()
            except _SliceNotTried:
                new, won, jobs = [], [], 0  # never claimed: an earlier slice's error is the one raised
            finally:
                if fut.done():  # not on a Ctrl-C while it waits: close() waits for it again
                    self._writing.popleft()
            self.counts["jobs"] += jobs
            for it, ok in zip(new, won, strict=True):
                if ok:
                    self._queued(it, _NEW)
                else:  # another producer racing on the run claimed it first
                    self.flags[it["index"]] |= _QUEUED
            if oldest:
                return

    def close(self, *, abandon: bool = False) -> None:
        """Wait for the slices in flight (an invocation that stops on an error still waits for
        the writes it started: their jobs land, or their claims are given back, and what landed
        is counted); the first error among them, if any, is raised here. ABANDON (the reading
        stopped on an error or Ctrl-C): slices not yet claimed are not; those claimed are
        written to the end."""
        if abandon:
            self._abandoned.set()
        error: BaseException | None = None
        try:
            while self._writing:
                try:
                    self._settle_write(oldest=True)
                except Exception as e:  # noqa: BLE001 - raised below, once the others settled and counted
                    error = error or e
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        if error is not None:
            raise error

    def _queued(self, it: Item, flag: int) -> None:
        self.flags[it["index"]] |= flag
        self.counts["items"] += 1
        self.counts["prompt_chars"] += sum(len(m.get("content") or "") for m in it["messages"])

    def fill(self, summary: Summary) -> None:
        """Put the counts into SUMMARY: each converted record's bucket from its flags."""
        buckets = Counter[str]()
        for value in range(64):
            if value & _CONVERTED and (n := self.flags.count(value)):
                buckets[_bucket(value)] += n
        summary.records = self.counts["records"]
        summary.enqueued = buckets["enqueued"]
        summary.retried_failed = buckets["retried_failed"]
        summary.already_queued = buckets["already_queued"]
        summary.already_failed = buckets["already_failed"]
        summary.already_done = buckets["already_done"]
        summary.already_enqueued = summary.already_queued + summary.already_failed + summary.already_done
        summary.duplicates = buckets["duplicates"]
        summary.rejected = sum(self.reasons.values())
        summary.rejected_by_reason = {r.value: n for r, n in sorted(self.reasons.items())}
        summary.items = self.counts["items"]
        summary.requeued = self.counts["requeued"]
        summary.retried = self.counts["retried"]
        summary.jobs = self.counts["jobs"]
        summary.prompt_chars = self.counts["prompt_chars"]
        summary.user_turns = self.counts["user_turns"]
        summary.multi_turn_records = self.counts["multi_turn_records"]
        summary.stopped_at_tool_turn = self.counts["stopped_at_tool_turn"]
        summary.queue_view = self.queue_view
        summary.estimated_output_tokens = estimated_tokens(self.counts["output_chars"], self.counts["output_items"],
                                                           self.counts["output_answered"])


#: The flag a record gets for an item a requeue did not put in a job.
_REQUEUE_OUTCOME = {Requeue.SKIPPED: _QUEUED, Requeue.DONE: _DONE, Requeue.FAILED: _FAILED}


def _bucket(flags: int) -> str:
    """A converted record's bucket: its first flag in priority order."""
    for flag, name in ((_NEW, "enqueued"), (_RETRIED, "retried_failed"), (_QUEUED, "already_queued"),
                       (_FAILED, "already_failed"), (_DONE, "already_done")):
        if flags & flag:
            return name
    return "duplicates"


@dataclass(frozen=True, slots=True)
class EnqueueOptions:
    """How one enqueue reads its input and queues it; the recipe is the run's RunSettings."""

    #: items per rq job (None: memplan.choose_batch's, by the mode and the run's size)
    batch_size: int | None = None
    #: where rejected records are written (None: nowhere)
    rejects_path: str | None = None
    max_record_bytes: int = defaults.MAX_RECORD_BYTES
    #: queue the costliest items first, held in TMP_DIR (None: TMPDIR) until the input is read
    longest_first: bool = False
    tmp_dir: str | None = None
    #: how a record's id and samples are found (None: the defaults of Origin)
    origin: Origin | None = None
    #: queue items that have only an error record again
    retry_failed: bool = False
    #: give an existing run these settings instead of refusing them
    update_settings: bool = False
    #: a local output is one filesystem every node mounts (common/placement.py)
    shared_fs: bool = False
    #: give the run this priority before any job is queued (None: keep it)
    priority: int | None = None
    #: prove the output can be written and read back before anything is queued (probe_output)
    output_check: bool = True
    #: the settings the command line gave (common/settings.py's SETTING_NAMES): an existing
    #: run keeps its own for the others (runsetup.prepare); None: every one was given
    settings_given: frozenset[str] | None = None
    #: where the jobs keep their items: inline (in Redis), by reference (packs in the output), or
    #: auto: the run's mode, else by the input's size (memplan.choose_prompts)
    prompts: PromptsAsked = PromptsAsked.AUTO
    #: auto queues by reference from this many items of the input's estimate
    prompts_reference_from: int = defaults.PROMPTS_REFERENCE_FROM
    #: the items the whole run will hold, all its enqueues together (--expect-items; None: this
    #: input's): the item table of a new run is sized for them, and auto chooses by them
    expect_items: int | None = None


def enqueue_file(path: str, run: str, settings: RunSettings, conn: redis.Redis | None,
                 options: EnqueueOptions | None = None, *,
                 progress: Callable[[Iterator[RawRecord]], Iterator[RawRecord]] | None = None,
                 note: Note | None = None) -> Summary:
    """Enqueue PATH into RUN (or, with conn=None, only count what would be enqueued): the items
    with no shipped result that are not queued in rq (module docstring), as OPTIONS say.
    PROGRESS wraps the records read; NOTE gets the lines worth telling the user (a run
    re-created from its output, settings updated). A file that cannot be written raises
    WriteFailedError (outfiles)."""
    opts = options if options is not None else EnqueueOptions()
    started = time.perf_counter()
    if conn is not None:  # a Redis that evicts keys would drop the run in silence
        check_policy(conn, warn=(lambda line: note(f"warning: {line}")) if note is not None else log.warning)
    # a conflicting run is refused before the input is read; nothing is written yet
    setup: RunSetup | None = prepare(conn, run, settings, update=opts.update_settings, shared_fs=opts.shared_fs,
                                     given=opts.settings_given) if conn is not None else None
    if setup is not None:  # an existing run's own settings for those the command line left out
        settings = setup.settings
    summary = Summary(run=run, source=source_id(path), fingerprint=settings.fingerprint, dry_run=conn is None)
    records = iter_records(path, max_record_bytes=opts.max_record_bytes)  # a missing file raises here
    if settings.prefill is None:  # a capture pass's input is producer capture's own (ingest/prefill.py)
        records = checked(records, "stdin" if path == "-" else path)  # no JSON object ahead: refused
    head, records, complete = memplan.sample(records)  # what the run takes of Redis, before any write
    summary.input_head = input_head(head)
    if conn is not None and setup is not None:  # nothing is written yet: an input not the run's is refused
        _refuse_other_input(path, summary.source, head, setup, opts)
    est = memplan.estimate(path, head, settings, opts.origin, complete=complete)
    has = memplan.run_mode(conn, run, in_redis=setup.existing is not None, run_file=setup.run_file) \
        if conn is not None and setup is not None else None
    choice = memplan.choose_prompts(opts.prompts, est, has, reference_from=opts.prompts_reference_from,
                                    expected=opts.expect_items)

    def planned(by_reference: bool) -> memplan.MemoryPlan:
        return memplan.plan(path, head, run, settings, opts.origin, conn, complete=complete,
                            by_reference=by_reference, est=est)

    mem = planned(choice.mode is PromptMode.REFERENCE)
    choice, mem = memplan.choose_by_room(choice, mem, lambda: planned(True))
    summary.prompts, summary.prompts_choice = choice.mode.value, choice.fields()
    batch = memplan.choose_batch(opts.batch_size, choice.mode, est, expected=opts.expect_items)
    summary.batch_size, summary.batch_choice = batch.size, batch.fields()
    summary.redis_memory, summary.redis_estimate_bytes = mem.line(), mem.bytes
    summary.redis_free_bytes = mem.memory.free if mem.memory is not None else None
    if conn is not None:
        log.info("run %s: Redis memory %s", run, mem.line())
        memplan.refuse_unfit(mem, run)
    # Side files are opened (their place probed) before the run is created: a place that cannot
    # take them is refused with nothing written (outfiles.probe).
    if conn is not None and "://" not in settings.output and os.path.isdir(settings.output):
        # run.json goes there (runsetup), and this host's consumers' shards: a full one is refused
        probe(Path(settings.output) / f".gq-probe-{os.getpid()}", OUTPUT_DIR, shown=Path(settings.output),
              only_full=True)
    if conn is not None and opts.output_check:
        probe_output(settings.output, run)  # one probe per enqueue, before Redis holds anything of it
    rejects = RejectsWriter(opts.rejects_path).open() if opts.rejects_path else None
    order: LongestFirst | None = None
    try:
        order = LongestFirst(opts.tmp_dir) if opts.longest_first else None
        if conn is not None:  # after every probe: a refused enqueue leaves nothing in Redis
            _item_table(conn, run, mem, expect=opts.expect_items, note=note)
        return _enqueue(path, records, summary, run, settings, conn, setup, opts, started=started, rejects=rejects,
                        progress=progress, order=order, note=note, prompts=choice.mode)
    except WriteFailedError as e:
        done = "nothing was queued" if not summary.items else \
            f"{summary.items:,} items were queued before it and stay queued"
        raise WriteFailedError(f"{e} ({done}; the same command again queues the rest)") from None
    except redis.exceptions.ResponseError as e:
        if not is_oom(e) or conn is None:
            raise
        raise RedisFilledError(_filled_line(conn, summary)) from None
    finally:
        if rejects is not None:
            rejects.discard()  # a no-op once closed
        if order is not None:
            order.close()


def _refuse_other_input(path: str, source: str, head: list[RawRecord], setup: RunSetup, opts: EnqueueOptions) -> None:
    """Refuse, before anything is written, an input that is not the file the run was made from
    (reconcile.other_input), and a rejects file that would replace one the run reads or one
    genqueue did not write (outfiles.refuse_replacing)."""
    run = setup.run
    known: dict[str, dict[str, Any]] = {}
    if setup.existing is not None:
        known = RunStore(setup.conn).sources(run)
    elif setup.run_file is not None:  # Redis lost the run: run.json kept its sources
        known = {k: v for k, v in setup.run_file.sources.items() if isinstance(v, dict)}
    why = other_input(path, source, head, known, run, retry_failed=opts.retry_failed)
    if why is not None:
        raise UserError(why)
    rejects = Path(opts.rejects_path).absolute() if opts.rejects_path else None
    if rejects is not None and (rejects.is_file() or not rejects.exists()):  # /dev/null, a pipe: written as is
        inputs = {s: f"an input of run {run}" for s in known}
        if path != "-":
            inputs[path] = "the input of this enqueue"
        refuse_replacing([(rejects, REJECTS)], inputs=inputs, asked="remove it")


def _item_table(conn: redis.Redis, run: str, mem: memplan.MemoryPlan, *, expect: int | None = None,
                note: Note | None = None) -> None:
    """RUN's item table sized for the whole input, or for EXPECT items when --expect-items says
    how many the run will hold in all (fixed by a run's first enqueue; an input of unknown size
    gets the size of one whose first records were all it held), and the sets of a run queued by
    a genqueue before the table moved into it."""
    table = ItemTable(conn, run)
    wanted = mem.items if mem.whole else max(mem.items, defaults.ITEMS_UNKNOWN_SIZE)
    buckets = table.ensure(max(wanted, expect or 0))
    held, entries = table.counts().in_run, table.listpack_entries()
    if expect is not None and buckets < buckets_for(expect):
        line = (f"note: run {run}: --expect-items {expect:,} does not change its item table, sized by its first "
                f"enqueue ({buckets:,} buckets, for about {buckets * defaults.ITEMS_PER_BUCKET:,} items); give it "
                "to a run's first enqueue")
        (note or log.warning)(line)
    if held + mem.items > buckets * entries:
        cost = ("its buckets hold more than %d records each, past what they were made for: each claim and mark "
                "searches and copies longer strings, slower in Redis, the bytes an item unchanged" if table.blobs() else
                "its buckets outgrow Redis's compact hashes (%d entries): more Redis an item than the estimate's, "
                "nothing else changes")
        log.warning("run %s: its item table has %d buckets, fixed by its first enqueue; with about %s items more "
                    "than its %s " + cost + " (a run fed in parts is sized for all of them by --expect-items on "
                    "its first enqueue)", run, buckets, f"{mem.items:,}", f"{held:,}", entries)
    if moved := table.migrate_sets():
        log.warning("run %s: %d marks moved from the run's sets into its item table (made by an earlier "
                    "genqueue)", run, moved)


def _enqueue(path: str, records: Iterator[RawRecord], summary: Summary, run: str, settings: RunSettings,
             conn: redis.Redis | None, setup: RunSetup | None, opts: EnqueueOptions, *, started: float,
             rejects: RejectsWriter | None, progress: Callable[[Iterator[RawRecord]], Iterator[RawRecord]] | None,
             order: LongestFirst | None, note: Note | None, prompts: PromptMode) -> Summary:
    """enqueue_file once its input is checked and its side files are open; PROMPTS: where the
    jobs keep their items, as chosen."""
    batch_size = summary.batch_size
    priority, retry_failed = opts.priority, opts.retry_failed
    store = RunStore(conn) if conn is not None else None
    if setup is not None and store is not None:
        info = setup.apply(note or _log_note, priority)  # the priority is set before the first job
        summary.priority = int(setup.outcome["priority"])
        summary.fingerprint = info.fingerprint
        summary.created_run = bool(setup.outcome.get("created_run"))
        summary.recreated_run = bool(setup.outcome.get("recreated_run"))
        summary.marks_rebuilt = setup.outcome.get("marks_rebuilt")
        summary.settings_updated = setup.outcome.get("settings_updated")
    origin = bind(opts.origin, path, summary.source, run, settings, conn)
    lock = RunLock(conn, run) if conn is not None else None
    view: QueueView | None = None  # taken by the check below, under the lock, when it read no input
    if conn is not None and lock is not None:
        summary.input_digest = input_digest(path)
        summary.derivation = derivation(summary.fingerprint, opts.max_record_bytes, repr(origin))
        if setup is not None and setup.existing is not None and not retry_failed and not summary.settings_updated:
            try:
                unchanged, view = _unchanged(conn, run, summary, settings.output, lock)
            except BaseException:
                lock.release()
                raise
            if unchanged:
                summary.seconds = round(time.perf_counter() - started, 3)
                RunStore(conn).record_source(run, summary.source, summary.to_dict())
                return summary
    if progress is not None:
        records = progress(records)
    pack_store = store_for(settings.output) if prompts is PromptMode.REFERENCE and conn is not None else None
    writer = JobWriter(run, conn, batch_size=batch_size, lock=lock, pack_store=pack_store) \
        if conn is not None else None
    enq = Enqueuer(run, settings, writer, batch_size=batch_size, rejects=rejects, order=order, origin=origin,
                   retry_failed=retry_failed)
    if view is not None:  # the view the check took stands: the lock was held since (it took over claims)
        enq.view, enq.queue_view = view, view_summary(view)
    ended = False
    if conn is not None:
        RunSources(conn, run).start_reading(summary.source, time.time())
    try:
        enq.process(records)
        summary.complete = ended = True
    except InputError:  # the input broke part way: what came before it stands, its rejects too
        ended = True
        raise
    finally:
        try:
            enq.close(abandon=not summary.complete)  # the slices in flight: jobs landed or claims given back
        except Exception as e:  # only when another error is on its way up (else raised)
            if summary.complete:
                raise
            log.warning("enqueue of run %s: the last slice's write failed too: %s", run, e)
        finally:
            if lock is not None:
                lock.release()
            if conn is not None:
                RunSources(conn, run).end_reading(summary.source)
        enq.fill(summary)
        if writer is not None:
            summary.packs = len(writer.pack_names)
        try:
            if rejects is not None and ended:
                rejects.close()  # in place only now; otherwise enqueue_file removes its .partial
        finally:
            summary.rejects_path = rejects.path if rejects is not None and rejects.written else None
            summary.seconds = round(time.perf_counter() - started, 3)
            if store is not None and summary.records:
                store.record_source(run, summary.source, summary.to_dict())
                if setup is not None:
                    setup.record_source(summary.source, summary.to_dict(),
                                        packs=writer.pack_names if writer is not None else None)
    return summary


def _unchanged(conn: redis.Redis, run: str, summary: Summary, output: str,
               lock: RunLock) -> tuple[bool, QueueView | None]:
    """Fill SUMMARY as a full reconcile would when its input need not be read, and say whether
    it did: the input is the one its source's last complete enqueue read, made into items the
    same way (reconcile.same_input), and either every item of the run is done, or, under the
    run's LOCK, none is lost (reconcile.items_in_run: each done, queued or failed, as the item
    table and the queue view say; the jobs by reference read from their packs in OUTPUT) and
    each of the source's records is one item of the run (then the records are split by their
    items' states). An item lost needs the input: then the input is read, and the view taken
    here is returned with the LOCK still held (the view stays true while it is held, and it may
    have taken over claims), for the reconcile to use instead of taking another."""
    prev = same_input(conn, run, summary.source, summary.input_digest, summary.derivation)
    if prev is None:
        return False, None
    if not Marks(conn, run).all_done():
        # The records are accounted for by their items' states only where an item is a record:
        # this source alone in the run, and its last read counted as many items as records
        # kept (no duplicates); else the input is read.
        kept = int(prev["records"]) - int(prev["rejected"])
        if set(RunStore(conn).sources(run)) != {summary.source} or int(prev.get("duplicates", 0)):
            return False, None
        lock.acquire()
        view = take_view(conn, run, uuid.uuid4().hex, items_of=PackItems(conn, run, output).items_of)
        counted = items_in_run(conn, run, view)
        if counted.lost or counted.done + counted.queued + counted.failed != kept:
            if counted.lost:
                log.info("run %s: %d items are in the run, not done and in no job: the input is read to queue them "
                         "again", run, counted.lost)
            return False, view
        lock.release()
        summary.queue_view = view_summary(view)
        summary.items_in_run = {"done": counted.done, "queued": counted.queued, "failed": counted.failed,
                                "seconds": round(counted.seconds, 3)}
    summary.records = int(prev["records"])
    summary.rejected = int(prev["rejected"])
    summary.rejected_by_reason = dict(prev["rejected_by_reason"])
    for k in ("user_turns", "multi_turn_records", "stopped_at_tool_turn"):
        setattr(summary, k, int(prev.get(k, 0)))
    est = prev.get("estimated_output_tokens")
    summary.estimated_output_tokens = est if isinstance(est, int) else None
    summary.already_enqueued = summary.records - summary.rejected
    if summary.items_in_run is None:  # every item done: so is every record's
        summary.already_done = summary.already_enqueued
    else:  # an item a record (above)
        summary.already_done = int(summary.items_in_run["done"])
        summary.already_queued = int(summary.items_in_run["queued"])
        summary.already_failed = int(summary.items_in_run["failed"])
    summary.input_unchanged = summary.complete = True
    return True, None


def view_summary(v: QueueView) -> dict[str, Any]:
    """What the summary's `queue_view` says of the view V."""
    return {"live_jobs": v.live_jobs, "live_items": len(v.live), "failed_jobs": v.failed_jobs,
            "claims_held_by_others": v.held_claims, "claimed_items_held": v.held_items,
            "held_claim_oldest_s": v.held_oldest_s, "claims_taken_over": v.taken_over_claims,
            "claimed_items_taken_over": v.taken_over_items, "seconds": round(v.seconds, 3),
            "malformed_jobs": v.malformed_jobs}


def _filled_line(conn: redis.Redis, summary: Summary) -> str:
    """What to say when Redis filled up part way: how far the enqueue got, and how to finish."""
    try:
        mem = read_memory(conn)
    except redis.exceptions.RedisError:
        mem = None
    what = full_line(mem) if mem is not None and mem.limited else "Redis is full (it refuses writes: used memory > maxmemory)"
    done = f"{summary.items:,} items were queued in {summary.jobs:,} jobs before it and stay queued" \
        if summary.items else "nothing was queued"
    return (f"{what}; {done}; free memory or raise maxmemory (`redis-cli CONFIG SET maxmemory ...`), then the "
            "same command queues the rest (it queues only what is not queued yet)")


def _log_note(line: str) -> None:
    log.warning("%s", line.split(": ", 1)[-1])


def source_id(path: str) -> str:
    """A name for an input that is the same when the same file is enqueued again."""
    return "-" if path == "-" else os.path.abspath(path)
