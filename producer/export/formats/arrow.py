"""The Arrow types the formats' Parquet schemas share: provenance, usage, acceptance, tool calls.

Imported only when a schema is built (FormatSpec.schema): pyarrow is not loaded by an export
to JSONL. Fields whose content is arbitrary JSON (tool schemas, the `stopped` note) are JSON
strings: a column has one type.
"""

from __future__ import annotations

import pyarrow as pa

TOOL_CALL = pa.struct([("id", pa.string()), ("type", pa.string()),
                       ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
USAGE = pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                   ("total_tokens", pa.int64()), ("reasoning_tokens", pa.int64())])
#: A row's speculative-decoding acceptance (lines.acceptance; null where it has no figures).
ACCEPTANCE = pa.struct([("rate", pa.float64()), ("mean_length", pa.float64()), ("steps", pa.int64()),
                        ("drafted", pa.int64()), ("accepted", pa.int64())])
META: list[tuple[str, pa.DataType]] = [
    ("key", pa.string()), ("source", pa.string()), ("index", pa.int64()), ("turn", pa.int64()),
    ("sample", pa.int64()), ("seed", pa.int64()), ("model", pa.string()), ("fingerprint", pa.string()),
    ("outcome", pa.string()), ("usage", USAGE), ("stopped", pa.string()), ("note", pa.string()),
    ("variant", pa.string()), ("acceptance", ACCEPTANCE),
]
#: A generation row's place in its record (genrows.py; null in conversation rows).
GENERATION: list[tuple[str, pa.DataType]] = [("generation", pa.int64()), ("step", pa.int64())]

#: OpenAI-style chat messages (openai's `messages`, specforge's `conversations`): role, content,
#: thinking, tool calls, who wrote each and a generation row's `weight`.
CHAT_MESSAGES = pa.list_(pa.struct([
    ("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string()),
    ("tool_calls", pa.list_(TOOL_CALL)), ("tool_call_id", pa.string()),
    ("generated_by_target", pa.bool_()), ("weight", pa.int64())]))
