"""What one enqueue counts and reports: each input record's bucket, and the Summary.

Every non-blank input record ends in exactly one bucket, the first that applies to one of its
items: enqueued (put in a job by this invocation: new to the run, or in the run with no result
and no live job), retried_failed (put in a job again by --retry-failed), already_queued (in a
live job, or claimed by another producer racing on the run), already_failed (only an error
record, or its job failed in rq), already_done (a shipped shard holds its result), duplicates
(every item it yields was yielded earlier in this invocation), rejected (a RejectReason). So
records == enqueued + retried_failed + already_queued + already_failed + already_done +
duplicates + rejected, and already_enqueued == already_queued + already_failed + already_done.

A record keeps what its items met in one byte of flags (Flag), indexed by its position in the
input; its bucket is its highest-priority flag (`bucket`). A record's bucket is settled only
once its items' writes answered: the counts never hold a slice that did not land. The Tally
holds the flags and the counts every phase adds to, and fills the Summary at the end.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from genqueue.common import defaults
from genqueue.common.contracts import Item, PromptMode, RejectReason
from genqueue.common.estimate import estimated_tokens
from genqueue.producer.enqueue.reconcile import QueueView


class Flag:
    """A record's flags, one bit each of its byte (Tally.flags)."""

    CONVERTED, NEW, RETRIED, QUEUED, FAILED, DONE = 1, 2, 4, 8, 16, 32


def bucket(flags: int) -> str:
    """A converted record's bucket: its first flag in priority order."""
    for flag, name in ((Flag.NEW, "enqueued"), (Flag.RETRIED, "retried_failed"), (Flag.QUEUED, "already_queued"),
                       (Flag.FAILED, "already_failed"), (Flag.DONE, "already_done")):
        if flags & flag:
            return name
    return "duplicates"


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
    input_unchanged: bool = False  # the input was not read: see unchanged.py
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
    # the run's output tokens as the input's original answers say (common/estimate.py): of every
    # item converted from this input, not only those queued now; None when it has no answers
    estimated_output_tokens: int | None = None
    # Redis memory, estimated before anything was written (memplan.py)
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


class Tally:
    """One enqueue's counts: each record's flags, what every phase counts (records, items, jobs,
    turns, the original answers' characters), and the rejects by reason."""

    def __init__(self) -> None:
        self.flags = bytearray()
        self.counts = Counter[str]()
        self.reasons: Counter[RejectReason] = Counter()

    def read(self, index: int) -> None:
        """A record read, at INDEX in the input: counted, and its byte of flags made."""
        self.counts["records"] += 1
        if index >= len(self.flags):
            self.flags.extend(bytes(index + 1 - len(self.flags)))

    def queued(self, it: Item, flag: int) -> None:
        """IT landed in a job: its record gets FLAG, and IT is counted."""
        self.flags[it["index"]] |= flag
        self.counts["items"] += 1
        self.counts["prompt_chars"] += sum(len(m.get("content") or "") for m in it["messages"])

    def fill(self, summary: Summary) -> None:
        """Put the counts into SUMMARY: each converted record's bucket from its flags."""
        buckets = Counter[str]()
        for value in range(64):
            if value & Flag.CONVERTED and (n := self.flags.count(value)):
                buckets[bucket(value)] += n
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
        summary.estimated_output_tokens = estimated_tokens(self.counts["output_chars"], self.counts["output_items"],
                                                           self.counts["output_answered"])


def view_summary(v: QueueView) -> dict[str, Any]:
    """What the summary's `queue_view` says of the view V."""
    return {"live_jobs": v.live_jobs, "live_items": len(v.live), "failed_jobs": v.failed_jobs,
            "claims_held_by_others": v.held_claims, "claimed_items_held": v.held_items,
            "held_claim_oldest_s": v.held_oldest_s, "claims_taken_over": v.taken_over_claims,
            "claimed_items_taken_over": v.taken_over_items, "seconds": round(v.seconds, 3),
            "malformed_jobs": v.malformed_jobs}
