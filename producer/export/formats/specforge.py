"""`--format specforge`: what SpecForge's data preparation writes and reads (scripts/
regenerate_train_data.py, scripts/validate_regenerated_data.py, specforge/data/parse.py).

`conversations` of `{role, content}` (a developer message as `system`), each assistant turn with
its `reasoning_content`, `tool_calls` and `generated_by_target`, each tool turn its
`tool_call_id`, as in OpenAI chat; `tools` JSON text, `status: "success"`. A generation row puts
`weight` 1 on its answer and 0 on the history's; SpecForge trains the last turn alone with
`data.train_only_last_turn: true`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from genqueue.common.records import ResultRecord
from genqueue.producer.export.formats.lines import (
    GENERATED,
    conversation,
    line_id,
    record_figures,
    target_turns,
    text,
    tools_text,
    with_acceptance,
    with_meta,
)
from genqueue.producer.export.formats.spec import FormatSpec, Line

if TYPE_CHECKING:
    import pyarrow as pa


def to_specforge(rec: ResultRecord, *, per_turn: bool = False, marks: list[bool] | None = None) -> Line:
    """The SpecForge-format export line of a success record (MARKS: as openai.to_openai)."""
    conv: list[Line] = []
    authors = iter(target_turns(rec) if marks is None else marks)
    for msg in conversation(rec):
        role = "system" if msg.get("role") == "developer" else msg.get("role")
        turn: Line = {"role": role, "content": text(msg.get("content"))}
        if role == "assistant":
            turn[GENERATED] = next(authors)
            if msg.get("reasoning_content") is not None:
                turn["reasoning_content"] = msg["reasoning_content"]
            if msg.get("tool_calls"):
                turn["tool_calls"] = msg["tool_calls"]
        elif role == "tool" and msg.get("tool_call_id"):
            turn["tool_call_id"] = msg["tool_call_id"]
        conv.append(turn)
    out: Line = {"id": line_id(rec, per_turn=per_turn), "conversations": conv}
    if rec.get("tools"):
        out["tools"] = tools_text(rec["tools"])
    out["status"] = "success"
    return with_acceptance(with_meta(rec, out), record_figures(rec))


def schema() -> pa.Schema:
    """The Arrow schema of specforge lines."""
    import pyarrow as pa

    from genqueue.producer.export.formats.arrow import CHAT_MESSAGES, GENERATION, META

    return pa.schema([("id", pa.string()), ("conversations", CHAT_MESSAGES), ("tools", pa.string()),
                      ("status", pa.string()), *META, *GENERATION])


SPEC = FormatSpec("SpecForge's conversations of role/content with reasoning_content", to_specforge,
                  schema=schema, generation_line=to_specforge, weighted="conversations")
