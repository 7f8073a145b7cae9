"""Generation rows (genrows.py): which rows a cut or partial conversation gives, their ids and
marks, what each layout keeps of the thinking; the sharegpt Parquet schema."""

from __future__ import annotations

from typing import Any, cast

from genqueue.common.records import ResultRecord
from genqueue.producer.export.formats import ExportFormat
from genqueue.producer.export.formats.lines import record_outcome
from genqueue.producer.export.formats.openai import to_openai
from genqueue.producer.export.formats.spec import RowLayout
from genqueue.producer.export.genrows import record_rows
from genqueue.producer.export.parquet import schema_for

FINISHED = frozenset({"finished"})


def _conversation(outcomes: list[str], *, stopped: dict[str, Any] | None = None) -> ResultRecord:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
    turns = []
    for k, outcome in enumerate(outcomes):
        messages += [{"role": "user", "content": f"u{k}"}, {"role": "assistant", "content": f"a{k}"}]
        turns.append({"turn": k, "content": f"a{k}", "reasoning": f"r{k}", "outcome": outcome, "usage": {}})
    rec: dict[str, Any] = {"key": "k", "id": "c", "index": 0, "turn": None, "run": "r", "sampling": {},
                           "fingerprint": "f", "messages": messages, "turns": turns, "outcome": outcomes[-1]}
    if stopped:
        rec["stopped"] = stopped
    out = cast(ResultRecord, rec)
    out["outcome"] = record_outcome(out)
    return out


def _rows(rec: ResultRecord, layout: RowLayout = RowLayout.GENERATION, fmt: ExportFormat = ExportFormat.OPENAI) -> Any:
    return record_rows(fmt, rec, layout=layout, include=FINISHED, conversation_line=to_openai(rec))


def test_a_finished_conversation_is_one_row_per_answer_with_the_history_as_sent() -> None:
    rows = _rows(_conversation(["finished"] * 3))
    assert [r["id"] for r in rows.included] == ["c-a0", "c-a1", "c-a2"] and not rows.excluded
    last = rows.included[2]
    assert [m.get("weight") for m in last["messages"] if m["role"] == "assistant"] == [0, 0, 1]
    assert [m.get("reasoning_content") for m in last["messages"] if m["role"] == "assistant"] == [None, None, "r2"]
    assert (last["generation"], last["turn"], last["step"], last["outcome"]) == (2, 2, 0, "finished")
    # every trace kept by generation rows, only the last user turn's by the conversation row
    assert (rows.traces, rows.kept_generation, rows.kept_conversation) == (3, 3, 1)
    assert (rows.generation_rows, rows.conversation_row) == (3, True)


def test_a_cut_conversation_gives_its_answers_before_the_cut() -> None:
    rows = _rows(_conversation(["finished", "cut_in_answer"]))
    assert [r["id"] for r in rows.included] == ["c-a0"]
    assert [(r["id"], r["outcome"]) for r in rows.excluded] == [("c-a1", "cut_in_answer")]
    conv = _rows(_conversation(["finished", "cut_in_answer"]), RowLayout.CONVERSATION)
    assert not conv.included and len(conv.excluded) == 1 and conv.kept_conversation == 0


def test_a_partial_conversation_gives_its_finished_answers_and_nothing_after_a_cut_is_complete() -> None:
    partial = _conversation(["finished", "finished"], stopped={"turn": 2, "reason": "error"})
    assert partial["outcome"] == "partial"
    assert [r["id"] for r in _rows(partial).included] == ["c-a0", "c-a1"]
    # an answer that finished after a history holding a cut one is not complete
    rows = _rows(_conversation(["finished", "cut_in_answer", "finished"]))
    assert [(r["id"], r["outcome"]) for r in rows.excluded] == [("c-a1", "cut_in_answer"), ("c-a2", "cut_in_answer")]


def test_sharegpt_rows_keep_their_turns_and_parquet_has_no_system_column() -> None:
    rows = _rows(_conversation(["finished"] * 2), fmt=ExportFormat.SHAREGPT)
    last = rows.included[1]
    assert all(set(t) == {"from", "value"} for t in last["conversations"])
    assert last["conversations"][-1]["value"] == "<think>\nr1\n</think>\n\na1" and last["target_turns"] == [2, 4]
    assert "system" not in schema_for(ExportFormat.SHAREGPT).names
    assert {"generation", "step"} <= set(schema_for(ExportFormat.SHAREGPT).names)


def test_the_rows_written_count_the_traces_each_layout_keeps_as_pass_one_does() -> None:
    """rowstats (the count of the rows written, which the summary and the card read) finds in
    the rows exactly the traces genrows says each layout keeps, in every text format."""
    from genqueue.producer.export.formats.sharegpt import to_sharegpt
    from genqueue.producer.export.formats.specforge import to_specforge
    from genqueue.producer.export.rowstats import row_stats

    blank = _conversation(["finished"] * 3)
    blank["turns"][1]["reasoning"] = "  "  # thinking that is blank is no trace
    for rec in (_conversation(["finished"] * 3), blank, _conversation(["finished", "finished"],
                                                                     stopped={"turn": 2, "reason": "error"})):
        for fmt, convert in ((ExportFormat.OPENAI, to_openai), (ExportFormat.SPECFORGE, to_specforge),
                             (ExportFormat.SHAREGPT, to_sharegpt)):
            gen = record_rows(fmt, rec, layout=RowLayout.GENERATION, include=frozenset({"finished", "partial"}),
                              conversation_line=convert(rec))
            conv = record_rows(fmt, rec, layout=RowLayout.CONVERSATION, include=frozenset({"finished", "partial"}),
                               conversation_line=convert(rec))
            written = row_stats(gen.included)
            assert (written.traces, written.entries, written.conversations) == (
                gen.kept_generation, gen.generation_rows, 1), fmt
            assert row_stats(conv.included).traces == conv.kept_conversation, fmt
