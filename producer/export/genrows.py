"""One row per generation (pure, no I/O): what a record becomes under `--rows`, and what each
layout keeps of its thinking.

`--rows generation` (the default for the formats whose line is a conversation: FormatSpec
.generation_line) writes one row per answer the target generated (generations.py): the history
exactly as the server was sent it, then that answer with its thinking, the row's last assistant
turn and its one training target. Each row is the format's own line of that one generation, plus
`id` (the record's line id with `-a<n>`, as the `tokens` row of the same answer), `generation`
(n), `turn`, `step` (its place after tool results), and the answer's own `outcome`, `usage` and
`acceptance`; in a format with FormatSpec.weighted, `weight` 1 on the answer and 0 on every
history answer. Reasoning models' chat templates render thinking only after the last user
message, so a conversation row trains its earlier answers on a history the server never saw;
in a generation row every trace is rendered, on the context the server had.

A row is complete (outcome `finished`) when its own answer and every answer of its history
finished; else its outcome is the first one that did not (generations.answer_outcomes, the rule
`--format tokens` judges its rows by too). Complete rows go to the dataset, the rest to the
truncated file: nothing half-generated is passed off as complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from genqueue.common.records import ResultRecord
from genqueue.producer.export.formats import FORMATS, ExportFormat
from genqueue.producer.export.formats.lines import line_id, target_turns
from genqueue.producer.export.formats.spec import Line, RowLayout
from genqueue.producer.export.generations import Generation, answer_outcomes, generations

#: The per-message field that says which answer a generation row trains: 1 on it, 0 on the history's.
WEIGHT = "weight"


@dataclass(slots=True)
class RecordRows:
    """A success record's lines under the chosen layout, and what each layout keeps of it."""

    included: list[Line] = field(default_factory=list)  # to the dataset
    excluded: list[Line] = field(default_factory=list)  # to the truncated file
    generation_rows: int = 0  # dataset rows it makes under --rows generation
    conversation_row: bool = False  # it makes a dataset row under --rows conversation
    traces: int = 0  # the thinking traces its generations hold
    kept_generation: int = 0  # of them, in its dataset rows under --rows generation
    kept_conversation: int = 0  # rendered by a Qwen3-style template in its conversation row, when in the dataset


def has_trace(g: Generation) -> bool:
    """The answer holds a thinking trace (text a chat template would render)."""
    reasoning = g.answer.get("reasoning_content")
    return isinstance(reasoning, str) and bool(reasoning.strip())


def generation_row(fmt: ExportFormat, rec: ResultRecord, g: Generation, outcome: str, *,
                   per_turn: bool = False) -> Line:
    """FMT's line of generation G of REC (see the module docstring)."""
    authored = target_turns(rec)
    before = sum(1 for m in g.history if m.get("role") == "assistant")
    one = _one_generation(rec, g, outcome)
    spec = FORMATS[fmt]
    if spec.generation_line is None:
        raise ValueError(f"--format {fmt} has no generation rows")
    line = spec.generation_line(one, per_turn=per_turn, marks=[*authored[:before], True])
    line["id"] = f"{line_id(rec, per_turn=per_turn)}-a{g.index}"
    container = spec.weighted
    if container is not None:
        turns = cast(list[Line], line[container])
        last = max(i for i, t in enumerate(turns) if t.get("role") == "assistant")
        line[container] = [{**t, WEIGHT: int(i == last)} if t.get("role") == "assistant" else t
                           for i, t in enumerate(turns)]
    line["generation"], line["step"] = g.index, g.step
    return line


def record_rows(fmt: ExportFormat, rec: ResultRecord, *, layout: RowLayout, include: frozenset[str],
                conversation_line: Line, per_turn: bool = False) -> RecordRows:
    """REC's rows under LAYOUT, split by INCLUDE (the outcomes the dataset holds), with what
    each layout keeps of its thinking. CONVERSATION_LINE: REC's line under --rows conversation
    (rec's outcome is record_outcome's, set by the caller)."""
    outcome = str(rec.get("outcome") or "unknown")
    gens = generations(rec, prompt_ids=False)
    outcomes = answer_outcomes(rec, gens)
    rows = RecordRows(conversation_row=outcome in include)
    messages = rec.get("messages") or []
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    for g, row_outcome in zip(gens, outcomes, strict=True):
        traced = has_trace(g)
        rows.traces += traced
        if rows.conversation_row and traced and len(g.history) > last_user:
            rows.kept_conversation += 1
        if row_outcome in include:
            rows.generation_rows += 1
            rows.kept_generation += traced
        if layout is RowLayout.GENERATION:
            line = generation_row(fmt, rec, g, row_outcome, per_turn=per_turn)
            (rows.included if row_outcome in include else rows.excluded).append(line)
    if layout is RowLayout.CONVERSATION:
        (rows.included if rows.conversation_row else rows.excluded).append(conversation_line)
    return rows


def _one_generation(rec: ResultRecord, g: Generation, outcome: str) -> ResultRecord:
    """REC as a record of its one generation G: G's history as its messages, G's answer,
    outcome and usage; the record's provenance as it is."""
    one = cast(dict[str, object], {k: v for k, v in rec.items()
                                   if k not in ("turns", "content", "reasoning", "tool_calls", "token_ids", "spec")})
    one.update(messages=g.history, content=g.answer.get("content") or "", outcome=outcome, usage=g.usage,
               turn=g.turn)
    if g.answer.get("reasoning_content") is not None:
        one["reasoning"] = g.answer["reasoning_content"]
    if g.answer.get("tool_calls"):
        one["tool_calls"] = g.answer["tool_calls"]
    if g.spec:  # the row's acceptance is its one answer's (lines.acceptance)
        one["spec"] = g.spec
    return cast(ResultRecord, one)
