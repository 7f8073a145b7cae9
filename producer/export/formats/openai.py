"""`--format openai`: `messages` in OpenAI chat form, every generated assistant message with its
thinking as `reasoning_content` beside `content` (`tool_calls` when it called tools, and
`generated_by_target`), `tools` as JSON text (lines.tools_text).

`reasoning_content` is the name reasoning models' chat templates read (Qwen3's, through
transformers' apply_chat_template); vLLM's response field `reasoning` is read by none of them,
so a dataset keeping that name trains on no thinking at all. A generation row puts `weight` 1 on
its answer and 0 on every history answer (OpenAI fine-tuning's per-message field).
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
    tools_text,
    with_acceptance,
    with_meta,
)
from genqueue.producer.export.formats.spec import FormatSpec, Line

if TYPE_CHECKING:
    import pyarrow as pa


def to_openai(rec: ResultRecord, *, per_turn: bool = False, marks: list[bool] | None = None) -> Line:
    """The openai-format export line of a success record (MARKS: who wrote each assistant
    message, when not target_turns(rec): a generation row's, genrows.py)."""
    authors = iter(target_turns(rec) if marks is None else marks)
    messages = [{**m, GENERATED: next(authors)} if m.get("role") == "assistant" else m for m in conversation(rec)]
    out: Line = {"id": line_id(rec, per_turn=per_turn), "messages": messages}
    if rec.get("tools"):
        out["tools"] = tools_text(rec["tools"])
    return with_acceptance(with_meta(rec, out), record_figures(rec))


def schema() -> pa.Schema:
    """The Arrow schema of openai lines."""
    import pyarrow as pa

    from genqueue.producer.export.formats.arrow import CHAT_MESSAGES, GENERATION, META

    return pa.schema([("id", pa.string()), ("messages", CHAT_MESSAGES), ("tools", pa.string()), *META, *GENERATION])


SPEC = FormatSpec("chat `messages`, each answer's thinking as `reasoning_content` beside it", to_openai,
                  schema=schema, generation_line=to_openai, weighted="messages")
