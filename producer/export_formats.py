"""Turning one result record into one line of the exported dataset (pure, no I/O).

`openai`: the whole conversation as OpenAI chat `messages`, the model's answers included:

    {"key", "index", "turn"?, "messages": [..., {"role": "assistant", "content", "reasoning"?,
     "tool_calls"?}], "tools"?, "model", "fingerprint", "usage", "outcome", "stopped"?, "note"?}

  Single-turn modes: the record's prompt plus one assistant message built from `content`,
  `reasoning` and `tool_calls`. Mode regenerate: `messages` already holds the regenerated
  conversation; the thinking of assistant turn i (kept apart in `turns[i].reasoning`) is put
  back into that message as `reasoning`.

`sharegpt`: what drafter-training tools (SpecForge, LLaMA-Factory) read:

    {"conversations": [{"from": "human"|"gpt"|"function_call"|"observation", "value"}],
     "system"?: "...", "tools"?: "<JSON>", "key", "index", "turn"?}

  System messages go to the top-level `system`. The thinking stays inside each gpt value as
  `<think>\\n{reasoning}\\n</think>\\n\\n{answer}`, the layout Qwen3-style chat templates
  produce and parse; a turn without thinking (reasoning null) is the bare answer. Tool calls
  become `function_call` turns whose value is `{"name", "arguments"}` as JSON, tool results
  `observation` turns.
"""

from __future__ import annotations

from typing import Any

import orjson

FORMATS = ("openai", "sharegpt")


def to_openai(rec: dict[str, Any]) -> dict[str, Any]:
    """The openai-format export line of a success record."""
    out: dict[str, Any] = {"key": rec["key"], "index": rec["index"]}
    if rec.get("turn") is not None:
        out["turn"] = rec["turn"]
    out["messages"] = conversation(rec)
    for field in ("tools", "model", "fingerprint", "usage", "outcome", "stopped", "note"):
        if rec.get(field) is not None:
            out[field] = rec[field]
    return out


def to_sharegpt(rec: dict[str, Any]) -> dict[str, Any]:
    """The sharegpt-format export line of a success record."""
    conv: list[dict[str, str]] = []
    system: list[str] = []
    for msg in conversation(rec):
        role = msg.get("role")
        if role in ("system", "developer"):
            system.append(_text(msg.get("content")))
        elif role == "user":
            conv.append({"from": "human", "value": _text(msg.get("content"))})
        elif role == "assistant":
            conv.extend(_sharegpt_assistant(msg))
        elif role == "tool":
            conv.append({"from": "observation", "value": _text(msg.get("content"))})
    out: dict[str, Any] = {"conversations": conv}
    if system:
        out["system"] = "\n\n".join(system)
    if rec.get("tools"):  # LLaMA-Factory keeps the tool schemas as a JSON string
        out["tools"] = orjson.dumps(rec["tools"]).decode()
    out["key"] = rec["key"]
    out["index"] = rec["index"]
    if rec.get("turn") is not None:
        out["turn"] = rec["turn"]
    return out


CONVERTERS = {"openai": to_openai, "sharegpt": to_sharegpt}


def conversation(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's full conversation, every generated assistant message carrying its reasoning."""
    messages: list[dict[str, Any]] = rec.get("messages") or []
    turns = rec.get("turns")
    if turns is not None:  # regenerate: messages already hold the answers, turns their thinking
        out = []
        i = 0
        for msg in messages:
            if msg.get("role") == "assistant":
                msg = {k: v for k, v in msg.items() if k != "reasoning_content"}
                reasoning = turns[i].get("reasoning") if i < len(turns) else None
                if reasoning is not None:
                    msg["reasoning"] = reasoning
                i += 1
            out.append(msg)
        return out
    answer: dict[str, Any] = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning") is not None:
        answer["reasoning"] = rec["reasoning"]
    if rec.get("tool_calls"):
        answer["tool_calls"] = rec["tool_calls"]
    return [*messages, answer]


def _sharegpt_assistant(msg: dict[str, Any]) -> list[dict[str, str]]:
    turns: list[dict[str, str]] = []
    content = _text(msg.get("content"))
    reasoning = msg.get("reasoning", msg.get("reasoning_content"))
    if reasoning is not None:
        content = f"<think>\n{reasoning}\n</think>\n\n{content}"
    calls = msg.get("tool_calls") or []
    if content or not calls:
        turns.append({"from": "gpt", "value": content})
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = orjson.loads(args)
            except orjson.JSONDecodeError:
                pass
        turns.append({"from": "function_call",
                      "value": orjson.dumps({"name": fn.get("name"), "arguments": args}).decode()})
    return turns


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
