"""The data contract: every name and record that crosses a process boundary, defined once.

Producer, consumer, export and status all import from here. Names (modes, outcomes, error
classes...) are StrEnums: they compare equal to the plain strings stored in Redis and in
JSONL, so records written before these types existed read the same. Records are TypedDicts:
they are parsed from JSON far more often than built, and stay plain dicts on the wire.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, NotRequired, Required, TypedDict, TypeGuard, cast, final


class Mode(StrEnum):
    """How a multi-turn conversation becomes items (docs/enqueue.md, "Multi-turn modes")."""

    FIRST = "first"
    LAST = "last"
    EACH = "each"
    REGENERATE = "regenerate"


class Truncation(StrEnum):
    """What an item cut by max_tokens becomes."""

    KEEP = "keep"
    ERROR = "error"
    RETRY = "retry"


class HistoryReasoning(StrEnum):
    """regenerate: whether a turn's thinking goes back into the history."""

    DROP = "drop"
    KEEP = "keep"


class Outcome(StrEnum):
    """How one answer ended. NO_ANSWER: stopped by itself with thinking and no answer.
    PARTIAL (a record's outcome, never a turn's): a `regenerate` conversation whose later turn
    failed (an error, or a cut turn dropped under --truncation error) after at least one good
    turn; `stopped` says which turn and its error class."""

    FINISHED = "finished"
    CUT_IN_THINKING = "cut_in_thinking"
    CUT_IN_ANSWER = "cut_in_answer"
    NO_ANSWER = "no_answer"
    PARTIAL = "partial"


class ReasoningForm(StrEnum):
    """Where the thinking came from: a response field, an inline <think> block, or nowhere."""

    FIELD = "field"
    INLINE = "inline"
    NONE = "none"


class PromptMode(StrEnum):
    """Where a run's jobs keep their items (`producer enqueue --prompts`, issue 34)."""

    INLINE = "inline"  # in the job's argument, in Redis (rq's job hash)
    REFERENCE = "reference"  # in packs in the run's output store; the job's meta names pack and block


class ErrorClass(StrEnum):
    """The class of an error record (and of a failed job, at export)."""

    PERMANENT = "permanent"  # the endpoint refused the request itself (400/404/413/422)
    TRANSIENT_EXHAUSTED = "transient_exhausted"  # 5xx, resets, timeouts past the attempt budget
    TRUNCATED = "truncated"  # cut by max_tokens under --truncation error
    BAD_RESPONSE = "bad_response"  # a 200 whose body is not a usable completion
    INTERNAL = "internal"  # a bug in genqueue while answering the item
    INVALID_ITEM = "invalid_item"  # an item a job carried that genqueue cannot answer
    JOB_FAILED = "job_failed"  # export: rq gave up on the item's job
    PACK_UNREADABLE = "pack_unreadable"  # rq gave up on the item's job by reference: its pack did not read
    BAD_CAPTURE = "bad_capture"  # --capture: the engine's hidden states do not fit the answer (never stored)
    BAD_LOGPROBS = "bad_logprobs"  # --logprobs: the engine's tables do not fit the answer (never stored)


class RejectReason(StrEnum):
    """Why an input record was rejected by the producer (the rejects file, `rejected_by_reason`)."""

    INVALID_JSON = "invalid_json"  # reader: not JSON
    INVALID_UNICODE = "invalid_unicode"  # reader or convert: not UTF-8, or a lone UTF-16 surrogate
    RECORD_TOO_LARGE = "record_too_large"  # reader: longer than max_record_bytes
    NOT_OBJECT = "not_object"
    NO_CONVERSATION = "no_conversation"
    EMPTY_CONVERSATION = "empty_conversation"
    UNKNOWN_ROLE = "unknown_role"
    MISSING_ROLE = "missing_role"
    EMPTY_MESSAGE = "empty_message"
    NON_TEXT_MESSAGE = "non_text_message"
    NO_USER_TURN = "no_user_turn"
    INVALID_TOOLS = "invalid_tools"
    TOO_LONG = "too_long"  # producer: over the user's character limit
    TOOL_TURN_FIRST = "tool_turn_first"  # regenerate: a tool call comes before any user turn
    MISSING_ID = "missing_id"  # --id-field names a field the record lacks (or holds no string/integer)
    UNSUPPORTED_REQUEST = "unsupported_request"  # a Batch API line for another endpoint or method
    SAMPLING_DIFFERS = "sampling_differs"  # a Batch API line asks for other sampling than the run's


class Note(StrEnum):
    """A `regenerate` record's `note`: why the conversation ends before the recorded one did."""

    STOPPED_AT_TOOL_TURN = "stopped_at_tool_turn"  # producer: a recorded tool call without its results
    TOOL_CALL_DIVERGED = "tool_call_diverged"  # consumer: the target's tool call is not the recorded one


class ToolTurns(StrEnum):
    """What became of a `regenerate` conversation's recorded tool turns, in the words (and the
    --json keys) both `producer status` and `producer export` count them by
    (common/marks.record_tool_turns tells which)."""

    TO_END = "tool_turns_to_end"  # regenerated to the end through the recorded tool results
    DIVERGED = "tool_call_diverged"  # stopped at a divergence: the target's call is not the recorded one
    STOPPED = "stopped_at_tool_turn"  # stopped at a tool turn for another reason (producer's cut, a failed step)


class ExitCode(IntEnum):
    """How `consumer run` ended, as its exit status: what a scheduler (Slurm, Kubernetes,
    `consumer launch`) may do next. A --burst end names what kept it from finishing; when
    several apply, the highest of 3-6 is given (7 only when none of them does)."""

    DONE = 0  # --burst: every served run drained; or a signal's drain completed
    FATAL = 1  # a loop failed past its restart budget, or an unexpected error: restart it
    USAGE = 2  # a user's mistake (a bad option, --run refused at start): fix it, do not restart
    REFUSED = 3  # --burst: a run not served here (its output is another host's local path)
    PREFLIGHT = 4  # --burst: a run failed this consumer's pre-flight
    PAUSED = 5  # --burst: a run is paused (its breaker tripped; `producer resume` clears it)
    VANISHED = 6  # --burst: a run is gone from Redis (deleted, flushed, Redis restarted empty)
    FAILED_ITEMS = 7  # --burst: every served run drained, but items of one ended as errors
    INCOMPLETE = 8  # --burst: every served run drained, but items of one are in no job (the log says where)
    INTERRUPTED = 130  # stopped at once: a second signal, or the stop overran its deadline


class Usage(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    reasoning_tokens: int


class Timings(TypedDict):
    enqueued_at: float | None
    started_at: float
    finished_at: float
    latency_s: float


class ConsumerInfo(TypedDict):
    """Which consumer produced a record."""

    host: str
    gpu: int | None
    worker: str
    endpoint: str


class Role(StrEnum):
    """The role of a message, in OpenAI chat form (what `producer enqueue` normalises every
    input's roles to)."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class ToolFunction(TypedDict):
    """The function of a tool call: its name and its arguments, a JSON string as OpenAI sends it."""

    name: str
    arguments: str


class ToolCall(TypedDict):
    """One call of an assistant message's `tool_calls`."""

    id: str
    type: str  # "function"
    function: ToolFunction


#: A tool's schema as the request's `tools` carries it (`{"type": "function", "function":
#: {"name", "parameters"...}}`): free-form JSON below its type, passed through untouched.
ToolSpec = dict[str, Any]


class ChatMessage(TypedDict, total=False):
    """One message of a conversation in OpenAI chat form, as items and records hold it:
    `{"role": "system"|"user", "content"}`, `{"role": "assistant", "content"[, "tool_calls"]}`,
    `{"role": "tool", "content", "tool_call_id"}`. The export adds an answer's thinking as
    `reasoning_content`. `content` is a string as the producer writes it; a job made by hand
    may leave it null beside tool calls."""

    role: Required[str]  # a Role
    content: Required[str | None]
    tool_calls: list[ToolCall]
    tool_call_id: str | None  # null in a recording that lost it
    reasoning_content: str | None


class Item(TypedDict, total=False):
    """One unit of work, as the producer puts it in a job (JSON)."""

    key: Required[str]  # 32 hex: blake2b-128 of mode, messages and tools
    index: Required[int]  # the record's position among the input's non-blank records
    turn: Required[int | None]  # 0-based user turn (first/last/each); None in regenerate
    # The producer still builds plain dicts here; the consumer reads them as list[Message] once
    # its intake has checked each one. list[Message] here when the producer builds Messages.
    messages: Required[list[dict[str, Any]]]
    tools: list[dict[str, Any]]
    note: str  # Note: "stopped_at_tool_turn" when regenerate cut the conversation
    # provenance (never part of the key): where the item came from
    id: str  # the input record's own identifier (`id`, `custom_id`, or --id-field)
    source: str  # the input's name as given to `producer enqueue` ("-": stdin)
    source_seq: int  # the source's place among the run's sources (0 = first enqueued)
    # several samples per prompt (--samples N > 1): the sample's number and its request seed
    sample: int
    seed: int
    prefill: PrefillRow  # a capture pass's item (common/prefill.py): the row to capture; messages are empty


class PrefillRow(TypedDict, total=False):
    """A capture pass's item: the source run's feature ROW (`<key>`, or `<key>:<turn>[.<step>]`)
    and its TOKEN_IDS (the prompt the engine rendered and the ids it generated), sent as the
    prompt of a prefill-only request; COMPLETION, how many of the last ids the engine generated
    (a --logprobs pass keeps their positions' tables)."""

    row: Required[str]
    token_ids: Required[list[int]]
    completion: int


class ItemError(ValueError):
    """A value that is not an Item (parse_item says which field and why)."""


_ITEM_KEY = re.compile(r"^[0-9a-f]{32}$")
_ROLE_NAMES = frozenset(r.value for r in Role)


def parse_item(value: object, *, max_chars: int, where: str = "item") -> Item:
    """VALUE as an Item, checked field by field: the fields a request is made of (key, index,
    turn, messages with known roles and string contents and at least one user message, at most
    MAX_CHARS characters of them, tools, note). Raises ItemError naming WHERE and the field."""
    if not isinstance(value, dict):
        raise ItemError(f"{where} is a {type(value).__name__}, not an object")
    key = value.get("key")
    if not isinstance(key, str) or not _ITEM_KEY.match(key):
        raise ItemError(f"{where}: key is not 32 hex characters")
    index = value.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ItemError(f"{where}: index is not a non-negative integer")
    turn = value.get("turn")
    if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool)):
        raise ItemError(f"{where}: turn is not an integer or null")
    if "prefill" in value:
        return _prefill_item(value, where)
    messages = value.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ItemError(f"{where}: messages is not a non-empty list")
    chars = 0
    users = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLE_NAMES:
            raise ItemError(f"{where}: message {i} has no known role")
        content = m.get("content")
        if content is None and m["role"] == Role.ASSISTANT and m.get("tool_calls"):
            continue
        if not isinstance(content, str):
            raise ItemError(f"{where}: message {i} content is not a string")
        chars += len(content)
        users += m["role"] == Role.USER
    if not users:
        raise ItemError(f"{where}: no user message")
    if chars > max_chars:
        raise ItemError(f"{where}: {chars} characters of messages, over the limit of {max_chars}")
    tools = value.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ItemError(f"{where}: tools is not a list of objects")
    note = value.get("note")
    if note is not None and not isinstance(note, str):
        raise ItemError(f"{where}: note is not a string")
    return cast(Item, value)  # checked above, field by field


def _prefill_item(value: dict[str, Any], where: str) -> Item:
    """A capture pass's item: a row id and at least one token id, no messages."""
    pre = value["prefill"]
    if not isinstance(pre, dict) or not isinstance(pre.get("row"), str) or not pre["row"]:
        raise ItemError(f"{where}: prefill is not an object with a row id")
    ids = pre.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                         for i in ids):
        raise ItemError(f"{where}: prefill.token_ids is not a non-empty list of token ids")
    n = pre.get("completion", 0)
    if type(n) is not int or not 0 <= n < len(ids):
        raise ItemError(f"{where}: prefill.completion is not a count of generated ids below the ids' {len(ids)}")
    if value.get("messages") != []:
        raise ItemError(f"{where}: a prefill item carries no messages")
    return cast(Item, value)


#: The `error` field of an error record (`class` is a keyword, hence the functional form).
ErrorInfo = TypedDict("ErrorInfo", {"class": str, "type": str, "status": int | None, "message": str})


class TruncationNote(TypedDict, total=False):
    """A record's (or turn's) `truncation` under --truncation retry: how the first answer
    ended, whether it was asked again, and with which budget."""

    policy: Required[str]  # a Truncation
    first_outcome: Required[str]  # an Outcome
    retried: Required[bool]
    max_tokens: int  # the budget of the retry, when there was one


class CallSummary(TypedDict):
    """Name and arguments of one tool call, in a divergence's `stopped` note."""

    name: object
    arguments: object


class Stopped(TypedDict, total=False):
    """regenerate: where and why a conversation ended before the recorded one did."""

    turn: Required[int]  # the user turn
    reason: Required[str]  # the cut turn's Outcome, "error", or a Note
    step: int  # the answer's place after tool results, when not the user turn's first answer
    error: ErrorInfo  # a partial conversation: the failing turn's error
    dropped: bool  # the cut turn was dropped (--truncation error)
    recorded: list[CallSummary]  # tool_call_diverged: the recording's calls
    target: list[CallSummary]  # tool_call_diverged: the target's calls


class PartialAnswer(TypedDict):
    """An error record's `partial`: what a turn cut under --truncation error did say."""

    content: str
    reasoning: str | None
    finish_reason: str | None
    usage: Usage


class TokenIds(TypedDict, total=False):
    """An answer's token ids as the engine returned them (--token-ids: vLLM's
    `return_token_ids`): the prompt it rendered (`prompt_token_ids`, the whole history in
    regenerate) and the completion it generated (`choices[0].token_ids`). In a regenerate
    record an answer's prompt begins with most of the previous answer's: `prompt_shared` says
    how many of those ids it begins with, and `prompt` holds only the rest (share_prompts)."""

    prompt: Required[list[int]]
    completion: Required[list[int]]
    prompt_shared: int


def share_prompts(turns: list[TurnRecord]) -> list[TurnRecord]:
    """TURNS with each answer's prompt ids stored after what it shares with the previous
    answer's prompt (`prompt_shared`): a conversation's history is then kept once, not once
    per turn. Turns already stored so are read as they are (full_prompts)."""
    out: list[TurnRecord] = []
    prev: list[int] | None = None
    for turn, full in zip(turns, full_prompts(turns), strict=True):
        ids = turn.get("token_ids")
        if ids is not None and full is not None:
            n = _shared(prev, full) if prev is not None else 0
            shared: TokenIds = {"prompt": full[n:], "completion": ids["completion"]}
            if n:
                shared["prompt_shared"] = n
            turn = {**turn, "token_ids": shared}
        out.append(turn)
        prev = full
    return out


def full_prompts(turns: list[TurnRecord]) -> list[list[int] | None]:
    """Each answer's whole prompt ids (None: it kept none), from turns stored by share_prompts.
    Raises ValueError when an answer shares ids with a previous one that has too few."""
    out: list[list[int] | None] = []
    prev: list[int] | None = None
    for turn in turns:
        ids = turn.get("token_ids")
        full: list[int] | None = None
        if ids is not None:
            n = ids.get("prompt_shared", 0)
            if n and (prev is None or len(prev) < n):
                raise ValueError(f"turn {turn.get('turn')} shares {n} prompt ids with a previous answer that has "
                                 f"{0 if prev is None else len(prev)}")
            full = prev[:n] + ids["prompt"] if n and prev is not None else ids["prompt"]
        out.append(full)
        prev = full
    return out


def _shared(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of A and B."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # at C speed: the common case of a whole history kept
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class LogprobsRef(TypedDict):
    """Where an answer's log-probability tables are (--logprobs): row ROW of the run's feature shard
    SHARD, a table of K entries for each of its TOKENS generated tokens, stored as DTYPE. Its sampled
    ids are the answer's completion ids: checked before the row was stored
    (common/features/logprobs.py)."""

    shard: str
    row: str
    tokens: int
    k: int
    dtype: str


class FeatureRef(TypedDict):
    """Where an answer's captured features are (--capture): row ROW of the run's feature shard
    SHARD (`<output>/<run>/features/<shard>`, its index beside it), TOKENS tokens of the LAYERS
    named, stored as DTYPE. Its token ids are the answer's prompt and completion ids but the
    last completion id (which was never an input): checked before the row was stored."""

    shard: str
    row: str
    tokens: int
    layers: list[int]
    dtype: str


class SpecFigures(TypedDict):
    """An answer's speculative-decoding figures as the engine returned them (vLLM's
    `metrics.speculative_decoding`, --per-request-spec-decode-metrics summary|detailed),
    compactly: only counts, the rates are derived when read (spec_mean_length, spec_rate).

    k: the engine's num_speculative_tokens (drafts proposed per verify step at most); steps: its
    verify steps; drafted: the draft tokens proposed; accepted: those accepted; hist: hist[j] =
    the verify steps that accepted exactly j drafts (length k + 1; the bonus token not counted).
    A conversation's record holds the sum over its turns (hist padded to the largest k)."""

    k: int
    steps: int
    drafted: int
    accepted: int
    hist: list[int]


class SpecTotals(TypedDict):
    """Speculative-decoding figures summed over answers (common.acceptance.Tally's counts): what
    a consumer answered, overall and per run, in its snapshot."""

    answers: int
    steps: int
    drafted: int
    accepted: int


def spec_mean_length(spec: SpecFigures) -> float | None:
    """Tokens per verify step, the bonus token included (vLLM's mean_acceptance_length);
    None for figures with no step."""
    return 1 + spec["accepted"] / spec["steps"] if spec["steps"] else None


def spec_rate(spec: SpecFigures) -> float | None:
    """Accepted draft tokens per proposed one (vLLM's draft_acceptance_rate); None for figures
    with no draft."""
    return spec["accepted"] / spec["drafted"] if spec["drafted"] else None


def sum_spec(figures: list[SpecFigures]) -> SpecFigures | None:
    """The figures of several answers added up (None: none had any). A histogram is padded
    to the largest k: its index j still counts the steps that accepted exactly j drafts."""
    if not figures:
        return None
    k = max(f["k"] for f in figures)
    hist = [0] * (k + 1)
    for f in figures:
        for j, n in enumerate(f["hist"]):
            hist[j] += n
    return {"k": k, "steps": sum(f["steps"] for f in figures), "drafted": sum(f["drafted"] for f in figures),
            "accepted": sum(f["accepted"] for f in figures), "hist": hist}


class TurnRecord(TypedDict, total=False):
    """regenerate: one regenerated assistant turn."""

    turn: Required[int]
    content: Required[str]
    reasoning: Required[str | None]
    reasoning_form: Required[str]
    finish_reason: Required[str | None]
    outcome: Required[str]
    usage: Required[Usage]
    model: Required[str]
    truncation: TruncationNote
    # tool turns: the target's calls; whether the recorded results were spliced after them
    # (False: the call diverged from the recorded one); the answer's place after tool results
    # within its user turn (1 = the first answer after them), absent on a user turn's first answer
    tool_calls: list[ToolCall]
    tool_results_spliced: bool
    step: int
    token_ids: TokenIds  # --token-ids only
    spec: SpecFigures  # the engine returned speculative-decoding figures for this answer
    features: FeatureRef  # --capture: this answer's hidden states
    logprobs: LogprobsRef  # --logprobs: this answer's top-K tables


class RecordBase(TypedDict, total=False):
    """Fields every line of a result shard carries, result or error."""

    key: Required[str]
    index: Required[int]
    turn: Required[int | None]
    run: Required[str]
    messages: Required[list[ChatMessage]]
    sampling: Required[dict[str, Any]]
    fingerprint: Required[str]
    version: Required[str]
    consumer: Required[ConsumerInfo]
    attempt: Required[int]
    timings: Timings
    tools: list[dict[str, Any]]
    note: str
    id: str
    source: str
    source_seq: int
    sample: int
    seed: int
    variant: str  # the request variant the item was sent with, when its run declares a mix
    drafter: str  # the drafter the run evaluates, when it declares one (`producer enqueue --drafter`)
    copy: bool  # True on a result of an end-of-run copy (consumer/hedge.py): another consumer held the item


@final  # a shard line is one or the other: `"error" in rec` tells them apart
class ResultRecord(RecordBase, total=False):
    """A line of a result shard for an item that was answered (docs/records.md)."""

    content: Required[str]
    reasoning: Required[str | None]
    reasoning_form: Required[str]
    tool_calls: Required[list[ToolCall]]
    finish_reason: Required[str | None]
    outcome: Required[str]
    usage: Required[Usage]
    model: Required[str]
    truncation: TruncationNote
    token_ids: TokenIds  # --token-ids, modes first/last/each (regenerate: per turn)
    spec: SpecFigures  # speculative-decoding figures, when the engine returned them (regenerate: the turns' sum)
    features: FeatureRef  # --capture, modes first/last/each: the answer's hidden states (regenerate: per turn)
    prefill: str  # a capture pass's record (no text): the run whose answer's ids `features` captured
    logprobs: LogprobsRef  # --logprobs, modes first/last/each: the answer's top-K tables (regenerate: per turn)
    # regenerate only
    turns: list[TurnRecord]
    history_reasoning: str
    turns_total: int
    stopped: Stopped
    resumed_at_turn: int


@final
class ErrorRecord(RecordBase, total=False):
    """A line of a result shard for an item that could not be answered."""

    error: Required[ErrorInfo]
    partial: PartialAnswer


Record = ResultRecord | ErrorRecord


class JobFailedRecord(TypedDict, total=False):
    """An errors-file line the export writes for an item of a job rq gave up on, that no
    shard holds: the item's own fields and the error (class job_failed, or pack_unreadable).
    No consumer answered it, so it carries none of a record's run fields (sampling,
    fingerprint, consumer...). An item of a job whose pack cannot be read has only its key, its
    pack and slot (from the run's item table), and the error: its index and messages are in
    the pack."""

    key: Required[str]
    index: int
    turn: int | None
    run: Required[str]
    id: str
    source: str
    source_seq: int
    sample: int
    seed: int
    pack: str
    slot: int
    messages: list[dict[str, Any]]
    error: Required[ErrorInfo]


class ShardManifest(TypedDict, total=False):
    """A shipped shard's `.manifest.json`, written only once the shard is stored and verified.
    Readers rely on `sha256` and `records` alone (hand-made manifests may hold no more)."""

    run: str
    shard: str
    records: Required[int]
    keys: int
    bytes: int
    sha256: Required[str]


def is_error(rec: Record) -> TypeGuard[ErrorRecord]:
    """Whether REC is an error record."""
    return "error" in rec


def error_info(cls: ErrorClass, type_: str, message: str, status: int | None = None) -> ErrorInfo:
    """The `error` field of an error record."""
    return {"class": cls.value, "type": type_, "status": status, "message": message}


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


class ConsumerSnapshot(TypedDict):
    """What a consumer publishes every few seconds at genqueue:consumer:<worker> (JSON), read
    by `producer status`. `paused` holds only the reasons in force, each with its message."""

    worker: str
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
    paused: dict[str, str]
    runs: dict[str, RunCounters]
    models: list[str]
    max_model_len: dict[str, int | None]
    engine: EngineView
    shipping: ShippingView
    jobs: dict[str, int]  # acked, lease_lost, redone, refused, given_back, swept
    copies: dict[str, int]  # the end of a run's copies (consumer/hedge.py): sent, shipped, dropped, yielded, ended_elsewhere
    redis_unreachable_since: float | None
    clock_offset: float | None  # Redis's clock - this node's, seconds; leases use Redis's
    phase: str | None  # what a starting consumer waits on ("pre-flight: waiting on the engine"); None once serving
    phase_s: float  # seconds in that phase at last_seen
    only_run: str | None  # the one run it serves (`consumer run --run`); None: every open run
    spool: str | None  # its spool directory: a later consumer on the same host and spool holds its lock, so this one is dead
    spec: NotRequired[SpecTotals]  # the speculative-decoding figures of every answer it wrote (none: no figures yet)
