"""`--format sharegpt`: LLaMA-Factory's sharegpt form (data/README.md, data/converter.py
SharegptDatasetConverter), which EAGLE-3's traineagle3/main.py reads too (without tool turns).

`conversations` of `{from, value}` alternating human|observation and gpt|function_call, led by a
`{"from": "system"}` turn when there is a system prompt (the one place every sharegpt loader
reads it without configuration), `tools` (JSON text) at the top level, read by LLaMA-Factory
through the `columns` of its dataset_info.json entry (the side file), SpecForge and speculators.
Thinking is inside each gpt value as `<think>\\n{reasoning}\\n</think>\\n\\n{answer}` (the
ReasoningTemplate's thought words, closed only when the model closed it); a turn without
thinking is the bare answer. Tool calls are one `function_call` turn (`{"name","arguments"}`, a
list for parallel calls; text beside them before a `<tool_call>` block, as FunctionFormatter
reads it), consecutive tool results one `observation` turn. Turns stay exactly `{from, value}`:
the indexes of the target's gpt/function_call turns are listed in `target_turns`
(LLaMA-Factory trains a generation row's last turn alone with `mask_history: true`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import orjson

from genqueue.common.contracts import ChatMessage
from genqueue.common.records import ResultRecord
from genqueue.producer.export.formats.lines import (
    conversation_turns,
    line_id,
    record_figures,
    target_turns,
    text,
    tools_text,
    with_acceptance,
    with_meta,
)
from genqueue.producer.export.formats.spec import FormatSpec, Line, SideFile

if TYPE_CHECKING:
    import pyarrow as pa

THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"
#: How LLaMA-Factory's own OpenAI converter joins parallel tool results into one observation.
TOOL_RESULTS_JOIN = "\n</tool_response>\n<tool_response>\n"


def to_sharegpt(rec: ResultRecord, *, per_turn: bool = False, marks: list[bool] | None = None) -> Line:
    """The sharegpt-format (LLaMA-Factory) export line of a success record (MARKS: who wrote each
    assistant message, as openai.to_openai)."""
    conv: list[dict[str, str]] = []
    system: list[str] = []
    authors = iter(target_turns(rec) if marks is None else marks)
    generated: list[int] = []
    for msg, unclosed in conversation_turns(rec):
        role = msg.get("role")
        if role in ("system", "developer"):
            system.append(text(msg.get("content")))
        elif role == "user":
            conv.append({"from": "human", "value": text(msg.get("content"))})
        elif role == "assistant":
            if next(authors):
                generated.append(len(conv))
            conv.append(_assistant(msg, unclosed))
        elif role == "tool":
            if conv and conv[-1]["from"] == "observation":  # parallel calls' results: one turn
                conv[-1]["value"] += TOOL_RESULTS_JOIN + text(msg.get("content"))
            else:
                conv.append({"from": "observation", "value": text(msg.get("content"))})
    if system:
        conv.insert(0, {"from": "system", "value": "\n\n".join(system)})
        generated = [i + 1 for i in generated]
    out: Line = {"id": line_id(rec, per_turn=per_turn), "conversations": conv, "target_turns": generated}
    if rec.get("tools"):  # LLaMA-Factory keeps the tool schemas as a JSON string
        out["tools"] = tools_text(rec["tools"])
    return with_acceptance(with_meta(rec, out), record_figures(rec))


def thinking_text(msg: ChatMessage, unclosed: bool) -> str:
    """The thinking of an assistant message as LLaMA-Factory's ReasoningTemplate reads it
    inside the answer: opened, and closed only when the model closed it."""
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        return ""
    return THINK_OPEN + text(reasoning) + ("" if unclosed else THINK_CLOSE)


def _assistant(msg: ChatMessage, unclosed: bool) -> dict[str, str]:
    thought = thinking_text(msg, unclosed)
    content = text(msg.get("content"))
    calls = msg.get("tool_calls") or []
    if not calls:
        return {"from": "gpt", "value": thought + content}
    specs = []
    for call in calls:
        fn: Mapping[str, object] = call.get("function", call)
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


def llamafactory_dataset_info(name: str, file_name: str, *, tools: bool) -> dict[str, object]:
    """LLaMA-Factory's dataset_info.json entry for a sharegpt export (data/README.md; parser.py
    DatasetAttr). The system prompt is the leading system turn, read through `system_tag`;
    `tools` is read only through `columns`, so it is named when a row has tools (a column
    no row has would be a KeyError in its converter)."""
    columns = {"messages": "conversations", **({"tools": "tools"} if tools else {})}
    tags = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
            "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
    return {name: {"file_name": file_name, "formatting": "sharegpt", "columns": columns, "tags": tags}}


#: LLaMA-Factory's dataset_info.json entry; it loads these types only (extras/constants.py
#: FILEEXT2TYPE): no compressed JSONL.
LLAMAFACTORY_ENTRY = SideFile(
    ".dataset_info.json", "dataset_info.json entry", "LLaMA-Factory entry", "LLaMA-Factory",
    (".jsonl", ".json", ".parquet"),
    lambda name, file_name, tools: llamafactory_dataset_info(name, file_name, tools=tools))


def schema() -> pa.Schema:
    """The Arrow schema of sharegpt lines."""
    import pyarrow as pa

    from genqueue.producer.export.formats.arrow import GENERATION, META

    return pa.schema([
        ("id", pa.string()),
        ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
        ("tools", pa.string()), ("target_turns", pa.list_(pa.int64())), *META, *GENERATION])


SPEC = FormatSpec(
    "LLaMA-Factory's conversations of from/value, thinking as <think>...</think> in gpt turns (EAGLE reads it too)",
    to_sharegpt, schema=schema, side_file=LLAMAFACTORY_ENTRY, generation_line=to_sharegpt)
