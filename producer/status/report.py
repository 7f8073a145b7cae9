"""The shape of what `producer status` reports of a run (its --json, and what its screen is
drawn from): core.py fills it, figures.py and cost.py make its figures (the cost's shape is
cost.py's, CostView), screen.py draws it. Types only.
"""

from __future__ import annotations

from typing import Any, Required, TypedDict

from genqueue.common.acceptance import Figures
from genqueue.common.engineview import EngineView
from genqueue.common.keepers.captured import CaptureFigures
from genqueue.common.keepers.outcomes import FailedJobsView, OutcomeView
from genqueue.common.keepers.pause import PauseInfo
from genqueue.common.keepers.rqaccess import JobCounts
from genqueue.producer.status.cost import CostView
from genqueue.producer.status.tables import LogprobsView


class ReadCounts(TypedDict):
    """What was read: of one input (FileView), or of all of them added up (InputView)."""

    records: int
    complete: bool
    rejected: int
    rejected_by_reason: dict[str, int]
    multi_turn_records: int
    user_turns: int
    stopped_at_tool_turn: int


class FileView(ReadCounts):
    """What was read of one input."""

    name: str


class InputView(ReadCounts):
    """What was read of every input, and which an enqueue is reading now (name -> since)."""

    files: list[FileView]
    reading: dict[str, float]


class ShareShipping(TypedDict, total=False):
    """A consumer's shipping of one run, as its snapshot says (contracts.RunShippingView, or
    the consumer-wide ShippingView of a snapshot of the first shape): any field may be missing."""

    shards: int
    bytes: int
    waiting_shards: int
    unshipped_records: int
    last_upload_at: float | None
    oldest_waiting_at: float | None
    last_error: object  # text, or {"class"|"type", "message"}: core._split_error reads both


class RunShare(TypedDict):
    """A consumer's figures for one run: in flight, waiting for a slot, jobs held, shipping."""

    in_flight: int
    pending_items: int
    held_jobs: int
    shipping: ShareShipping


#: A consumer's last shipping error (`class` is a keyword, hence the functional form).
ShippingError = TypedDict("ShippingError", {"worker": str, "class": str, "message": str,
                                            "at": float | None, "age_s": float | None})


class ShippingSummary(TypedDict):
    """What the consumers of a run say about shipping its shards, summed."""

    shards: int
    bytes: int
    waiting_shards: int
    unshipped_records: int
    last_upload_at: float | None
    oldest_waiting_s: float | None
    warn_after_s: float
    stalled: bool
    errors: list[ShippingError]


class EngineRow(EngineView, total=False):
    """A consumer's engine as its row shows it: the engine's own view and what it serves."""

    models: list[str] | None
    max_model_len: dict[str, int | None] | None


class ConsumerRow(TypedDict):
    """A consumer as seen from one run: the run's rates and its share."""

    worker: str
    host: str | None
    gpu: int | None
    state: str  # a snapshots.ConsumerState: live, exited, silent
    gone: bool  # exited or silent: every figure below is what it last said, not what is so now
    live: bool
    exited: bool
    age_s: float
    completions_per_s: float
    completion_tokens_per_s: float
    in_flight: int
    pending_items: int
    held_jobs: int
    runs_served: int
    paused: list[str]
    version: str | None
    paused_detail: dict[str, str]
    engine: EngineRow | None  # its engine now; None once it has gone (no one reads that engine for it)
    last_engine: EngineRow | None  # a gone consumer's engine and verdict at its last report (None while live)
    shipping: ShareShipping  # its last_error redacted
    reasoning_probe: str | None
    clock_offset: float | None
    copies: dict[str, int]  # the end of a run's copies, consumer-wide (ConsumerSnapshot.copies)
    phase: str | None  # what it waits on while it starts (None: it serves)
    phase_s: float | None  # for how long, at status's now


class StartingRow(TypedDict):
    """A live consumer that may serve the run and is still starting (its pre-flight, ...)."""

    worker: str
    host: str | None
    gpu: int | None
    phase: str
    phase_s: float  # in that phase for this long, at status's now


class HostView(TypedDict):
    """Per host: its live consumers that serve the run, those that refuse it, the first reason."""

    serving: int
    refusing: int
    reason: str | None


class Rates(TypedDict):
    completions_per_s: float | None
    prompt_tokens_per_s: float | None
    completion_tokens_per_s: float | None


class SpeedView(TypedDict, total=False):
    last_minute: Required[Rates]
    note: Required[str | None]  # why the last minute's rate is blank
    run_average: Required[Rates]  # over the time the run ran (run_seconds), not until now once it is over
    run_seconds: float | None  # from its first job's start to now, or to ended_at once it is over
    ended_at: float | None  # when its last item was marked, once it is over (None: running, or not recorded)


class FingerprintRow(TypedDict):
    fingerprint: str
    since: float


class OutputPlacement(TypedDict):
    host: str | None
    shared_fs: bool
    where: str


class FleetShare(TypedDict):
    """This run's requests in flight on its live consumers, of all they have in flight."""

    in_flight: int
    of: int
    consumers: int


class SpecCategory(Figures):
    """The acceptance of one category (common.acceptance.figures of its tally)."""

    category: str


class SpecEngine(Figures):
    """One consumer's acceptance on the run: what it wrote, shipped or not (its snapshot's `spec`)."""

    worker: str
    live: bool


class SpecWeakest(TypedDict):
    """The category furthest below the run's rate (of SPEC_MIN_ANSWERS answers at least)."""

    facet: str  # common.acceptance.Facet
    category: str
    answers: int
    rate: float
    overall_rate: float
    line: str  # "drafter weakest on source weak.jsonl: 35% vs 70% overall"


class SpeculationView(Figures):
    """The run's speculative-decoding acceptance: overall and per facet (source, variant, turn,
    length: a row per category) from the answers shipped, counted once per item, and per engine."""

    by: dict[str, list[SpecCategory]]  # facet -> its categories
    weakest: SpecWeakest | None
    engines: list[SpecEngine]


class ClaimedView(TypedDict):
    """Items a producer claimed and has not put in a job (common.keepers.claims.HeldClaims),
    looked for only when some items are in no job and in no consumer."""

    claims: int
    items: int
    oldest_s: int
    stale: int  # claims older than CLAIM_GRACE: their producer stopped before queueing them
    line: str  # what they mean, in one line ("" when there are none)


#: A --capture run's capture and what of it has shipped (common/keepers/captured.py: the one
#: computation status and the card share).
CaptureView = CaptureFigures


class StatusReport(OutcomeView, total=False):
    """Everything `producer status` shows about one run, as plain data (its --json)."""

    run: Required[str]
    now: Required[float]
    state: Required[str]  # the run's state, `producer runs`' too (common/keepers/runstate.py)
    paused: Required[PauseInfo | None]
    fingerprint: Required[str]
    fingerprints: Required[list[FingerprintRow]]
    version: Required[str]
    settings: Required[dict[str, Any]]  # RunSettings.to_dict()
    created_at: Required[float]
    started_at: Required[float | None]
    input: Required[InputView]
    records: Required[int]
    rejected: Required[int]
    rejected_by_reason: Required[dict[str, int]]
    turns_generated: Required[int]
    items: Required[int]
    items_done: Required[int]
    items_failed: Required[int]
    items_in_flight: Required[int]
    items_shipping: Required[int]
    items_queued: Required[int]
    items_elsewhere: Required[int]
    claimed: Required[ClaimedView]
    completion_tokens: Required[int]
    prompt_tokens: Required[int]
    warnings: Required[dict[str, str]]
    jobs: Required[JobCounts]
    malformed_jobs: Required[list[dict[str, str]]]
    failed_jobs: FailedJobsView  # the jobs rq gave up on, by class
    refused: Required[int]
    refused_jobs: Required[dict[str, str]]
    queue: Required[str]
    next_steps: str  # once the cause of a pause or of failed items is fixed: the commands ("": none needed)
    speed: Required[SpeedView]
    eta_s: Required[float | None]
    eta_assumes_completion_tokens_per_s: Required[float | None]
    eta_basis: str | None  # what eta_s assumes: "completion_tokens" or "items" a second (None: no ETA)
    starting: list[StartingRow]  # consumers that may serve the run, still starting
    acked_tokens: dict[str, int]  # prompt and completion tokens of the acked jobs (the run's stats)
    tokens_per_item: float | None  # completion tokens per item generated so far (the ETA's)
    shipping: Required[ShippingSummary]
    consumers: Required[list[ConsumerRow]]
    versions: Required[list[str]]
    drift: Required[list[str]]
    # the screen draws these rows only when they are there
    cost: CostView
    output_placement: OutputPlacement
    hosts: dict[str, HostView]
    priority: int
    share: FleetShare
    speculation: SpeculationView | None  # None: the run has no speculative-decoding figures
    capture: CaptureView | None  # None: the run captures nothing (no --capture)
    logprobs: LogprobsView | None  # None: the run records no log-probabilities (no --logprobs)
