"""Cut a normalised conversation into work items, and the keys that name them (pure).

An item is a plain JSON-serialisable dict: ``key``, ``index`` (the record's index in the
input), ``turn``, ``messages``, ``tools`` (only when the conversation has tools) and
``note`` (only when something was cut). Its messages are the conversation's own dicts,
shared, not copied: treat them as read-only.

Modes (`contracts.Mode`), as ``--multi-turn`` names them:

- ``first``: the system messages before the first user turn, and that turn; turn 0.
- ``last``: the original history up to and including the last user turn (original
  assistant answers and tool turns kept); turn = number of user turns - 1.
- ``each``: one item per user turn k: the original history before it, then that turn.
- ``regenerate`` (the default): one item per conversation holding the system messages and
  the user turns only; the consumer regenerates every assistant turn on the regenerated
  history. Tool rule: the target cannot replay tool results it never asked for, so the
  conversation is cut before the first assistant message with tool calls; the user turns
  after it are dropped and the item carries ``"note": "stopped_at_tool_turn"``. A tool call
  before any user turn leaves nothing to regenerate: ``tool_turn_first``. ``turn`` is None.

The key hashes mode, messages and tools only, so identical items from different records
share a key: that is how duplicates are found, and it is intended.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Any

import orjson

from genqueue.common.contracts import Item, Mode, RejectReason
from genqueue.producer.conversation import Conversation
from genqueue.producer.rejects import Rejected

STOPPED_AT_TOOL_TURN = "stopped_at_tool_turn"

_SORT = orjson.OPT_SORT_KEYS


def item_key(mode: Mode, messages: Any, tools: Any) -> str:
    """32 hex characters naming an item: blake2b-128 of its mode, messages and tools."""
    data = orjson.dumps([mode, messages, tools], option=_SORT)
    return blake2b(data, digest_size=16).hexdigest()


def conversation_key(conv: Conversation) -> bytes:
    """16-byte digest of a whole normalised conversation, to find duplicate records."""
    data = orjson.dumps([conv.messages, conv.tools], option=_SORT)
    return blake2b(data, digest_size=16).digest()


def make_items(conv: Conversation, mode: Mode, index: int) -> list[Item]:
    """Items for one conversation in ``mode``; raises Rejected (no_user_turn, tool_turn_first)."""
    msgs = conv.messages
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if not users:
        raise Rejected(RejectReason.NO_USER_TURN)
    try:
        mode = Mode(mode)
    except ValueError:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(Mode)}") from None
    match mode:
        case Mode.REGENERATE:
            return [_regenerate(conv, index)]
        case Mode.FIRST:
            first = users[0]
            picked = [m for m in msgs[:first] if m["role"] == "system"]
            picked.append(msgs[first])
            return [_item(Mode.FIRST, index, 0, picked, conv.tools)]
        case Mode.LAST:
            return [_item(Mode.LAST, index, len(users) - 1, list(msgs[: users[-1] + 1]), conv.tools)]
        case Mode.EACH:
            return [_item(Mode.EACH, index, k, list(msgs[: u + 1]), conv.tools) for k, u in enumerate(users)]


def _regenerate(conv: Conversation, index: int) -> Item:
    msgs = conv.messages
    cut = next(
        (i for i, m in enumerate(msgs) if m["role"] == "assistant" and "tool_calls" in m), None
    )
    kept = msgs if cut is None else msgs[:cut]
    picked = [m for m in kept if m["role"] == "system" or m["role"] == "user"]
    if not any(m["role"] == "user" for m in picked):
        raise Rejected(RejectReason.TOOL_TURN_FIRST, "a tool call comes before any user turn")
    item = _item(Mode.REGENERATE, index, None, picked, conv.tools)
    if cut is not None:
        item["note"] = STOPPED_AT_TOOL_TURN
    return item


def _item(
    mode: Mode, index: int, turn: int | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> Item:
    item: Item = {
        "key": item_key(mode, messages, tools),
        "index": index,
        "turn": turn,
        "messages": messages,
    }
    if tools is not None:
        item["tools"] = tools
    return item


def answer_lengths(conv: Conversation) -> list[int]:
    """Characters of the original assistant answer to each user turn (0 where none)."""
    out: list[int] = []
    for m in conv.messages:
        if m["role"] == "user":
            out.append(0)
        elif m["role"] == "assistant" and out:
            out[-1] += len(m.get("content") or "")
    return out


def estimate_cost(item: Item, answers: list[int]) -> int:
    """How long the item will keep a slot busy, for longest-first ordering: the length of the
    original answers it regenerates (the best predictor a dataset carries of the new ones),
    else its prompt length."""
    turn = item.get("turn")
    est = sum(answers) if turn is None else (answers[turn] if turn < len(answers) else 0)
    if est:
        return est
    return sum(len(m.get("content") or "") for m in item["messages"])
