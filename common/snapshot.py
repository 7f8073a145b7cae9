"""The consumer snapshot: what a consumer publishes every few seconds, read by `producer status`.

ConsumerSnapshot is what a consumer writes (consumer/telemetry.py), as JSON at
genqueue:consumer:<worker>; common/keepers/snapshots.py keeps the key and reads it back as a
ConsumerReport. Both stand on ConsumerFields, so a field is declared once: they differ only in
`paused` (a reader meets consumers of the first shape, which wrote every reason, False when not
in force) and the reader's own age and liveness.
"""

from __future__ import annotations

from typing import Required, TypedDict

from genqueue.common.engineview import EngineView


class SpecTotals(TypedDict):
    """Speculative-decoding figures summed over answers (common.acceptance.Tally's counts): what
    a consumer answered, overall and per run, in its snapshot."""

    answers: int
    steps: int
    drafted: int
    accepted: int


class RunShippingView(TypedDict):
    """One run's share of a consumer's shipping (ShippingView is the consumer's total)."""

    shards: int
    bytes: int
    waiting_shards: int
    unshipped_records: int  # written to the spool, not shipped yet
    last_upload_at: float | None
    oldest_waiting_at: float | None


class RunCounters(TypedDict, total=False):
    """A consumer's counters, one-minute rates and load for one run (the snapshot's `runs`):
    every figure here is this run's alone, whatever else the consumer serves."""

    in_flight: int
    pending_items: int
    held_jobs: int
    shipping: RunShippingView
    completions: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    completions_per_s: float
    prompt_tokens_per_s: float
    completion_tokens_per_s: float
    fingerprint: str | None
    reasoning_probe: str | None
    spec: SpecTotals  # the speculative-decoding figures of the answers it wrote (none: no figures yet)


class ShippingView(TypedDict):
    shards: int
    bytes: int
    waiting_shards: int
    spool_bytes: int
    last_upload_at: float | None
    last_error: str | None  # class and message of the last failed upload, secrets redacted
    last_error_at: float | None
    oldest_waiting_at: float | None  # when the oldest shard still waiting was sealed
    failures: int
    lost: int
    disk_error: str | None  # the spool's disk refuses writes: admission is paused


class ConsumerFields(TypedDict, total=False):
    """Every field of a consumer's snapshot but `paused`: what ConsumerSnapshot writes (every
    one of them, consumer/telemetry.py) and ConsumerReport reads back (whatever a consumer of an
    earlier shape wrote: only `worker` and `runs` are sure)."""

    worker: Required[str]
    host: str
    gpu: int | None
    gpus: int  # GPUs its engine runs on (`consumer run --engine-gpus`): GPU-hours count by it
    pid: int
    endpoint: str
    version: str
    started_at: float
    last_seen: float
    exited: bool
    concurrency: int
    concurrency_mode: str
    in_flight: int
    pending_items: int
    held_jobs: int
    stopping: bool
    runs: Required[dict[str, RunCounters]]
    models: list[str]
    max_model_len: dict[str, int | None]
    engine: EngineView
    shipping: ShippingView
    jobs: dict[str, int]  # acked, lease_lost, redone, refused, given_back, swept
    copies: dict[str, int]  # the end of a run's copies (consumer/copies.py): sent, shipped, dropped, yielded, ended_elsewhere
    redis_unreachable_since: float | None
    clock_offset: float | None  # Redis's clock - this node's, seconds; leases use Redis's
    phase: str | None  # what a starting consumer waits on ("pre-flight: waiting on the engine"); None once serving
    phase_s: float  # seconds in that phase at last_seen
    only_run: str | None  # the one run it serves (`consumer run --run`); None: every open run
    spool: str | None  # its spool directory: a later consumer on the same host and spool holds its lock, so this one is dead
    spec: SpecTotals  # the speculative-decoding figures of every answer it wrote (none: no figures yet)


class ConsumerSnapshot(ConsumerFields):
    """What a consumer publishes every few seconds at genqueue:consumer:<worker> (JSON), read
    by `producer status`. `paused` holds only the reasons in force, each with its message."""

    paused: dict[str, str]
