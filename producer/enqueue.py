"""Read an input, convert it once, account for every record, and enqueue rq jobs.

Every non-blank input record ends in exactly one bucket:
  enqueued          it yields at least one item new to the run
  already_enqueued  every item it yields was enqueued in the run before this invocation
  duplicate         every item it yields was already yielded earlier in this invocation
  rejected          it cannot be used; the reason has a stable name (common.convert)
so that records == enqueued + already_enqueued + duplicates + rejected.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import orjson
import redis
from rq import Retry

from genqueue.common import defaults
from genqueue.common.convert import Rejected, make_items, normalize
from genqueue.common.items import answer_lengths, estimate_cost
from genqueue.common.errors import InputError
from genqueue.common.jobs import TASK, job_description, job_id, queue_for, use_fast_job_compression
from genqueue.common.reader import RawRecord, iter_records
from genqueue.common.runs import RunStore, key_digest, run_key
from genqueue.common.settings import RunSettings
from genqueue.producer.order import LongestFirst

log = logging.getLogger(__name__)

#: Records examined per Redis round trip for the already-enqueued check.
CHUNK = 4096


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

    def balanced(self) -> bool:
        return self.records == self.enqueued + self.already_enqueued + self.duplicates + self.rejected


class RejectsWriter:
    """Appends one JSON line per rejected record: position, reason, detail, a truncated copy."""

    SNIPPET = 300

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh: IO[bytes] | None = None

    def write(self, rec: RawRecord, reason: str, detail: str = "") -> None:
        if self._fh is None:
            self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        line = {
            "index": rec.index,
            "line": rec.line,
            "reason": reason,
            "detail": detail[:200],
            "snippet": rec.snippet[: self.SNIPPET].decode("utf-8", "replace"),
        }
        self._fh.write(orjson.dumps(line) + b"\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


@dataclass(slots=True)
class _Pending:
    rec: RawRecord
    items: list[dict[str, Any]]


class Enqueuer:
    """Turns records into jobs. With conn=None (dry run) nothing touches Redis."""

    def __init__(
        self,
        run: str,
        settings: RunSettings,
        conn: redis.Redis | None,
        *,
        batch_size: int = defaults.BATCH_SIZE,
        retries: int = defaults.JOB_RETRIES,
        rejects: RejectsWriter | None = None,
        order: LongestFirst | None = None,
    ) -> None:
        self.run = run
        self.settings = settings
        self.conn = conn
        self.store = RunStore(conn) if conn is not None else None
        self.queue = queue_for(run, conn) if conn is not None else None
        use_fast_job_compression()
        self.batch_size = batch_size
        self.retries = retries
        self.rejects = rejects
        self.reasons: Counter[str] = Counter()
        # 64-bit prefixes of item keys seen in this invocation: ~60 bytes each in memory,
        # collision odds ~3e-8 at a million items.
        self._seen: set[int] = set()
        self._batch: list[dict[str, Any]] = []
        self.counts = Counter[str]()
        self.order = order
        self._estimates: dict[str, int] = {}

    # --- per record -----------------------------------------------------------------
    def _reject(self, rec: RawRecord, reason: str, detail: str = "") -> None:
        self.reasons[reason] += 1
        self.counts["rejected"] += 1
        if self.rejects is not None:
            self.rejects.write(rec, reason, detail)

    def _convert(self, rec: RawRecord) -> list[dict[str, Any]] | None:
        if rec.error is not None:
            self._reject(rec, rec.error)
            return None
        try:
            conv = normalize(rec.value)
            chars = conv.text_chars()
            if chars > self.settings.max_prompt_chars:
                raise Rejected("too_long", f"{chars} characters > limit {self.settings.max_prompt_chars}")
            items = make_items(conv, self.settings.multi_turn, rec.index)
            if self.order is not None:
                answers = answer_lengths(conv)
                self._estimates.update((it["key"], estimate_cost(it, answers)) for it in items)
            return items
        except Rejected as r:
            self._reject(rec, r.reason, r.detail)
            return None

    def process(self, records: Iterator[RawRecord]) -> None:
        chunk: list[_Pending] = []
        try:
            for rec in records:
                self.counts["records"] += 1
                items = self._convert(rec)
                if items is None:
                    continue
                chunk.append(_Pending(rec, items))
                if len(chunk) >= CHUNK:
                    self._settle(chunk)
                    chunk = []
        except InputError:
            # The input broke part way (a truncated archive): what came before it still lands.
            self._settle(chunk)
            self._drain_order()
            raise
        self._settle(chunk)
        self._drain_order()

    def _drain_order(self) -> None:
        """Enqueue what longest-first ordering held back, longest first; then the rest."""
        if self.order is not None:
            for items in self.order.longest_first():
                self._batch.extend(items)
                self._flush(final=False)
            self.order.close()
        self._flush(final=True)

    def _settle(self, chunk: list[_Pending]) -> None:
        """Decide each record's bucket for a chunk, with one Redis round trip."""
        if not chunk:
            return
        known: list[bool] = []
        if self.store is not None:
            digests = [key_digest(it["key"]) for p in chunk for it in p.items]
            known = self.store.known_keys(self.run, digests)
        pos = 0
        for p in chunk:
            new_items = []
            in_redis = False
            for it in p.items:
                was_known = known[pos] if known else False
                pos += 1
                h = int(it["key"][:16], 16)
                if was_known:
                    in_redis = True
                elif h not in self._seen:
                    self._seen.add(h)
                    new_items.append(it)
            if new_items:
                self.counts["enqueued"] += 1
                self.counts["items"] += len(new_items)
                for it in new_items:
                    self.counts["prompt_chars"] += sum(len(m.get("content") or "") for m in it["messages"])
                if self.order is not None:
                    for it in new_items:
                        self.order.add(it, self._estimates.get(it["key"], 0))
                else:
                    self._batch.extend(new_items)
            elif in_redis:
                self.counts["already_enqueued"] += 1
            else:
                self.counts["duplicates"] += 1
        self._estimates.clear()
        self._flush(final=False)

    def _flush(self, *, final: bool) -> None:
        """Enqueue full batches (and, at the end, the partial one) in one transaction each chunk."""
        cut = len(self._batch) if final else len(self._batch) - len(self._batch) % self.batch_size
        if cut == 0:
            return
        ready, self._batch = self._batch[:cut], self._batch[cut:]
        batches = [ready[i : i + self.batch_size] for i in range(0, len(ready), self.batch_size)]
        self.counts["jobs"] += len(batches)
        if self.queue is None or self.store is None:
            return
        datas = []
        for items in batches:
            datas.append(
                self.queue.prepare_data(
                    TASK,
                    args=[items],
                    job_id=job_id(self.run, [it["key"] for it in items]),
                    description=job_description(self.run, items),
                    retry=Retry(max=self.retries),
                    result_ttl=defaults.RESULT_TTL,
                    timeout=-1,
                    meta={"items": len(items)},
                )
            )
        # One MULTI/EXEC: the jobs and the idempotence keys land together or not at all.
        with self.conn.pipeline(transaction=True) as pipe:  # type: ignore[union-attr]
            self.queue.enqueue_many(datas, pipeline=pipe)
            pipe.sadd(run_key(self.run, "keys"), *[key_digest(it["key"]) for it in ready])
            pipe.execute()


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
    if conn is not None:
        summary.created_run = RunStore(conn).create_or_check(run, settings)
    rejects = RejectsWriter(rejects_path) if rejects_path else None
    order = LongestFirst() if longest_first else None
    enq = Enqueuer(run, settings, conn, batch_size=batch_size, rejects=rejects, order=order)
    records = iter_records(path, max_record_bytes=max_record_bytes)
    if progress is not None:
        records = progress(records)
    try:
        enq.process(records)
    finally:
        if rejects is not None:
            rejects.close()
        _fill(summary, enq, rejects)
        summary.seconds = round(time.perf_counter() - started, 3)
        if conn is not None and summary.records:
            RunStore(conn).record_source(run, summary.source, summary.to_dict())
    return summary


def _fill(summary: Summary, enq: Enqueuer, rejects: RejectsWriter | None) -> None:
    for name in ("records", "enqueued", "already_enqueued", "duplicates", "rejected", "items", "jobs", "prompt_chars"):
        setattr(summary, name, enq.counts[name])
    summary.rejected_by_reason = dict(sorted(enq.reasons.items()))
    summary.rejects_path = rejects.path if rejects is not None and rejects._fh is not None else None


def source_id(path: str) -> str:
    """A name for an input that is the same when the same file is enqueued again."""
    return "-" if path == "-" else os.path.abspath(path)
