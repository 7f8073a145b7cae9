"""The contract's names and its item: what crosses a process boundary into a job, defined once.

Names (modes, outcomes, error classes, reject reasons, exit codes...) are StrEnums (exit codes an
IntEnum): they compare equal to the plain strings stored in Redis and in JSONL, so what was
written before these types existed reads the same. An Item is one unit of work as the producer
puts it in a job (JSON), its messages in OpenAI chat form (ChatMessage); `parse_item` checks one
field by field. The rest of the contract: records.py (what a consumer writes for an item),
snapshot.py (what a consumer reports of itself), engineview.py (what it reads of its engine).
"""

from __future__ import annotations

import re
from enum import IntEnum, StrEnum
from typing import Any, Required, TypedDict, cast


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
    """Where a run's jobs keep their items (`producer enqueue --prompts`)."""

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
