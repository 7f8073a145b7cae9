"""Regenerate through tool turns: does the target's tool call match the recorded one (pure).

The target cannot run tools, so the recorded results are all there is to give it: they are
spliced in only when the target asked for exactly what the recording did. A call matches a
recorded call when the function name is the same and the arguments are equal as JSON (key
order and whitespace do not matter; `1` and `1.0` are one number, `true` is not `1`);
parallel calls match as a multiset, in any order. Anything else is a divergence.
"""

from __future__ import annotations

import collections
from typing import Any

import orjson

from genqueue.common.contracts import ChatMessage, ToolCall
from genqueue.common.records import CallSummary

__all__ = ["call_summary", "match_calls", "splice_results"]


def _canon(value: Any) -> Any:
    """A hashable form of a JSON value in which equal JSON values are equal."""
    if isinstance(value, bool) or value is None:
        return ("lit", value)
    if isinstance(value, int | float):
        return ("num", value)
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, list):
        return ("list", tuple(_canon(v) for v in value))
    if isinstance(value, dict):
        return ("obj", frozenset((k, _canon(v)) for k, v in value.items()))
    return ("other", repr(value))


def _signature(call: ToolCall) -> tuple[Any, Any] | None:
    """(name, canonical arguments) of one OpenAI tool call; None when it is no call (the
    recording and the endpoint are read defensively: either may hold anything)."""
    if not isinstance(call, dict):
        return None
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return None
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = orjson.loads(args) if args.strip() else {}
        except orjson.JSONDecodeError:
            return fn["name"], ("raw", args.strip())  # not JSON: only the same text matches
        return fn["name"], _canon(parsed)
    return fn["name"], _canon({} if args is None else args)


def match_calls(got: list[ToolCall], recorded: list[ToolCall]) -> dict[str, str] | None:
    """Recorded call id -> the target's call id when GOT matches RECORDED as a multiset of
    (name, JSON arguments); None at a divergence (no call, other calls, more or fewer)."""
    if not got or len(got) != len(recorded):
        return None
    waiting: dict[tuple[Any, Any], collections.deque[str]] = collections.defaultdict(collections.deque)
    for i, call in enumerate(got):
        sig = _signature(call)
        if sig is None:
            return None
        cid = call.get("id")
        waiting[sig].append(cid if isinstance(cid, str) and cid else f"call_{i}")
    ids: dict[str, str] = {}
    for call in recorded:
        sig = _signature(call)
        if sig is None or not waiting.get(sig):
            return None
        ids[call["id"]] = waiting[sig].popleft()
    return ids


def splice_results(results: list[ChatMessage], ids: dict[str, str]) -> list[ChatMessage]:
    """The recorded tool messages, answering the target's call ids."""
    return [_answering(m, ids) for m in results]


def _answering(msg: ChatMessage, ids: dict[str, str]) -> ChatMessage:
    key = msg.get("tool_call_id", "")
    spliced = msg.copy()
    spliced["tool_call_id"] = None if key is None else ids.get(key, msg.get("tool_call_id"))
    return spliced


def call_summary(calls: list[ToolCall]) -> list[CallSummary]:
    """Name and arguments of each call, for a divergence's `stopped` note."""
    out: list[CallSummary] = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict):
            out.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
    return out
