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
as JSON text (see Nested fields). `reasoning_content` is the name reasoning models' chat templates read (Qwen3's,
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
`tool_calls` and `tool_call_id` as in OpenAI chat, `tools` JSON text, `status: "success"`.

Nested fields (every format): a row's objects are genqueue's own, with a fixed set of keys (a
message or turn, a tool call and its function, `usage`, `acceptance`, `stopped`), or hold the
user's free-form JSON, written as JSON text. `datasets` (every release: the loader of
LLaMA-Factory, SpecForge and speculators) gives a column one Arrow type, so it unifies the
objects of a column across rows into one struct: a key a row lacks reads back as null, which
for a fixed-key object is the absent key, but inside a tool schema is a property the server
never saw (`"expr": null` in another tool's `properties`, rendered into the prompt). So
`tools` is JSON text in every format (tools_text), as SpecForge's and speculators' loaders
parse it and LLaMA-Factory keeps it; tool call arguments are JSON text as OpenAI has them.

`tokens`: one row per generated answer, in the pre-tokenized form vllm-project/speculators'
training reads as it is (src/speculators/data_generation/preprocessing.py,
`_passthrough_pretokenized`: `input_ids` and `loss_mask` of equal length): `input_ids` the
prompt ids the engine rendered for that answer followed by the ids it generated, `loss_mask`
0 on the prompt and 1 on exactly the generated ids. Only runs made with --token-ids have them
(records keep `token_ids` per answer); a record without them is refused, never re-tokenized.
Each row's `turn` is the user turn it answers (`step`: its place after tool results), its
`usage` that answer's own, its `id` the record's with `-a<n>` (the n-th answer, from 0), its
`outcome` the generation row's of the same answer (generations.answer_outcomes: `finished` when
it and every answer before it finished), so a token row and its text row share id and fate.

Which assistant turns the target generated is stated per turn (target_turns): in mode
regenerate every one (the conversation's answers are the target's), in modes first, last and
each only the final one (the history's answers are the input's own). `openai` and
`specforge` put `generated_by_target: true|false` on every assistant message; `sharegpt`
(whose turns LLaMA-Factory and EAGLE read as exactly `{from, value}`) lists the indexes of the
target's gpt/function_call turns in `conversations` as `target_turns`; `batch` holds only the
final answer, the target's; `tokens` rows are the target's answers alone (a history the input
wrote is prompt, loss 0).

Acceptance (issue 33): a line whose answers carry the engine's speculative-decoding figures
(the records' `spec`, common/contracts.py SpecFigures) has `acceptance`, last:
`{"rate", "mean_length", "steps", "drafted", "accepted"}`. `rate` is accepted / drafted draft
tokens and `mean_length` 1 + accepted / steps (tokens per verify step, the bonus token
included): the names and definitions of vLLM's own `draft_acceptance_rate` and
`mean_acceptance_length`, shortened since the object says what they are of; the counts beside
them are exact (the rates are rounded) and let rows be summed. A line of one answer (a
generation row, a `tokens` row, a `batch` line: its body's answer) carries that answer's own
figures; a conversation line the sum over its answers. A line without figures (the engine did
not speculate or returned none per request, or drafted nothing for it) has no `acceptance` at
all: no null-filled object. Every trainer loader the tests run ignores the key (LLaMA-Factory
maps only its `columns`, SpecForge and speculators read their conversation field, `datasets`
keeps it as a column of its own).

`batch`: OpenAI Batch API output lines: `{"id", "custom_id", "response": {"status_code",
"request_id", "body": <chat.completion>}, "error": null}`; the body holds the last answer (in
mode regenerate, the final turn). Error records become the Batch error file's lines: an HTTP
error as a response with its status and `{"error": {...}}` body, anything else as
`"response": null, "error": {"code", "message"}`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, cast

import orjson

from genqueue.common import defaults
from genqueue.common.acceptance import Tally
from genqueue.common.contracts import ChatMessage, Outcome, ToolSpec
from genqueue.common.errors import UserError
from genqueue.common.records import ErrorRecord, JobFailedRecord, Record, ResultRecord, SpecFigures, Usage
from genqueue.producer.export.generations import answer_outcomes, generations, single_answer

#: One line of the export as a converter builds it: a JSON object, serialised as it is.
Line = dict[str, object]


class ExportFormat(StrEnum):
    """`--format`: the shape of the dataset's lines (parquet: the openai shape in Parquet)."""

    OPENAI = "openai"
    SHAREGPT = "sharegpt"
    SPECFORGE = "specforge"
    BATCH = "batch"
    PARQUET = "parquet"
    TOKENS = "tokens"


class RowLayout(StrEnum):
    """`--rows`: what one line of a conversation-level format holds (FormatSpec.conversation_rows).
    GENERATION: one answer the target generated, after the history exactly as the server was sent
    it (genrows.py); CONVERSATION: the whole conversation, every answer with its thinking."""

    GENERATION = "generation"
    CONVERSATION = "conversation"


#: Outcomes whose answer never ended on its own: no closing think tag is written for them.
UNCLOSED = frozenset({Outcome.CUT_IN_THINKING, Outcome.NO_ANSWER})
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"
#: How LLaMA-Factory's own OpenAI converter joins parallel tool results into one observation.
TOOL_RESULTS_JOIN = "\n</tool_response>\n<tool_response>\n"

_META = ("key", "source", "index", "turn", "sample", "seed")
_MADE_BY = ("model", "fingerprint", "outcome", "usage", "stopped", "note", "variant")


def record_outcome(rec: ResultRecord) -> str:
    """The record's outcome, told truthfully also for records written before `partial`
    existed: a regenerate conversation stopped by an error (or whose cut turn was dropped) is
    partial, whatever its last good turn said."""
    stopped = rec.get("stopped")
    if isinstance(stopped, dict) and (stopped.get("reason") == "error" or stopped.get("dropped")):
        return Outcome.PARTIAL.value
    outcome = rec.get("outcome")
    return outcome if isinstance(outcome, str) else "unknown"


def line_id(rec: Record | JobFailedRecord, *, per_turn: bool = False) -> str:
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


#: The per-message field that says an assistant message was generated by the target.
GENERATED = "generated_by_target"


def target_turns(rec: ResultRecord) -> list[bool]:
    """For each assistant message of REC's conversation, in order: whether the target wrote it.
    regenerate: the answers it regenerated (all, up to where it stopped); the other modes: the
    final answer only, after the input's own history answers."""
    messages = rec.get("messages") or []
    n = sum(1 for m in messages if m.get("role") == "assistant")
    turns = rec.get("turns")
    if turns is not None:
        return [i < len(turns) for i in range(n)]
    return [False] * n + [True]


def has_original_turns(rec: ResultRecord) -> bool:
    """REC's conversation holds assistant turns the target did not write (its input's own)."""
    messages = rec.get("messages") or []
    turns = rec.get("turns")
    if turns is None:
        return any(m.get("role") == "assistant" for m in messages)
    return sum(1 for m in messages if m.get("role") == "assistant") > len(turns)


#: The line's acceptance object (see the module docstring), and its rates' decimals.
ACCEPTANCE = "acceptance"
_DIGITS = defaults.EXPORT_ACCEPTANCE_DIGITS


def acceptance(figures: Iterable[SpecFigures | None]) -> Line | None:
    """The acceptance object of a line whose answers carry FIGURES (None for an answer without),
    summed; None when no draft token was proposed for them (nothing to say)."""
    t = Tally()
    for spec in figures:
        if spec:
            t.add(spec)
    if not t.drafted or not t.steps:
        return None
    return {"rate": round(t.accepted / t.drafted, _DIGITS), "mean_length": round(1 + t.accepted / t.steps, _DIGITS),
            "steps": t.steps, "drafted": t.drafted, "accepted": t.accepted}


def record_figures(rec: ResultRecord) -> list[SpecFigures | None]:
    """Each answer's figures of REC, in order (a regenerate record: its turns'; else its own)."""
    turns = rec.get("turns")
    if turns is not None:
        return [t.get("spec") for t in turns]
    return [rec.get("spec")]


def _with_acceptance(out: Line, figures: Iterable[SpecFigures | None]) -> Line:
    acc = acceptance(figures)
    if acc is not None:
        out[ACCEPTANCE] = acc
    return out


def _meta(rec: Mapping[str, object], out: Line, fields: tuple[str, ...] = _META + _MADE_BY) -> Line:
    for name in fields:
        value = rec.get(name)
        if value is not None:
            out[name] = value
    return out


def tools_text(tools: list[ToolSpec]) -> str:
    """A row's `tools`: the request's tool schemas as JSON text, read back by every release of
    `datasets` exactly as written (see Nested fields in the module docstring)."""
    return orjson.dumps(tools).decode()


def to_openai(rec: ResultRecord, *, per_turn: bool = False, marks: list[bool] | None = None) -> Line:
    """The openai-format export line of a success record (MARKS: who wrote each assistant
    message, when not target_turns(rec): a generation row's, genrows.py)."""
    authors = iter(target_turns(rec) if marks is None else marks)
    messages = [{**m, GENERATED: next(authors)} if m.get("role") == "assistant" else m for m in conversation(rec)]
    out: Line = {"id": line_id(rec, per_turn=per_turn), "messages": messages}
    if rec.get("tools"):
        out["tools"] = tools_text(rec["tools"])
    return _with_acceptance(_meta(rec, out), record_figures(rec))


def to_sharegpt(rec: ResultRecord, *, per_turn: bool = False, marks: list[bool] | None = None) -> Line:
    """The sharegpt-format (LLaMA-Factory) export line of a success record (MARKS: as to_openai)."""
    conv: list[dict[str, str]] = []
    system: list[str] = []
    authors = iter(target_turns(rec) if marks is None else marks)
    generated: list[int] = []
    for msg, unclosed in _conversation(rec):
        role = msg.get("role")
        if role in ("system", "developer"):
            system.append(_text(msg.get("content")))
        elif role == "user":
            conv.append({"from": "human", "value": _text(msg.get("content"))})
        elif role == "assistant":
            if next(authors):
                generated.append(len(conv))
            conv.append(_sharegpt_assistant(msg, unclosed))
        elif role == "tool":
            if conv and conv[-1]["from"] == "observation":  # parallel calls' results: one turn
                conv[-1]["value"] += TOOL_RESULTS_JOIN + _text(msg.get("content"))
            else:
                conv.append({"from": "observation", "value": _text(msg.get("content"))})
    if system:
        conv.insert(0, {"from": "system", "value": "\n\n".join(system)})
        generated = [i + 1 for i in generated]
    out: Line = {"id": line_id(rec, per_turn=per_turn), "conversations": conv, "target_turns": generated}
    if rec.get("tools"):  # LLaMA-Factory keeps the tool schemas as a JSON string
        out["tools"] = tools_text(rec["tools"])
    return _with_acceptance(_meta(rec, out), record_figures(rec))


def to_specforge(rec: ResultRecord, *, per_turn: bool = False, marks: list[bool] | None = None) -> Line:
    """The SpecForge-format export line of a success record (MARKS: as to_openai)."""
    conv: list[Line] = []
    authors = iter(target_turns(rec) if marks is None else marks)
    for msg in conversation(rec):
        role = "system" if msg.get("role") == "developer" else msg.get("role")
        turn: Line = {"role": role, "content": _text(msg.get("content"))}
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
    return _with_acceptance(_meta(rec, out), record_figures(rec))


def to_batch(rec: ResultRecord, *, per_turn: bool = False) -> Line:
    """The OpenAI Batch API output line of a success record."""
    key = str(rec.get("key", ""))
    turns = rec.get("turns") or []
    found: Usage = (turns[-1].get("usage") if turns else None) or rec.get("usage") or {}
    usage: Usage = {**found}
    if "total_tokens" not in usage:
        usage["total_tokens"] = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    message: Line = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning") is not None:
        message["reasoning"] = rec["reasoning"]
    if rec.get("tool_calls"):
        message["tool_calls"] = rec["tool_calls"]
    timings = rec.get("timings")
    finished = timings.get("finished_at") if timings else None
    body = {
        "id": f"chatcmpl-{key}",
        "object": "chat.completion",
        "created": int(finished or 0),
        "model": rec.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": rec.get("finish_reason"), "logprobs": None}],
        "usage": usage,
        "system_fingerprint": rec.get("fingerprint"),
    }
    out: Line = {"id": f"batch_req_{key}", "custom_id": line_id(rec, per_turn=per_turn),
                 "response": {"status_code": 200, "request_id": f"req_{key}", "body": body}, "error": None}
    _meta(rec, out, _META + ("model", "fingerprint", "outcome", "stopped"))
    return _with_acceptance(out, record_figures(rec)[-1:])  # the body's answer: the last


class NoTokenIdsError(UserError):
    """--format tokens met a record without token ids (made before the run asked for them)."""


def to_tokens(rec: ResultRecord, *, per_turn: bool = False) -> list[Line]:
    """The tokens-format rows of a success record: one per generated answer (see the module
    docstring), the answers of generations() each with its outcome as answer_outcomes judges it
    (the generation rows' rule). Raises NoTokenIdsError for a record that kept no ids."""
    base = line_id(rec, per_turn=per_turn)
    try:
        gens = generations(rec)
    except ValueError as e:
        raise NoTokenIdsError(f"--format tokens: record {rec.get('key')} (id {base}): {e}") from None
    rows: list[Line] = []
    for g, outcome in zip(gens, answer_outcomes(rec, gens), strict=True):
        if g.token_ids is None or g.prompt_ids is None:
            raise NoTokenIdsError(
                f"--format tokens: record {rec.get('key')} (id {base}) has no token ids for its answer {g.index}: "
                "the run kept none when it was made (enqueue with --token-ids, on a server that returns them)")
        completion = g.token_ids["completion"]
        row: Line = {"id": f"{base}-a{g.index}", "input_ids": g.prompt_ids + completion,
                     "loss_mask": [0] * len(g.prompt_ids) + [1] * len(completion)}
        _meta(rec, row, _META + ("model", "fingerprint"))
        row["turn"] = g.turn
        if g.step:
            row["step"] = g.step
        row["outcome"], row["usage"] = outcome, g.usage
        rows.append(_with_acceptance(row, [g.spec]))
    return rows


def llamafactory_dataset_info(name: str, file_name: str, *, tools: bool) -> dict[str, object]:
    """LLaMA-Factory's dataset_info.json entry for a sharegpt export (data/README.md; parser.py
    DatasetAttr). The system prompt is the leading system turn, read through `system_tag`;
    `tools` is read only through `columns`, so it is named when a row has tools (a column
    no row has would be a KeyError in its converter)."""
    columns = {"messages": "conversations", **({"tools": "tools"} if tools else {})}
    tags = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
            "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
    return {name: {"file_name": file_name, "formatting": "sharegpt", "columns": columns, "tags": tags}}


def batch_error(rec: ErrorRecord | JobFailedRecord, *, per_turn: bool = False) -> Line:
    """The OpenAI Batch API error-file line of an error record: an HTTP error (the server's
    status is known) as a response holding the error body, anything else as `error`."""
    key = str(rec.get("key", ""))
    err: Mapping[str, object] = rec.get("error") or {}
    status, message, cls = err.get("status"), str(err.get("message", "")), str(err.get("class", "unknown"))
    out: Line = {"id": f"batch_req_{key}", "custom_id": line_id(rec, per_turn=per_turn)}
    if isinstance(status, int) and not isinstance(status, bool):
        body = {"error": {"message": message, "type": str(err.get("type", "")), "param": None, "code": cls}}
        out["response"] = {"status_code": status, "request_id": f"req_{key}", "body": body}
        out["error"] = None
    else:
        out["response"] = None
        out["error"] = {"code": cls, "message": message}
    return _meta(rec, out, _META + ("fingerprint",))


# --- the registry: one entry per --format -----------------------------------------------------
class Convert(Protocol):
    """A success record's line in a format (PER_TURN: ids unique per turn, see line_id)."""

    def __call__(self, rec: ResultRecord, /, *, per_turn: bool = False) -> Line: ...


class ConvertRows(Protocol):
    """A success record's lines in a format of one line per generated answer."""

    def __call__(self, rec: ResultRecord, /, *, per_turn: bool = False) -> list[Line]: ...


class ConvertError(Protocol):
    """An error record's line in a format's errors file."""

    def __call__(self, rec: ErrorRecord | JobFailedRecord, /, *, per_turn: bool = False) -> Line: ...


#: A format's converter with its ids chosen (see converter, error_converter).
Converter = Callable[[ResultRecord], Line]
RowsConverter = Callable[[ResultRecord], list[Line]]
ErrorConverter = Callable[[ErrorRecord | JobFailedRecord], Line]


@dataclass(frozen=True, slots=True)
class SideFile:
    """A file written beside the dataset for the tool that reads it (`<stem><suffix>`)."""

    suffix: str
    what: str  # what it holds, in words
    label: str  # its row in the export's summary
    reader: str  # the tool that reads it
    loads: tuple[str, ...]  # the dataset file types that tool loads: beside another, none is written
    entry: Callable[[str, str, bool], dict[str, object]]  # (dataset name, file name, rows have tools)


@dataclass(frozen=True, slots=True)
class FormatSpec:
    """What `--format` F writes: CONVERT makes a success record's line, ERROR_LINE an error
    record's errors-file line (None: the record as read). LINES: the format whose lines these
    are, when another's (parquet: openai's). PARQUET: the lines may be written as Parquet
    (the format then has an Arrow schema in parquet.py); NOT_PARQUET says what it writes
    instead. ONLY_PARQUET: always Parquet. SIDE_FILE: a file written beside the dataset.
    ROWS: a format of one line per generated answer makes them with ROWS (CONVERT then names
    none of them: it is its first line); TOKEN_IDS: only runs made with --token-ids have them.
    CONVERSATION_ROWS: a line is a conversation, written one row per generation (`--rows
    generation`, the default: genrows.py) or one per conversation (`--rows conversation`)."""

    help: str  # its part of --format's help
    convert: Convert
    error_line: ConvertError | None = None
    lines: ExportFormat | None = None
    parquet: bool = True
    not_parquet: str = ""
    only_parquet: bool = False
    side_file: SideFile | None = None
    rows: ConvertRows | None = None
    token_ids: bool = False
    conversation_rows: bool = False


#: LLaMA-Factory's dataset_info.json entry; it loads these types only (extras/constants.py
#: FILEEXT2TYPE): no compressed JSONL.
LLAMAFACTORY_ENTRY = SideFile(
    ".dataset_info.json", "dataset_info.json entry", "LLaMA-Factory entry", "LLaMA-Factory",
    (".jsonl", ".json", ".parquet"),
    lambda name, file_name, tools: llamafactory_dataset_info(name, file_name, tools=tools))

FORMATS: dict[ExportFormat, FormatSpec] = {
    ExportFormat.OPENAI: FormatSpec(
        "chat `messages`, each answer's thinking as `reasoning_content` beside it", to_openai,
        conversation_rows=True),
    ExportFormat.SHAREGPT: FormatSpec(
        "LLaMA-Factory's conversations of from/value, thinking as <think>...</think> in gpt turns (EAGLE reads "
        "it too)", to_sharegpt, side_file=LLAMAFACTORY_ENTRY, conversation_rows=True),
    ExportFormat.SPECFORGE: FormatSpec(
        "SpecForge's conversations of role/content with reasoning_content", to_specforge,
        conversation_rows=True),
    ExportFormat.BATCH: FormatSpec(
        "OpenAI Batch API output lines", to_batch, error_line=batch_error, parquet=False,
        not_parquet="the Batch API's JSONL output file"),
    ExportFormat.PARQUET: FormatSpec(
        "the openai shape in Parquet (any shape is Parquet when the output is named .parquet)", to_openai,
        lines=ExportFormat.OPENAI, only_parquet=True, conversation_rows=True),
    ExportFormat.TOKENS: FormatSpec(
        "one row per generated answer: input_ids (the prompt ids the engine rendered, then the ids it generated) "
        "and a loss_mask of 1 on exactly the generated ids, as speculators trains on them (runs made with "
        "--token-ids)", lambda rec, *, per_turn=False: to_tokens(rec, per_turn=per_turn)[0],
        rows=to_tokens, token_ids=True),
}


def format_help() -> str:
    """--format's help: each format and what it writes."""
    return "; ".join(f"{fmt}: {spec.help}" for fmt, spec in FORMATS.items()) + "."


def converter(fmt: ExportFormat, *, per_turn: bool = False) -> Converter:
    """FMT's converter of success records; PER_TURN: ids unique per turn (mode each, see line_id)."""
    fn = FORMATS[fmt].convert
    return functools.partial(fn, per_turn=True) if per_turn else fn


def rows_converter(fmt: ExportFormat, *, per_turn: bool = False) -> RowsConverter:
    """FMT's converter of a success record to its lines: one, or one per generated answer."""
    spec = FORMATS[fmt]
    rows, convert = spec.rows, spec.convert
    if rows is not None:
        return functools.partial(rows, per_turn=per_turn)
    return lambda rec: [convert(rec, per_turn=per_turn)]


def error_converter(fmt: ExportFormat, *, per_turn: bool = False) -> ErrorConverter | None:
    """FMT's converter of error records to its errors-file lines; None: they are written as read."""
    fn = FORMATS[fmt].error_line
    if fn is None:
        return None
    return functools.partial(fn, per_turn=True) if per_turn else fn


def conversation(rec: ResultRecord) -> list[ChatMessage]:
    """The record's full conversation, every generated assistant message carrying its thinking
    as `reasoning_content`."""
    return [msg for msg, _ in _conversation(rec)]


def _conversation(rec: ResultRecord) -> list[tuple[ChatMessage, bool]]:
    """The conversation, each message with whether it is an answer that never ended on its own."""
    # The contract still types a record's messages and tool calls as plain dicts (the consumer
    # builds them so); they are OpenAI chat messages.
    messages = cast(list[ChatMessage], rec.get("messages") or [])
    turns = rec.get("turns")
    if turns is not None:  # regenerate: messages already hold the answers, turns their thinking
        out = []
        i = 0
        for msg in messages:
            unclosed = False
            if msg.get("role") == "assistant":
                msg = msg.copy()
                msg.pop("reasoning_content", None)
                if i < len(turns):
                    turn = turns[i]
                    reasoning, outcome = turn.get("reasoning"), turn.get("outcome")
                else:
                    reasoning = outcome = None
                if reasoning is not None:
                    msg["reasoning_content"] = reasoning
                unclosed = outcome in UNCLOSED
                i += 1
            out.append((msg, unclosed))
        return out
    return [*((m, False) for m in messages), (single_answer(rec), rec.get("outcome") in UNCLOSED)]


def thinking_text(msg: ChatMessage, unclosed: bool) -> str:
    """The thinking of an assistant message as LLaMA-Factory's ReasoningTemplate reads it
    inside the answer: opened, and closed only when the model closed it."""
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        return ""
    return THINK_OPEN + _text(reasoning) + ("" if unclosed else THINK_CLOSE)


def _sharegpt_assistant(msg: ChatMessage, unclosed: bool) -> dict[str, str]:
    thought = thinking_text(msg, unclosed)
    content = _text(msg.get("content"))
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


def _text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
