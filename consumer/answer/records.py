"""The records an item becomes (pure: no I/O, no clock but what the caller passes).

A record is complete when this module returns it: `record` turns what answering an item came
to (an `Ending`: one answer, a cut answer, a failed request, a refused item, a regenerated
conversation, a crash) into the item's record, its `timings` and its `copy` mark included, and
nobody adds to it afterwards. Its parts: what every record carries (`record_base`: the item's
key and provenance, the run, the sampling it was sent with, fingerprint, consumer), a result
record from one answer (`result_record`), a regenerated conversation's record from its turns
(`turn_record`, `conversation_record`, with its `stopped` note), the history message an answer
becomes (`assistant_message`; `answered_turn` gives both), and error records. `error_record` is
the one place an error record is made: for a request that failed (`fault_error`, its class
from faults.py), an answer cut under --truncation error (`truncated_error`), and an item whose
answering raised where nothing should (`internal_error`, used by generate.py and dispatch.py
alike). The shapes are the TypedDicts of common/contracts.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

from genqueue.common import __version__
from genqueue.common.contracts import ChatMessage, ErrorClass, HistoryReasoning, Item, Note, Outcome, ReasoningForm
from genqueue.common.records import (
    CallSummary,
    ConsumerInfo,
    ErrorInfo,
    ErrorRecord,
    FeatureRef,
    LogprobsRef,
    PartialAnswer,
    RecordBase,
    ResultRecord,
    Stopped,
    Timings,
    TruncationNote,
    TurnRecord,
    Usage,
    error_info,
    share_prompts,
    sum_spec,
)
from genqueue.common.requests import RequestShape, item_seed
from genqueue.common.variants import Variant
from genqueue.consumer.answer.completion import Turn
from genqueue.consumer.answer.faults import EndpointError, error_class

__all__ = ["Answered", "Conversation", "Crashed", "Cut", "Ending", "Failed", "Prefilled", "Refused", "RunFacts",
           "answered_turn", "assistant_message", "conversation_record", "error_record", "fault_error", "fault_info",
           "internal_error", "messages_of", "record", "record_base", "result_record", "stop", "timings",
           "truncated_error", "truncated_info", "turn_record"]

#: An internal error's message is cut to this many characters (a repr can be huge).
INTERNAL_MESSAGE_CHARS = 1000


class RunFacts(Protocol):
    """What a record says of the run it belongs to (generate.RunContext is one)."""

    @property
    def run(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def shape(self) -> RequestShape: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def consumer(self) -> ConsumerInfo: ...
    @property
    def variant(self) -> Variant | None: ...
    @property
    def drafter(self) -> str | None: ...


def messages_of(item: Item) -> list[ChatMessage]:
    """ITEM's messages as Messages: intake has checked each one (a known role, string
    content) before an item reaches the generator."""
    return cast(list[ChatMessage], item["messages"])


def record_base(ctx: RunFacts, item: Item, attempt: int, messages: list[ChatMessage]) -> RecordBase:
    """The fields every record carries. Reads ITEM defensively: it also builds the record of
    an item that made answering fail (then it may not even be a dict)."""
    get: Callable[..., Any] = item.get if isinstance(item, dict) else _NOTHING.get  # once per item
    key, index, turn, seed = get("key", ""), get("index", -1), get("turn"), item_seed(item)
    base: RecordBase = {
        "key": key if isinstance(key, str) else str(key),
        "index": index if isinstance(index, int) else -1,
        "turn": turn if isinstance(turn, int) else None,
        "run": ctx.run,
        "messages": messages,
        "sampling": ctx.shape.sampling_of(seed),
        "fingerprint": ctx.fingerprint,
        "version": __version__,
        "consumer": ctx.consumer,
        "attempt": attempt,
    }
    tools, note = get("tools"), get("note")
    if tools:
        base["tools"] = tools
    if isinstance(note, str) and note:
        base["note"] = note
    if ctx.variant is not None:
        base["variant"] = ctx.variant.name
    if ctx.drafter is not None:
        base["drafter"] = ctx.drafter
    # provenance: the input record's id, its source and place, the sample (the export's order)
    for name in ("id", "source"):
        text = get(name)
        if isinstance(text, str):
            base[name] = text
    for field_ in ("source_seq", "sample", "seed"):
        number = get(field_)
        if isinstance(number, int) and not isinstance(number, bool):
            base[field_] = number
    return base


_NOTHING: dict[str, object] = {}


def result_record(base: RecordBase, turn: Turn, model: str, truncation: TruncationNote | None = None) -> ResultRecord:
    """The record of an item answered by TURN (MODEL: the run's, when the answer names none;
    TRUNCATION: what the truncation policy did, when it did anything)."""
    # cast, then typed assignments: a TypedDict literal cannot spread RecordBase under mypy's
    # strict extra checks.
    rec = cast(ResultRecord, dict(base))
    rec["content"] = turn.content
    rec["reasoning"] = turn.reasoning
    rec["reasoning_form"] = turn.reasoning_form
    rec["tool_calls"] = turn.tool_calls
    rec["finish_reason"] = turn.finish_reason
    rec["outcome"] = turn.outcome
    rec["usage"] = turn.usage
    rec["model"] = turn.model or model
    if turn.token_ids is not None:
        rec["token_ids"] = turn.token_ids
    if turn.spec is not None:
        rec["spec"] = turn.spec
    if turn.features is not None:
        rec["features"] = turn.features
    if turn.tables is not None:
        rec["logprobs"] = turn.tables
    if truncation is not None:
        rec["truncation"] = truncation
    return rec


def prefilled_record(base: RecordBase, done: Prefilled, model: str) -> ResultRecord:
    """The record of a capture pass's item: no text, its row's features or tables, the source run
    it captured."""
    rec = cast(ResultRecord, dict(base))
    rec.update({"content": "", "reasoning": None, "reasoning_form": ReasoningForm.NONE, "tool_calls": [],
                "finish_reason": None, "outcome": Outcome.FINISHED, "usage": {"prompt_tokens": done.prompt_tokens},
                "model": model})
    if done.features is not None:
        rec["features"] = done.features
    if done.tables is not None:
        rec["logprobs"] = done.tables
    rec["prefill"] = done.source
    return rec


def error_record(base: RecordBase, info: ErrorInfo, partial: PartialAnswer | None = None) -> ErrorRecord:
    """The one way an error record is made."""
    rec = cast(ErrorRecord, dict(base))
    rec["error"] = info
    if partial is not None:
        rec["partial"] = partial
    return rec


def fault_info(e: EndpointError) -> ErrorInfo:
    """The `error` of a request that ended in E (its class as faults.py says)."""
    return error_info(error_class(e), type(e).__name__, str(e), e.status)


def fault_error(base: RecordBase, e: EndpointError) -> ErrorRecord:
    """The record of an item whose request ended in E."""
    return error_record(base, fault_info(e))


def truncated_info(outcome: str) -> ErrorInfo:
    """The `error` of an answer cut by max_tokens under --truncation error."""
    return error_info(ErrorClass.TRUNCATED, outcome,
                      f"the completion was cut by max_tokens ({outcome}); the run's truncation policy is error")


def truncated_error(base: RecordBase, turn: Turn) -> ErrorRecord:
    """The record of an item whose answer TURN was cut under --truncation error: what it did
    say is kept as `partial`."""
    partial: PartialAnswer = {"content": turn.content, "reasoning": turn.reasoning,
                              "finish_reason": turn.finish_reason, "usage": turn.usage}
    return error_record(base, truncated_info(turn.outcome), partial)


def internal_error(ctx: RunFacts, item: Item, attempt: int, e: BaseException) -> ErrorRecord:
    """The record of an item whose answering raised where nothing should (a genqueue bug).
    ITEM is read defensively: it may be what made answering fail."""
    msgs = item.get("messages", []) if isinstance(item, dict) else []
    base = record_base(ctx, item, attempt, cast(list[ChatMessage], msgs) if isinstance(msgs, list) else [])
    message = f"{type(e).__name__}: {e}"[:INTERNAL_MESSAGE_CHARS]
    return error_record(base, error_info(ErrorClass.INTERNAL, type(e).__name__, message))


def timings(enqueued_at: float | None, started_at: float, finished_at: float, latency_s: float) -> Timings:
    """A record's `timings` (latency rounded to 0.1 ms)."""
    return {"enqueued_at": enqueued_at, "started_at": started_at, "finished_at": finished_at,
            "latency_s": round(latency_s, 4)}


def turn_record(turn: Turn, user_turn: int, step: int, note: TruncationNote | None, model: str,
                spliced: bool | None = None) -> TurnRecord:
    """regenerate: the `turns` entry of one answer (STEP: its place after tool results;
    SPLICED: whether the recorded tool results were spliced in after it, None when the answer
    made no call and the recording none either)."""
    entry: TurnRecord = {
        "turn": user_turn, "content": turn.content, "reasoning": turn.reasoning,
        "reasoning_form": turn.reasoning_form, "finish_reason": turn.finish_reason,
        "outcome": turn.outcome, "usage": turn.usage, "model": turn.model or model}
    if step:
        entry["step"] = step
    if turn.tool_calls:
        entry["tool_calls"] = turn.tool_calls
    if note is not None:
        entry["truncation"] = note
    if turn.token_ids is not None:
        entry["token_ids"] = turn.token_ids
    if turn.spec is not None:
        entry["spec"] = turn.spec
    if turn.features is not None:
        entry["features"] = turn.features
    if turn.tables is not None:
        entry["logprobs"] = turn.tables
    if spliced is not None:
        entry["tool_results_spliced"] = spliced
    return entry


def answered_turn(turn: Turn, user_turn: int, step: int, note: TruncationNote | None, model: str,
                  history_reasoning: str, spliced: bool | None = None) -> tuple[TurnRecord, ChatMessage]:
    """regenerate: one answer kept, as its `turns` entry (turn_record) and the history message
    it becomes (assistant_message)."""
    return turn_record(turn, user_turn, step, note, model, spliced), assistant_message(turn, history_reasoning)


def stop(user_turn: int, step: int, reason: str, *, dropped: bool | None = None, error: ErrorInfo | None = None,
         recorded: list[CallSummary] | None = None, target: list[CallSummary] | None = None) -> Stopped:
    """The record's `stopped`: the user turn, the answer's step after tool results (when not
    the first answer), the reason and its details (only those given)."""
    stopped: Stopped = {"turn": user_turn, "reason": reason}
    if step:
        stopped["step"] = step
    if dropped is not None:
        stopped["dropped"] = dropped
    if error is not None:
        stopped["error"] = error
    if recorded is not None:
        stopped["recorded"] = recorded
    if target is not None:
        stopped["target"] = target
    return stopped


def conversation_record(base: RecordBase, turns: list[TurnRecord], history: list[ChatMessage], stopped: Stopped | None,
                        *, history_reasoning: str, turns_total: int, resumed_at: int | None) -> ResultRecord:
    """regenerate: the record of a conversation answered in TURNS (at least one), HISTORY
    being the messages as they now stand."""
    last = turns[-1]
    rec = cast(ResultRecord, dict(base))
    rec["turns"] = share_prompts(turns)  # --token-ids: the history's ids once, not once per turn
    rec["content"] = last["content"]
    rec["reasoning"] = last["reasoning"]
    rec["reasoning_form"] = last["reasoning_form"]
    rec["tool_calls"] = history[-1].get("tool_calls", []) if history[-1]["role"] == "assistant" else []
    rec["finish_reason"] = last["finish_reason"]
    # A later turn that failed leaves a conversation the target never finished: never
    # `finished`, so it stays out of a default training file. A cut turn that was kept
    # (--truncation keep) is the last turn, and its own outcome says what it is. A tool
    # call that diverged ends a conversation whose every answer is the target's own: it
    # keeps the last answer's outcome, and the note says why it ends early.
    rec["outcome"] = Outcome.PARTIAL if stopped is not None and "error" in stopped else last["outcome"]
    rec["usage"] = sum_usage(t["usage"] for t in turns)
    if (spec := sum_spec([t["spec"] for t in turns if "spec" in t])) is not None:
        rec["spec"] = spec  # the sum of the turns that carry figures
    rec["model"] = last["model"]
    rec["history_reasoning"] = history_reasoning
    rec["turns_total"] = turns_total
    if stopped is not None:
        rec["stopped"] = stopped
        if stopped["reason"] == Note.TOOL_CALL_DIVERGED:
            rec["note"] = Note.TOOL_CALL_DIVERGED
    if "truncation" in last:
        rec["truncation"] = last["truncation"]
    if resumed_at is not None:
        rec["resumed_at_turn"] = resumed_at
    return rec


def assistant_message(turn: Turn, history_reasoning: str) -> ChatMessage:
    """The history message TURN becomes, for the next turn's request."""
    msg: ChatMessage = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        msg["tool_calls"] = turn.tool_calls
    if history_reasoning == HistoryReasoning.KEEP and turn.reasoning:
        # vLLM's Qwen3-style templates read the thinking of earlier turns from this field.
        msg["reasoning_content"] = turn.reasoning
    return msg


_USAGE_KEYS: tuple[Literal["prompt_tokens", "completion_tokens", "total_tokens", "reasoning_tokens"], ...] = (
    "prompt_tokens", "completion_tokens", "total_tokens", "reasoning_tokens")


def sum_usage(usages: Iterable[Usage]) -> Usage:
    """The token counts of several answers, added up (a count none of them has stays absent)."""
    total: Usage = {}
    for u in usages:
        for k in _USAGE_KEYS:
            v = u.get(k)
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
    return total


# --- what answering an item came to, and the one record it becomes --------------------------

@dataclass(frozen=True, slots=True)
class Answered:
    """One answer to the item's MESSAGES (modes first/last/each), with what the truncation
    policy did (None: nothing)."""

    messages: list[ChatMessage]
    turn: Turn
    truncation: TruncationNote | None = None


@dataclass(frozen=True, slots=True)
class Cut:
    """An answer cut by max_tokens under --truncation error, before any turn was kept: an
    error record keeping what it said."""

    messages: list[ChatMessage]
    turn: Turn


@dataclass(frozen=True, slots=True)
class Failed:
    """A request that failed for good (past its attempts, or refused) before any turn was kept."""

    messages: list[ChatMessage]
    error: EndpointError


@dataclass(frozen=True, slots=True)
class Refused:
    """An item that cannot be answered as it is (INFO says why)."""

    messages: list[ChatMessage]
    info: ErrorInfo


@dataclass(frozen=True, slots=True)
class Conversation:
    """regenerate: a conversation answered in TURNS (at least one), HISTORY being its messages
    as they now stand, STOPPED where and why it ended early (None: it went to the end)."""

    history: list[ChatMessage]
    turns: list[TurnRecord]
    stopped: Stopped | None
    history_reasoning: str
    turns_total: int
    resumed_at: int | None = None


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A capture pass's item (consumer/answer/prefill.py): its row of SOURCE's ids, PROMPT_TOKENS
    of them, stored as FEATURES (hidden states) or as TABLES (log-probabilities)."""

    features: FeatureRef | None
    source: str
    prompt_tokens: int
    tables: LogprobsRef | None = None


@dataclass(frozen=True, slots=True)
class Crashed:
    """Answering raised where nothing should (a genqueue bug)."""

    error: BaseException


#: What answering an item came to: each becomes one record (`record`).
Ending = Answered | Cut | Failed | Refused | Conversation | Prefilled | Crashed


def record(ctx: RunFacts, item: Item, attempt: int, ending: Ending, *, timings: Timings | None = None,
           copy: bool = False) -> ResultRecord | ErrorRecord:
    """The complete record of ITEM whose answering came to ENDING: with its TIMINGS (when
    timed), and marked a COPY when it is the answer of an end-of-run copy (consumer/copies.py)."""
    rec: ResultRecord | ErrorRecord
    match ending:
        case Answered(messages, turn, truncation):
            rec = result_record(record_base(ctx, item, attempt, messages), turn, ctx.model, truncation)
        case Cut(messages, turn):
            rec = truncated_error(record_base(ctx, item, attempt, messages), turn)
        case Failed(messages, error):
            rec = fault_error(record_base(ctx, item, attempt, messages), error)
        case Refused(messages, info):
            rec = error_record(record_base(ctx, item, attempt, messages), info)
        case Conversation(history, turns, stopped, history_reasoning, turns_total, resumed_at):
            rec = conversation_record(record_base(ctx, item, attempt, history), turns, history, stopped,
                                      history_reasoning=history_reasoning, turns_total=turns_total,
                                      resumed_at=resumed_at)
        case Prefilled():
            rec = prefilled_record(record_base(ctx, item, attempt, []), ending, ctx.model)
        case Crashed(error):
            rec = internal_error(ctx, item, attempt, error)
    # the last fields, in this order: a record's JSON is the same whoever builds it
    if timings is not None:
        rec["timings"] = timings
    if copy:
        rec["copy"] = True  # said on the record: which of two racing answers ships is a race (docs/records.md)
    return rec
