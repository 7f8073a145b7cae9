"""Reading a chat completion the way every vLLM version writes it (pure, no I/O).

A response counts only once it has been checked: a 200 whose body is empty, not JSON, not an
object, or missing or mistyping a field the record needs raises `BadResponseError`, never a
success with an empty answer and never an AttributeError inside an item's task. The check is
a handful of isinstance tests (microseconds against the ~0.1 ms the client spends per
completion).

vLLM with a reasoning parser returns the thinking in `message.reasoning` (current) or
`message.reasoning_content` (older); both names are read. Without a parser the thinking
arrives inline as `<think>…</think>` at the start of `content`; an opening tag with no
closing one means the token budget ran out inside the thinking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Required, TypedDict, cast

import orjson

from genqueue.common.contracts import Outcome, ReasoningForm, ToolCall
from genqueue.common.records import FeatureRef, LogprobsRef, SpecFigures, TokenIds, Usage
from genqueue.consumer.answer.faults import BadResponseError, TransientError
from genqueue.consumer.answer.spec import read_spec

OPEN, CLOSE = "<think>", "</think>"

#: finish_reason values that end a complete answer. "length" is a cut answer (an Outcome,
#: not an error). null is refused: a non-streaming response is only sent once generation has
#: ended, so a null reason means the server did not finish, and the text cannot be trusted.
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
#: vLLM's finish_reason for a request it aborted (engine error, shutdown): a known value,
#: but the text is a fragment, so it is a transient failure, retried like a 503.
ABORT = "abort"

#: Characters of an engine's unexpected reply quoted in the error record: enough to tell what it said.
SNIPPET_CHARS = 200
_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


class _ReplyMessage(TypedDict, total=False):
    content: str | None
    reasoning: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] | None


class _Choice(TypedDict, total=False):
    finish_reason: Required[str]
    message: Required[_ReplyMessage]
    token_ids: list[int] | None  # return_token_ids (vLLM)
    logprobs: dict[str, object] | None  # --logprobs: {"content": one entry per generated token}


class _UsageDetails(TypedDict, total=False):
    reasoning_tokens: int | None


class _ReplyUsage(TypedDict, total=False):
    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    completion_tokens_details: _UsageDetails | None


class ChatResponse(TypedDict, total=False):
    """The fields of a /v1/chat/completions body that a record reads, once `_checked` has
    found each of them of its type (the rest of the body is not read)."""

    choices: Required[list[_Choice]]
    model: str | None
    usage: _ReplyUsage | None
    prompt_token_ids: list[int] | None  # return_token_ids (vLLM)
    kv_transfer_params: dict[str, object] | None  # a capturing engine's: hidden_states_path


@dataclass(slots=True)
class Turn:
    """One assistant answer, split into its parts."""

    content: str
    reasoning: str | None
    reasoning_form: ReasoningForm
    tool_calls: list[ToolCall]
    finish_reason: str
    usage: Usage
    model: str | None
    raw_content: str = ""  # content as the server sent it, before any <think> split
    token_ids: TokenIds | None = None  # the prompt's and the answer's ids, when the server sent both
    spec: SpecFigures | None = None  # speculative-decoding figures, when the server sent them (consumer/answer/spec.py)
    spec_ignored: str | None = None  # why the server's figures were ignored (malformed; advisory, never fatal)
    capture_path: str | None = None  # a capturing engine's file of this answer's hidden states
    features: FeatureRef | None = None  # --capture: the feature row it became, once kept (generate.py)
    logprobs_content: object = None  # --logprobs: the server's logprobs.content, read when kept (capture/tables.py)
    tables: LogprobsRef | None = None  # --logprobs: the feature row its tables became, once kept (generate.py)

    @property
    def outcome(self) -> Outcome:
        empty = (not self.content or self.content.isspace()) and not self.tool_calls  # no copy, unlike strip()
        if self.finish_reason != "length":
            return Outcome.NO_ANSWER if empty and self.reasoning else Outcome.FINISHED
        return Outcome.CUT_IN_THINKING if empty else Outcome.CUT_IN_ANSWER


def snippet(raw: bytes | str) -> str:
    """At most SNIPPET_CHARS characters of a body, for an error message."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return text if len(text) <= SNIPPET_CHARS else text[: SNIPPET_CHARS - 1] + "…"


def decode_body(raw: bytes) -> dict[str, object]:
    """A 200's body as a JSON object; BadResponseError when it is empty, not JSON (or cut
    mid-JSON), or a JSON value other than an object."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if not raw.strip():  # checked only here: strip() copies the body of every good response
            raise BadResponseError("empty body", snippet="") from None
        raise BadResponseError(f"body is not JSON ({e})", snippet=snippet(raw)) from e
    if not isinstance(data, dict):
        raise BadResponseError(f"body is {_kind(data)}, not an object", snippet=snippet(raw))
    return data


def split_inline(content: str) -> tuple[str, str | None, bool]:
    """Split `<think>…</think>answer` into (answer, thinking, closed). Thinking is None when
    there is no tag; closed is False when the tag never closed (cut inside the thinking)."""
    stripped = content.lstrip()
    if stripped.startswith(OPEN):
        body = stripped[len(OPEN):]
        end = body.find(CLOSE)
        if end < 0:
            return "", body.strip("\n"), False
        return body[end + len(CLOSE):].lstrip("\n"), body[:end].strip("\n"), True
    # Some templates open the thinking in the prompt, so only the closing tag comes back.
    end = content.find(CLOSE)
    if end >= 0 and OPEN not in content[:end]:
        return content[end + len(CLOSE):].lstrip("\n"), content[:end].strip("\n"), True
    return content, None, True


def parse_completion(resp: object, *, think_opened: bool = False) -> Turn:
    """Turn a /v1/chat/completions response body into a Turn, after checking it.

    Raises BadResponseError for a body that is not a usable completion, TransientError for
    one the server aborted. think_opened: the server's chat template opens `<think>` in the
    prompt (learned by the consumer's probe), so a reply with no tag at all that was cut by
    the budget is all thinking.
    """
    body = _checked(resp)
    choice = body["choices"][0]
    msg = choice["message"]
    content = raw = msg.get("content") or ""
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    form = ReasoningForm.FIELD if reasoning is not None else ReasoningForm.NONE
    finish = choice["finish_reason"]
    if reasoning is None:
        answer, thinking, _closed = split_inline(content)
        if thinking is not None:
            content, reasoning, form = answer, thinking, ReasoningForm.INLINE
        elif think_opened and finish == "length" and content:
            content, reasoning, form = "", content, ReasoningForm.INLINE
    model = body.get("model")
    prompt_ids, completion_ids = body.get("prompt_token_ids"), choice.get("token_ids")
    ids: TokenIds | None = None
    if prompt_ids is not None and completion_ids is not None:
        ids = {"prompt": prompt_ids, "completion": completion_ids}
    spec, spec_ignored = read_spec(cast(dict[str, object], body))
    kv = body.get("kv_transfer_params") or {}
    path = kv.get("hidden_states_path")
    return Turn(
        content=content,
        raw_content=raw,
        reasoning=reasoning,
        reasoning_form=form,
        tool_calls=list(msg.get("tool_calls") or []),
        finish_reason=finish,
        usage=_usage(body.get("usage")),
        model=model,
        token_ids=ids,
        spec=spec,
        spec_ignored=spec_ignored,
        capture_path=path if isinstance(path, str) else None,
        logprobs_content=(choice.get("logprobs") or {}).get("content"),
    )


def _checked(resp: object) -> ChatResponse:
    """RESP as a ChatResponse, once it has the shape a completion must have."""
    if not isinstance(resp, dict):
        raise _bad(resp, f"body is {_kind(resp)}, not an object")
    choices = resp.get("choices")
    if not isinstance(choices, list):
        raise _bad(resp, f"choices is {_kind(choices)}, not a list")
    if not choices:
        raise _bad(resp, "choices is an empty list")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise _bad(resp, f"choices[0] is {_kind(choice)}, not an object")
    msg = choice.get("message")
    if not isinstance(msg, dict):
        raise _bad(resp, f"choices[0].message is {_kind(msg)}, not an object")
    for name in ("content", "reasoning", "reasoning_content"):
        value = msg.get(name)
        if value is not None and not isinstance(value, str):
            raise _bad(resp, f"message.{name} is {_kind(value)}, not a string")
    calls = msg.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise _bad(resp, "message.tool_calls is not a list of objects")
    finish = choice.get("finish_reason")
    if finish == ABORT:
        raise TransientError("the server aborted the request (finish_reason 'abort')", status=200)
    if finish not in FINISH_REASONS:
        raise _bad(resp, f"unknown finish_reason {finish!r}")
    usage = resp.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            raise _bad(resp, f"usage is {_kind(usage)}, not an object")
        for key in _COUNTS:
            if not _count_or_none(usage.get(key)):
                raise _bad(resp, f"usage.{key} is {_kind(usage.get(key))}, not a count")
        details = usage.get("completion_tokens_details")
        if details is not None and not (isinstance(details, dict)
                                        and _count_or_none(details.get("reasoning_tokens"))):
            raise _bad(resp, "usage.completion_tokens_details is not an object of counts")
    model = resp.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(resp, f"model is {_kind(model)}, not a string")
    if (lp := choice.get("logprobs")) is not None and not isinstance(lp, dict):
        raise _bad(resp, f"choices[0].logprobs is {_kind(lp)}, not an object")
    kv = resp.get("kv_transfer_params")
    if kv is not None and not (isinstance(kv, dict) and isinstance(kv.get("hidden_states_path", ""), str)):
        raise _bad(resp, "kv_transfer_params is not an object with a string hidden_states_path")
    for where, ids in (("prompt_token_ids", resp.get("prompt_token_ids")),
                       ("choices[0].token_ids", choice.get("token_ids"))):
        if ids is not None and not _is_ids(ids):
            raise _bad(resp, f"{where} is not a list of token ids")
    return cast(ChatResponse, resp)


def _is_ids(value: object) -> bool:
    """Whether VALUE is a list of token ids (only read when the run asked for them)."""
    return isinstance(value, list) and all(type(i) is int and i >= 0 for i in value)


def _bad(resp: object, reason: str) -> BadResponseError:
    try:
        text = orjson.dumps(resp).decode()
    except TypeError:
        text = repr(resp)
    return BadResponseError(reason, snippet=snippet(text))


def _usage(raw: _ReplyUsage | None) -> Usage:
    usage: Usage = {}
    if not raw:
        return usage
    if (prompt := raw.get("prompt_tokens")) is not None:
        usage["prompt_tokens"] = prompt
    if (completion := raw.get("completion_tokens")) is not None:
        usage["completion_tokens"] = completion
    if (total := raw.get("total_tokens")) is not None:
        usage["total_tokens"] = total
    details = raw.get("completion_tokens_details") or {}
    if (reasoning := details.get("reasoning_tokens")) is not None:
        usage["reasoning_tokens"] = reasoning
    return usage


def _count_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _kind(value: object) -> str:
    """A JSON-ish name for VALUE's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
