"""What a consumer reads of its engine: the readings of vLLM's /metrics, and the doctor's verdict.

ENGINE_READINGS is the one table of readings: the parse (consumer/engine/readings.py), the
consumer's gauges (consumer/telemetry.py) and status' engine line follow from it, and EngineView
holds one field per row (tests/consumer/test_readings.py holds the two equal). EngineView is what
a consumer reports of its engine in its snapshot, with the engine doctor's verdict (EngineBound,
SpecPays: consumer/engine/doctor.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Required, TypedDict


class EngineBound(StrEnum):
    """What binds an engine now: the engine doctor's verdict (consumer/engine/doctor.py)."""

    UNKNOWN = "unknown"  # no /metrics, or too few samples yet
    IDLE = "idle"  # nothing running and nothing left to send
    ENGINE = "engine"  # the engine computes at the batch it holds: nothing to change from here
    BATCH_CAP = "batch_cap"  # running pinned at --max-num-seqs while requests wait, KV has room
    MEMORY = "memory"  # KV cache near full and requests preempted: more concurrency will not help
    GENQUEUE = "genqueue"  # free slots, nothing waiting: the consumer holds back (limit, work, pause, CPU)
    TAIL = "tail"  # the run's tail: the queue is empty and a few long requests run alone
    RETRYING = "retrying"  # requests fail (dropped, refused) and sleep before a retry: the engine idles meanwhile


class EngineView(TypedDict, total=False):
    """What a consumer reports of its engine, from the engine's own /metrics, and the doctor's
    verdict on it (verdict, advice, numbers, notes)."""

    metrics: Required[bool]  # False: the endpoint has no vLLM /metrics; nothing else is set
    running: float | None
    waiting: float | None
    kv_cache_usage: float | None  # 0..1
    preemptions: float | None
    spec_decode: bool
    spec_acceptance: float | None
    # counters and cache config the doctor reads (None: the engine does not export them)
    spec_drafts: float | None
    spec_draft_tokens: float | None
    spec_accepted_tokens: float | None
    prefix_queries: float | None
    prefix_hits: float | None
    prompt_tokens: float | None
    generation_tokens: float | None
    block_size: int | None
    num_gpu_blocks: int | None
    prefix_caching: bool | None
    verdict: str  # an EngineBound
    advice: str  # the verdict in plain words, with the change it suggests
    numbers: dict[str, float | int | str | None]  # the numbers behind it
    notes: list[str]  # speculative decoding and prefix cache, in plain words
    spec_verdict: str  # a SpecPays: whether speculation pays at this load (held as `verdict` is)


class SpecPays(StrEnum):
    """The doctor's judgement of speculative decoding at the engine's load (consumer/engine/doctor.py)."""

    PAYS = "pays"
    EVEN = "even"  # within the margin of breaking even
    COSTS = "costs"


class ReadingKind(StrEnum):
    """How a reading is read from vLLM's /metrics (consumer/engine/readings.py)."""

    GAUGE = "gauge"  # summed over label sets (requests add up over a data-parallel engine's replicas)
    FRACTION = "fraction"  # a gauge 0..1 per replica: the fullest replica (the max over label sets)
    COUNTER = "counter"  # summed over label sets; the doctor reads its change over its window
    CONFIG_INT = "config_int"  # a label of vllm:cache_config_info, as an int
    CONFIG_BOOL = "config_bool"  # a label of vllm:cache_config_info, "True"/"False"


class Shown(StrEnum):
    """How `producer status` shows a reading on a consumer's engine line."""

    COUNT = "count"  # 12
    PERCENT = "percent"  # a fraction as 85%


@dataclass(frozen=True, slots=True)
class Exported:
    """The consumer's own Prometheus gauge for a reading (consumer/telemetry.py)."""

    name: str
    help: str
    absent_without_reading: bool = False  # True: no sample until the engine gives one (else 0)


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One figure of the engine's own /metrics: the EngineView field it fills (`key`), the names
    vLLM gives it (across versions: the first present wins; the label name for CONFIG_*), how it
    is read, and how the consumer exports it and `producer status` shows it (None: it is not)."""

    key: str
    names: tuple[str, ...]
    kind: ReadingKind
    exported: Exported | None = None
    status: tuple[str, Shown] | None = None  # (label, form) on the engine line, after "engine R/W"


#: The metric carrying the CONFIG_* readings as labels.
CACHE_CONFIG_INFO = "vllm:cache_config_info"

#: Every reading of the engine's /metrics, in EngineView's order: the parse (readings.py), the
#: consumer's gauges (telemetry.py) and status' engine line follow from it; EngineView holds one
#: field per row (tests/consumer/test_readings.py holds the two equal). A reading the engine does
#: not export is None in the view.
ENGINE_READINGS: tuple[EngineReading, ...] = (
    EngineReading("running", ("vllm:num_requests_running",), ReadingKind.GAUGE,
                  Exported("genqueue_engine_running", "Requests the engine runs (its own /metrics)")),
    EngineReading("waiting", ("vllm:num_requests_waiting",), ReadingKind.GAUGE,
                  Exported("genqueue_engine_waiting", "Requests waiting in the engine (its own /metrics)")),
    # the KV-cache gauge was gpu_cache_usage_perc before vLLM v1
    EngineReading("kv_cache_usage", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), ReadingKind.FRACTION,
                  Exported("genqueue_engine_kv_cache_usage", "Engine KV cache usage, 0..1 (its own /metrics); "
                           "absent while the engine reports none", absent_without_reading=True),
                  ("KV", Shown.PERCENT)),
    EngineReading("preemptions", ("vllm:num_preemptions_total",), ReadingKind.COUNTER),
    EngineReading("spec_drafts", ("vllm:spec_decode_num_drafts_total",), ReadingKind.COUNTER),
    EngineReading("spec_draft_tokens", ("vllm:spec_decode_num_draft_tokens_total",), ReadingKind.COUNTER),
    EngineReading("spec_accepted_tokens", ("vllm:spec_decode_num_accepted_tokens_total",), ReadingKind.COUNTER),
    EngineReading("prefix_queries", ("vllm:prefix_cache_queries_total",), ReadingKind.COUNTER),
    EngineReading("prefix_hits", ("vllm:prefix_cache_hits_total",), ReadingKind.COUNTER),
    EngineReading("prompt_tokens", ("vllm:prompt_tokens_total",), ReadingKind.COUNTER),
    EngineReading("generation_tokens", ("vllm:generation_tokens_total",), ReadingKind.COUNTER),
    EngineReading("block_size", ("block_size",), ReadingKind.CONFIG_INT),
    EngineReading("num_gpu_blocks", ("num_gpu_blocks",), ReadingKind.CONFIG_INT),
    EngineReading("prefix_caching", ("enable_prefix_caching",), ReadingKind.CONFIG_BOOL),
)
