"""Turning one result record into one line of the exported dataset (pure, no I/O).

Every line, whatever its shape, carries `id` (the input record's own id, else the item key;
in `batch` the record's id is `custom_id` and `id` the Batch API's request id; unique per
line: `-t<turn>` in mode each, `-s<sample>` for samples, see line_id), the item's
`key`, where it came from (`source`, `index`: its position in that source, `turn`, `sample`,
`seed`), and what made it: `model`, `fingerprint`, `outcome`, `usage`.

Nothing is fabricated. A turn cut inside its thinking (`cut_in_thinking`), or that stopped
with thinking and no answer (`no_answer`: often a reasoning parser on a model that never
closed its thinking), is not written as if complete: the export leaves such items out of
the dataset unless asked (core.py), and where they are written, no closing `</think>`
the model never produced is added.

Shapes, each as its training tool's loader reads it (the test that checks each one cites the
loader's file):

`openai`: `messages` in OpenAI chat form, every generated assistant message with its
thinking as `reasoning_content` beside `content` (`tool_calls` when it called tools); `tools`
as given. `reasoning_content` is the name reasoning models' chat templates read (Qwen3's,
through transformers' apply_chat_template); vLLM's response field `reasoning` is read by none
of them, so a dataset keeping that name trains on no thinking at all.

`sharegpt`: LLaMA-Factory's sharegpt form (data/README.md, data/converter.py
SharegptDatasetConverter): `conversations` of `{from, value}` alternating human|observation
and gpt|function_call, led by a `{"from": "system"}` turn when there is a system prompt (the
one place every sharegpt loader reads it without configuration: LLaMA-Factory's system_tag,
SpecForge's and speculators' first-turn system role; a top-level `system` is read by none of
them by default), `tools` (a JSON string) at the top level, as LLaMA-Factory (with the
`columns` entry of `llamafactory_dataset_info`), SpecForge and speculators read it. Thinking is
inside each gpt value as `<think>\\n{reasoning}\\n</think>\\n\\n{answer}`: LLaMA-Factory's
ReasoningTemplate thought words, which Qwen3-style templates also produce. A turn without
thinking is the bare answer. Tool calls are one `function_call` turn (`{"name","arguments"}`,
a list for parallel calls; text beside them goes before a `<tool_call>` block, as
FunctionFormatter reads it), consecutive tool results one `observation` turn. EAGLE-3's
traineagle3/main.py reads this form too (`id`, human/gpt turns) when there are no tool turns.

`specforge`: what SpecForge's data preparation writes and reads (scripts/
regenerate_train_data.py, scripts/validate_regenerated_data.py, specforge/data/parse.py):
`conversations` of `{role, content}` with each assistant turn's `reasoning_content`,
`tool_calls` and `tool_call_id` as in OpenAI chat, `tools` a list, `status: "success"`.

`batch`: OpenAI Batch API output lines: `{"id", "custom_id", "response": {"status_code",
"request_id", "body": <chat.completion>}, "error": null}`; the body holds the last answer (in
mode regenerate, the final turn). Error records become the Batch error file's lines: an HTTP
error as a response with its status and `{"error": {...}}` body, anything else as
`"response": null, "error": {"code", "message"}`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import orjson

from genqueue.common.contracts import Outcome

SHAPES = ("openai", "sharegpt", "specforge", "batch")
#: `--format` choices: the shapes, and parquet (the openai shape in a Parquet file).
FORMATS = (*SHAPES, "parquet")

#: Outcomes whose answer never ended on its own: no closing think tag is written for them.
UNCLOSED = frozenset({Outcome.CUT_IN_THINKING, Outcome.NO_ANSWER})
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"
#: How LLaMA-Factory's own OpenAI converter joins parallel tool results into one observation.
TOOL_RESULTS_JOIN = "\n</tool_response>\n<tool_response>\n"

_META = ("key", "source", "index", "turn", "sample", "seed")
_MADE_BY = ("model", "fingerprint", "outcome", "usage", "stopped", "note")


def record_outcome(rec: dict[str, Any]) -> str:
    """The record's outcome, told truthfully also for records written before `partial`
    existed: a regenerate conversation stopped by an error (or whose cut turn was dropped) is
    partial, whatever its last good turn said."""
    stopped = rec.get("stopped")
    if isinstance(stopped, dict) and (stopped.get("reason") == "error" or stopped.get("dropped")):
        return Outcome.PARTIAL.value
    outcome = rec.get("outcome")
    return outcome if isinstance(outcome, str) else "unknown"


def line_id(rec: dict[str, Any], *, per_turn: bool = False) -> str:
    """The id of a record's line: the input record's own id, else the item key (one per item).
    An input id repeats over the items made of one record, and a join on it would overwrite
    rows: with PER_TURN (mode each: one item per user turn) `-t<turn>` is appended, and for a
    sample after the first (--samples) `-s<sample>`."""
    rid = rec.get("id")
    if not (isinstance(rid, str) and rid):
        return str(rec.get("key", ""))
    turn, sample = rec.get("turn"), rec.get("sample")
    if per_turn and isinstance(turn, int):
        rid += f"-t{turn}"
    if isinstance(sample, int) and not isinstance(sample, bool) and sample > 0:
        rid += f"-s{sample}"
    return rid


def _meta(rec: dict[str, Any], out: dict[str, Any], fields: tuple[str, ...] = _META + _MADE_BY) -> dict[str, Any]:
    for name in fields:
        value = rec.get(name)
        if value is not None:
            out[name] = value
    return out


def to_openai(rec: dict[str, Any], *, per_turn: bool = False) -> dict[str, Any]:
    """The openai-format export line of a success record."""
    out: dict[str, Any] = {"id": line_id(rec, per_turn=per_turn), "messages": conversation(rec)}
    if rec.get("tools"):
        out["tools"] = rec["tools"]
    return _meta(rec, out)


def to_sharegpt(rec: dict[str, Any], *, per_turn: bool = False) -> dict[str, Any]:
    """The sharegpt-format (LLaMA-Factory) export line of a success record."""
    conv: list[dict[str, str]] = []
    system: list[str] = []
    for msg, unclosed in _conversation(rec):
        role = msg.get("role")
        if role in ("system", "developer"):
            system.append(_text(msg.get("content")))
        elif role == "user":
            conv.append({"from": "human", "value": _text(msg.get("content"))})
        elif role == "assistant":
            conv.append(_sharegpt_assistant(msg, unclosed))
        elif role == "tool":
            if conv and conv[-1]["from"] == "observation":  # parallel calls' results: one turn
                conv[-1]["value"] += TOOL_RESULTS_JOIN + _text(msg.get("content"))
            else:
                conv.append({"from": "observation", "value": _text(msg.get("content"))})
    if system:
        conv.insert(0, {"from": "system", "value": "\n\n".join(system)})
    out: dict[str, Any] = {"id": line_id(rec, per_turn=per_turn), "conversations": conv}
    if rec.get("tools"):  # LLaMA-Factory keeps the tool schemas as a JSON string
        out["tools"] = orjson.dumps(rec["tools"]).decode()
    return _meta(rec, out)


def to_specforge(rec: dict[str, Any], *, per_turn: bool = False) -> dict[str, Any]:
    """The SpecForge-format export line of a success record."""
    conv: list[dict[str, Any]] = []
    for msg in conversation(rec):
        role = "system" if msg.get("role") == "developer" else msg.get("role")
        turn: dict[str, Any] = {"role": role, "content": _text(msg.get("content"))}
        if role == "assistant":
            if msg.get("reasoning_content") is not None:
                turn["reasoning_content"] = msg["reasoning_content"]
            if msg.get("tool_calls"):
                turn["tool_calls"] = msg["tool_calls"]
        elif role == "tool" and msg.get("tool_call_id"):
            turn["tool_call_id"] = msg["tool_call_id"]
        conv.append(turn)
    out: dict[str, Any] = {"id": line_id(rec, per_turn=per_turn), "conversations": conv}
    if rec.get("tools"):
        out["tools"] = rec["tools"]
    out["status"] = "success"
    return _meta(rec, out)


def to_batch(rec: dict[str, Any], *, per_turn: bool = False) -> dict[str, Any]:
    """The OpenAI Batch API output line of a success record."""
    key = str(rec.get("key", ""))
    turns = rec.get("turns") or []
    usage = dict((turns[-1].get("usage") if turns else None) or rec.get("usage") or {})
    if "total_tokens" not in usage:
        usage["total_tokens"] = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    message: dict[str, Any] = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning") is not None:
        message["reasoning"] = rec["reasoning"]
    if rec.get("tool_calls"):
        message["tool_calls"] = rec["tool_calls"]
    body = {
        "id": f"chatcmpl-{key}",
        "object": "chat.completion",
        "created": int((rec.get("timings") or {}).get("finished_at") or 0),
        "model": rec.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": rec.get("finish_reason"), "logprobs": None}],
        "usage": usage,
        "system_fingerprint": rec.get("fingerprint"),
    }
    out = {"id": f"batch_req_{key}", "custom_id": line_id(rec, per_turn=per_turn),
           "response": {"status_code": 200, "request_id": f"req_{key}", "body": body}, "error": None}
    return _meta(rec, out, _META + ("model", "fingerprint", "outcome", "stopped"))


def llamafactory_dataset_info(name: str, file_name: str, *, tools: bool) -> dict[str, Any]:
    """LLaMA-Factory's dataset_info.json entry for a sharegpt export (data/README.md; parser.py
    DatasetAttr). The system prompt is the leading system turn, read through `system_tag`;
    `tools` is read only through `columns`, so it is named when a row has tools (a column
    no row has would be a KeyError in its converter)."""
    columns = {"messages": "conversations", **({"tools": "tools"} if tools else {})}
    tags = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
            "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
    return {name: {"file_name": file_name, "formatting": "sharegpt", "columns": columns, "tags": tags}}


def batch_error(rec: dict[str, Any], *, per_turn: bool = False) -> dict[str, Any]:
    """The OpenAI Batch API error-file line of an error record: an HTTP error (the server's
    status is known) as a response holding the error body, anything else as `error`."""
    key = str(rec.get("key", ""))
    err = rec.get("error") or {}
    status, message, cls = err.get("status"), str(err.get("message", "")), str(err.get("class", "unknown"))
    out: dict[str, Any] = {"id": f"batch_req_{key}", "custom_id": line_id(rec, per_turn=per_turn)}
    if isinstance(status, int) and not isinstance(status, bool):
        body = {"error": {"message": message, "type": str(err.get("type", "")), "param": None, "code": cls}}
        out["response"] = {"status_code": status, "request_id": f"req_{key}", "body": body}
        out["error"] = None
    else:
        out["response"] = None
        out["error"] = {"code": cls, "message": message}
    return _meta(rec, out, _META + ("fingerprint",))


CONVERTERS: dict[str, Callable[..., dict[str, Any]]] = {
    "openai": to_openai, "sharegpt": to_sharegpt, "specforge": to_specforge, "batch": to_batch}


def converter(shape: str, *, per_turn: bool = False) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """SHAPE's converter; PER_TURN: ids unique per turn (mode each, see line_id)."""
    fn = CONVERTERS[shape]
    return functools.partial(fn, per_turn=True) if per_turn else fn


def conversation(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's full conversation, every generated assistant message carrying its thinking
    as `reasoning_content`."""
    return [msg for msg, _ in _conversation(rec)]


def _conversation(rec: dict[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    """The conversation, each message with whether it is an answer that never ended on its own."""
    messages: list[dict[str, Any]] = rec.get("messages") or []
    turns = rec.get("turns")
    if turns is not None:  # regenerate: messages already hold the answers, turns their thinking
        out = []
        i = 0
        for msg in messages:
            unclosed = False
            if msg.get("role") == "assistant":
                msg = {k: v for k, v in msg.items() if k != "reasoning_content"}
                turn = turns[i] if i < len(turns) else {}
                if turn.get("reasoning") is not None:
                    msg["reasoning_content"] = turn["reasoning"]
                unclosed = turn.get("outcome") in UNCLOSED
                i += 1
            out.append((msg, unclosed))
        return out
    answer: dict[str, Any] = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning") is not None:
        answer["reasoning_content"] = rec["reasoning"]
    if rec.get("tool_calls"):
        answer["tool_calls"] = rec["tool_calls"]
    return [*((m, False) for m in messages), (answer, rec.get("outcome") in UNCLOSED)]


def thinking_text(msg: dict[str, Any], unclosed: bool) -> str:
    """The thinking of an assistant message as LLaMA-Factory's ReasoningTemplate reads it
    inside the answer: opened, and closed only when the model closed it."""
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        return ""
    return THINK_OPEN + _text(reasoning) + ("" if unclosed else THINK_CLOSE)


def _sharegpt_assistant(msg: dict[str, Any], unclosed: bool) -> dict[str, str]:
    thought = thinking_text(msg, unclosed)
    content = _text(msg.get("content"))
    calls = msg.get("tool_calls") or []
    if not calls:
        return {"from": "gpt", "value": thought + content}
    specs = []
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = orjson.loads(args)
            except orjson.JSONDecodeError:
                pass
        specs.append({"name": fn.get("name"), "arguments": args})
    payload = orjson.dumps(specs[0] if len(specs) == 1 else specs).decode()
    if content:  # text beside the calls: FunctionFormatter keeps what is outside the block
        return {"from": "function_call", "value": f"{thought}{content}<tool_call>{payload}</tool_call>"}
    return {"from": "function_call", "value": thought + payload}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
