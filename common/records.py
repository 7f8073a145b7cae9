"""The records: every line a consumer writes to a result shard, and the files beside them.

A shard line is a ResultRecord (an answered item) or an ErrorRecord (`"error" in rec`:
is_error), both on RecordBase: the item's own fields, the run's, the consumer's (ConsumerInfo)
and its timings; a regenerate record holds its turns (TurnRecord). What an answer carries beside
its text when its run asks: its token ids (TokenIds: a conversation's prompts kept once,
share_prompts and full_prompts), where its hidden states and log-probability tables are stored
(FeatureRef, LogprobsRef), and the engine's speculative-decoding figures (SpecFigures). The
export writes a JobFailedRecord for an item of a job rq gave up on; a shipped shard's manifest is
a ShardManifest. TypedDicts: read from JSON far more often than built, they stay plain dicts on
the wire (docs/records.md). Reading one back (record_kind, record_turns, record_tool_turns,
record_feature_rows) is pure and never raises on a foreign field: a torn line counts as nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Required, TypedDict, TypeGuard, final

from genqueue.common.contracts import ChatMessage, ErrorClass, Note, ToolCall, ToolTurns


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
    copy: bool  # True on a result of an end-of-run copy (consumer/copies.py): another consumer held the item


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

def record_kind(rec: Mapping[str, object]) -> str:
    """The outcome of a result record, or the class of an error record ("" when neither)."""
    err = rec.get("error")
    if isinstance(err, dict):
        return str(err.get("class") or "")
    return str(rec.get("outcome") or "")


def record_turns(rec: Mapping[str, object]) -> int:
    """How many user turns a regenerate record answered (0 for any other record): the answers
    after tool results within a user turn (they have a `step`) are not turns of their own, so
    the count stays comparable with the run's user turns."""
    turns = rec.get("turns")
    return sum(1 for t in turns if not (isinstance(t, dict) and "step" in t)) if isinstance(turns, list) else 0


def record_feature_rows(rec: Mapping[str, object]) -> int:
    """How many feature rows (--capture's hidden states, or --logprobs's tables: a run stores one
    kind) a result record names: its answer's, or each regenerated turn's."""
    turns = rec.get("turns")
    answers = turns if isinstance(turns, list) else [rec]
    return sum(1 for a in answers if isinstance(a, Mapping)
               and any(isinstance(ref := a.get(f), Mapping) and "row" in ref for f in ("features", "logprobs")))


def record_tool_turns(rec: Mapping[str, object]) -> ToolTurns | None:
    """What became of a regenerate record's recorded tool turns (None: it had none, it stopped
    elsewhere, or it is no regenerate record): the one rule status and export count by.
    Regenerated to the end: tool results were spliced in and nothing stopped it."""
    turns = rec.get("turns")
    if not isinstance(turns, list):
        return None
    note, stopped = rec.get("note"), rec.get("stopped")
    stopped = stopped if isinstance(stopped, dict) else None
    if note == Note.TOOL_CALL_DIVERGED or (stopped is not None and stopped.get("reason") == Note.TOOL_CALL_DIVERGED):
        return ToolTurns.DIVERGED
    if note == Note.STOPPED_AT_TOOL_TURN or (stopped is not None and stopped.get("step")):
        return ToolTurns.STOPPED  # cut by the producer, or an answer after tool results failed or was cut
    if stopped is None and any(isinstance(t, dict) and t.get("tool_results_spliced") for t in turns):
        return ToolTurns.TO_END
    return None
