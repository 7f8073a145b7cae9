"""Normalise one parsed record into an OpenAI-form conversation (pure, no I/O).

Accepted input, per record (a file may mix both):

- ShareGPT: ``conversations`` = list of ``{"from", "value"}``, optional top-level ``system``
  (string) and ``tools`` (a list, or a JSON string holding one: LLaMA-Factory). Other keys
  (``id``, ``weight``, ``loss``...) are ignored.
- OpenAI chat: ``messages`` = list of ``{"role", "content"}``; ``content`` a string or a list
  of ``{"type": "text", "text"}`` parts, joined with "\\n"; assistant ``tool_calls``; tool
  messages with ``tool_call_id``; optional top-level ``tools``.
- An OpenAI Batch API request line (``custom_id``, ``method``: POST, ``url``:
  /v1/chat/completions, ``body``): the body is read as an OpenAI chat record; another endpoint
  or method is ``unsupported_request``. Its ``custom_id`` and sampling are producer.ingest.items'.

Normalised messages are ``{"role": "system"|"user", "content"}``, ``{"role": "assistant",
"content"[, "tool_calls"]}`` and ``{"role": "tool", "content", "tool_call_id"}``; the rules
(roles, tool call ids, merging, what is rejected) are `normalize`'s docstring.

No length limit here: the producer compares :meth:`Conversation.text_chars` with the
user's limit (``too_long``). Items and keys are made in :mod:`producer.ingest.items`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import orjson

from genqueue.common.contracts import ChatMessage, RejectReason, ToolCall, ToolSpec
from genqueue.producer.ingest.conversation import Conversation
from genqueue.producer.ingest.rejects import Rejected

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",
    "function_call": "function_call",
    "observation": "tool",
    "tool": "tool",
}
_SURROGATE = re.compile("[\ud800-\udfff]")
_SORT = orjson.OPT_SORT_KEYS


def normalize(value: object) -> Conversation:
    """Turn one parsed record into a Conversation; raises Rejected with the reason.

    The rules, in the order a reader of a rejects file needs them:

    - Roles (case-insensitive, stripped): human/user -> user; gpt/assistant/chatgpt/bing/bard/
      model -> assistant; system/developer -> system; function_call -> assistant with
      ``tool_calls``; observation/tool -> tool. No role: ``missing_role``; any other:
      ``unknown_role``.
    - Tool calls get ids ``call_0``, ``call_1``... numbered through the conversation (an OpenAI
      call keeps its own id). Arguments are a JSON string, as the OpenAI API sends them. A tool
      result without an id answers the earliest unanswered call of the latest assistant
      message (parallel calls are answered in order), else ``call_unknown``.
    - LLaMA-Factory tools (bare ``{"name", "parameters"}``) are wrapped as
      ``{"type": "function", "function": ...}``, the form vLLM accepts.
    - Empty system messages (top-level or in the list) are dropped; the top-level ``system``
      comes first. An empty user message, or an empty assistant message without tool calls,
      rejects the record (``empty_message``), except an empty assistant message at the very
      end, which dumps often carry (an unanswered last turn): it is dropped.
    - Merge rule: consecutive messages of the same role are merged into one, their texts joined
      with a blank line ("\\n\\n"). Assistant tool calls merge too (text then calls, or calls
      then more calls), but text after an assistant's tool calls starts a new message, and tool
      results are never merged. After merging, every user message is one turn.
    - Any string with a lone UTF-16 surrogate: ``invalid_unicode``.
    """
    if not isinstance(value, dict):
        raise Rejected(RejectReason.NOT_OBJECT, f"a JSON {type(value).__name__}, not an object")
    if "body" in value and value.get("conversations") is None and value.get("messages") is None:
        value = batch_body(value)
    raw = value.get("conversations")
    if raw is None:  # parquet gives absent columns as None, hence no `in` test
        raw = value.get("messages")
    if raw is None:
        raise Rejected(RejectReason.NO_CONVERSATION, "no 'conversations' or 'messages' key")
    if not isinstance(raw, list):
        raise Rejected(RejectReason.NO_CONVERSATION, f"the conversation is a {type(raw).__name__}")
    if not raw:
        raise Rejected(RejectReason.EMPTY_CONVERSATION)
    tools = _tools(value.get("tools"))
    system = value.get("system")
    messages = _messages(raw, None if system is None else _text(system, "system"))
    return Conversation(tuple(messages), tools)


#: The Batch API URL of a chat completion, with or without its /v1 prefix.
_CHAT_URLS = frozenset({"/v1/chat/completions", "/chat/completions"})


def batch_body(line: Mapping[str, object]) -> dict[str, object]:
    """The chat completion request body of an OpenAI Batch API input line."""
    method, url, body = line.get("method", "POST"), line.get("url", "/v1/chat/completions"), line.get("body")
    if not isinstance(method, str) or method.upper() != "POST":
        raise Rejected(RejectReason.UNSUPPORTED_REQUEST, f"method {str(method)[:20]!r}: only POST is answered")
    if url not in _CHAT_URLS:
        raise Rejected(RejectReason.UNSUPPORTED_REQUEST,
                       f"url {str(url)[:60]!r}: only /v1/chat/completions requests are answered")
    if not isinstance(body, dict):
        raise Rejected(RejectReason.NO_CONVERSATION, "the Batch line's body is not an object")
    return body


def _messages(raw: list[object], system: str | None) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if system is not None and system.strip():
        out.append({"role": "system", "content": system})
    pending: list[str] = []  # ids of the latest assistant's calls not yet answered
    counter = [0]
    has_user = False
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise Rejected(RejectReason.MISSING_ROLE, f"message {i} is not an object")
        name = m.get("from")
        if name is None:
            name = m.get("role")
        if name is None:
            raise Rejected(RejectReason.MISSING_ROLE, f"message {i}")
        role = _ROLES.get(name.strip().lower()) if isinstance(name, str) else None
        if role is None:
            raise Rejected(RejectReason.UNKNOWN_ROLE, f"message {i}: {str(name)[:60]!r}")
        content = m.get("value")
        if content is None:
            content = m.get("content")
        calls: list[ToolCall] | None = None
        if role == "function_call":
            role, text = "assistant", ""
            calls = _function_call(content, counter, i)
        else:
            text = _text(content, f"message {i}")
            if role == "assistant" and m.get("tool_calls"):
                calls = _openai_calls(m["tool_calls"], counter, i)
        if role == "system":
            if not text.strip():
                continue
        elif role == "user":
            if not text.strip():
                raise Rejected(RejectReason.EMPTY_MESSAGE, f"message {i} (user)")
            has_user = True
        elif role == "assistant":
            if calls is None and not text.strip():
                if i == len(raw) - 1:
                    continue  # a dump's unanswered last turn: nothing of it is used
                raise Rejected(RejectReason.EMPTY_MESSAGE, f"message {i} (assistant)")
        else:  # tool
            out.append({"role": "tool", "content": text, "tool_call_id": _answer(m, pending)})
            continue
        prev = out[-1] if out else None
        # Same role: merge, except text after tool calls, which would move before them.
        if prev is not None and prev["role"] == role and (calls or "tool_calls" not in prev):
            prev["content"] = _join(prev["content"] or "", text)  # never None here: every text is a string
            if calls:
                if "tool_calls" in prev:
                    prev["tool_calls"].extend(calls)
                    pending.extend(c["id"] for c in calls)
                else:
                    prev["tool_calls"] = calls
                    pending[:] = [c["id"] for c in calls]
            continue
        message: ChatMessage = {"role": role, "content": text}
        if calls:
            message["tool_calls"] = calls
            pending[:] = [c["id"] for c in calls]
        out.append(message)
    if not has_user:
        raise Rejected(RejectReason.NO_USER_TURN)
    return out


def _join(a: str, b: str) -> str:
    if a and b:
        return a + "\n\n" + b
    return a or b


def _check_text(s: str, where: str) -> str:
    # isascii() is O(1) in CPython, so the regex runs only on non-ASCII text.
    if not s.isascii() and _SURROGATE.search(s):
        raise Rejected(RejectReason.INVALID_UNICODE, f"{where}: lone surrogate")
    return s


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return _check_text(content, where)
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise Rejected(RejectReason.NON_TEXT_MESSAGE, f"{where}: a {str(kind)[:40]!r} part")
            text = part.get("text")
            if not isinstance(text, str):
                raise Rejected(RejectReason.NON_TEXT_MESSAGE, f"{where}: a text part without text")
            texts.append(text)
        return _check_text("\n".join(texts), where)
    raise Rejected(RejectReason.NON_TEXT_MESSAGE, f"{where} is a {type(content).__name__}")


def _answer(m: Mapping[str, object], pending: list[str]) -> str:
    given = m.get("tool_call_id")
    if isinstance(given, str) and given:
        _check_text(given, "tool_call_id")
        if given in pending:
            pending.remove(given)
        return given
    return pending.pop(0) if pending else "call_unknown"


def _function_call(content: object, counter: list[int], i: int) -> list[ToolCall]:
    where = f"message {i} (function_call)"
    parsed = content
    if isinstance(content, str):
        try:
            parsed = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise Rejected(RejectReason.INVALID_TOOLS, f"{where} is not JSON") from None
    specs = parsed if isinstance(parsed, list) else [parsed]
    if not specs:
        raise Rejected(RejectReason.INVALID_TOOLS, f"{where} holds no call")
    return [_call(spec, None, counter, where) for spec in specs]


def _openai_calls(raw: object, counter: list[int], i: int) -> list[ToolCall]:
    where = f"message {i} tool_calls"
    if not isinstance(raw, list):
        raise Rejected(RejectReason.INVALID_TOOLS, f"{where} is not a list")
    calls = []
    for c in raw:
        if not isinstance(c, dict):
            raise Rejected(RejectReason.INVALID_TOOLS, f"{where}: a call is not an object")
        fn = c.get("function")
        calls.append(_call(fn if fn is not None else c, c.get("id"), counter, where))
    return calls


def _call(spec: object, call_id: object, counter: list[int], where: str) -> ToolCall:
    if not isinstance(spec, dict):
        raise Rejected(RejectReason.INVALID_TOOLS, f"{where}: a call is not an object")
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip():
        raise Rejected(RejectReason.INVALID_TOOLS, f"{where}: a call without a name")
    _check_text(name, where)
    args = spec.get("arguments")
    if args is None:
        args = spec.get("parameters", {})
    if isinstance(args, str):
        _check_text(args, where)
    else:
        args = _dumps(args, where).decode("utf-8")
    if isinstance(call_id, str) and call_id:
        _check_text(call_id, where)
    else:
        call_id = f"call_{counter[0]}"
    counter[0] += 1
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _dumps(value: object, where: str) -> bytes:
    try:
        return orjson.dumps(value, option=_SORT)
    except orjson.JSONEncodeError as e:
        if "surrogates" in str(e):
            raise Rejected(RejectReason.INVALID_UNICODE, f"{where}: lone surrogate") from None
        raise Rejected(RejectReason.INVALID_TOOLS, f"{where}: {e}") from None


def _tools(raw: object) -> list[ToolSpec] | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise Rejected(RejectReason.INVALID_TOOLS, "tools is not JSON") from None
    if not isinstance(raw, list):
        raise Rejected(RejectReason.INVALID_TOOLS, f"tools is a {type(raw).__name__}, not a list")
    if not raw:
        return None
    tools = []
    for tool in raw:
        if not isinstance(tool, dict):
            raise Rejected(RejectReason.INVALID_TOOLS, "a tool is not an object")
        if "type" not in tool and isinstance(tool.get("name"), str):
            tool = {"type": "function", "function": tool}
        kind = tool.get("type")
        fn = tool.get("function")
        if not isinstance(kind, str) or (
            kind == "function" and not (isinstance(fn, dict) and isinstance(fn.get("name"), str))
        ):
            raise Rejected(RejectReason.INVALID_TOOLS, "a tool without a type or a function name")
        tools.append(tool)
    # Serialise once here so that keys, made later with the same options, cannot fail.
    _dumps(tools, "tools")
    return tools

