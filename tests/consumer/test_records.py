"""Record building (consumer/answer/records.py), pure: no endpoint, no Redis."""

from __future__ import annotations

from typing import Any

from genqueue.common.contracts import ChatMessage, ErrorClass, Item, Note, Outcome, ReasoningForm
from genqueue.common.records import TurnRecord
from genqueue.common.settings import RunSettings
from genqueue.consumer.answer import records
from genqueue.consumer.answer.completion import Turn
from genqueue.consumer.answer.faults import BadResponseError, PermanentError
from genqueue.consumer.answer.generate import RunContext

CTX = RunContext("r", RunSettings(), "m", {"host": "h", "gpu": None, "worker": "w", "endpoint": "e"})
ITEM: Item = {"key": "a" * 32, "index": 4, "turn": None, "messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "function", "function": {"name": "f"}}], "id": "rec-9", "source": "in.jsonl",
              "source_seq": 1, "sample": 2, "seed": 77}


def turn(content: str = "ok", finish: str = "stop", tool_calls: list[Any] | None = None) -> Turn:
    return Turn(content=content, reasoning=None, reasoning_form=ReasoningForm.NONE, tool_calls=tool_calls or [],
                finish_reason=finish, usage={"prompt_tokens": 3, "completion_tokens": 2}, model=None)


def test_an_internal_error_record_carries_the_items_provenance_and_a_bounded_message() -> None:
    rec = records.internal_error(CTX, ITEM, 2, ValueError("x" * 5000))
    assert rec["error"]["class"] == ErrorClass.INTERNAL and rec["error"]["type"] == "ValueError"
    assert len(rec["error"]["message"]) == records.INTERNAL_MESSAGE_CHARS
    assert rec["error"]["message"].startswith("ValueError: xxx")
    assert (rec["key"], rec["index"], rec["attempt"], rec["run"]) == ("a" * 32, 4, 2, "r")
    assert (rec["id"], rec["source"], rec["source_seq"], rec["sample"], rec["seed"]) == ("rec-9", "in.jsonl", 1, 2, 77)
    assert rec["sampling"]["seed"] == 77 and rec["tools"] == ITEM["tools"]
    assert rec["messages"] == ITEM["messages"]


def test_an_item_that_is_not_even_a_dict_still_gets_a_record() -> None:
    rec = records.internal_error(CTX, "garbage", 1, KeyError("role"))  # type: ignore[arg-type]
    assert rec["error"]["message"] == "KeyError: 'role'"
    assert (rec["key"], rec["index"], rec["turn"], rec["messages"]) == ("", -1, None, [])


def test_a_fault_error_takes_its_class_from_faults() -> None:
    base = records.record_base(CTX, ITEM, 1, records.messages_of(ITEM))
    bad = records.fault_error(base, BadResponseError("empty body", snippet=""))["error"]
    assert (bad["class"], bad["type"], bad["status"]) == (ErrorClass.BAD_RESPONSE, "BadResponseError", 200)
    refused = records.fault_error(base, PermanentError("HTTP 400: too long", status=400))["error"]
    assert (refused["class"], refused["status"], refused["message"]) == (ErrorClass.PERMANENT, 400, "HTTP 400: too long")


def test_a_cut_answer_under_truncation_error_keeps_what_it_said() -> None:
    base = records.record_base(CTX, ITEM, 1, records.messages_of(ITEM))
    rec = records.truncated_error(base, turn("half an ans", finish="length"))
    assert rec["error"]["class"] == ErrorClass.TRUNCATED and rec["error"]["type"] == Outcome.CUT_IN_ANSWER
    assert rec["partial"] == {"content": "half an ans", "reasoning": None, "finish_reason": "length",
                              "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


def test_stopped_holds_only_the_details_given_in_a_stable_order() -> None:
    info = records.truncated_info(Outcome.CUT_IN_ANSWER)
    assert list(records.stop(2, 0, Outcome.CUT_IN_ANSWER, dropped=True, error=info)) == ["turn", "reason", "dropped",
                                                                                          "error"]
    assert records.stop(1, 2, Note.TOOL_CALL_DIVERGED, recorded=[], target=[]) == {
        "turn": 1, "reason": Note.TOOL_CALL_DIVERGED, "step": 2, "recorded": [], "target": []}
    assert records.stop(0, 0, Outcome.CUT_IN_THINKING) == {"turn": 0, "reason": Outcome.CUT_IN_THINKING}


def test_a_conversation_whose_later_turn_failed_is_partial_and_sums_its_usage() -> None:
    first = records.turn_record(turn("one"), 0, 0, None, "m")
    second = records.turn_record(turn("two"), 1, 0, None, "m")
    turns: list[TurnRecord] = [first, second]
    history: list[ChatMessage] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one"},
                              {"role": "user", "content": "b"}, {"role": "assistant", "content": "two"}]
    base = records.record_base(CTX, ITEM, 1, history)
    failed = records.stop(2, 0, "error", error=records.fault_info(PermanentError("HTTP 400", status=400)))
    rec = records.conversation_record(base, turns, history, failed, history_reasoning="drop", turns_total=3,
                                      resumed_at=None)
    assert rec["outcome"] == Outcome.PARTIAL and rec["content"] == "two" and rec["turns_total"] == 3
    assert rec["usage"] == {"prompt_tokens": 6, "completion_tokens": 4}
    assert "note" not in rec and "resumed_at_turn" not in rec
    cut = records.stop(1, 0, Outcome.CUT_IN_ANSWER)
    kept = records.conversation_record(base, turns, history, cut, history_reasoning="drop", turns_total=3,
                                       resumed_at=1)
    assert kept["outcome"] == Outcome.FINISHED and kept["resumed_at_turn"] == 1  # the last turn's own outcome


def test_the_assistant_message_keeps_thinking_only_when_asked() -> None:
    t = Turn(content="4", reasoning="2+2", reasoning_form=ReasoningForm.FIELD, tool_calls=[], finish_reason="stop",
             usage={}, model="m")
    assert records.assistant_message(t, "drop") == {"role": "assistant", "content": "4"}
    assert records.assistant_message(t, "keep") == {"role": "assistant", "content": "4", "reasoning_content": "2+2"}


def test_a_record_is_complete_when_records_returns_it_timings_and_copy_last() -> None:
    timings = records.timings(1.0, 2.0, 3.0, 0.123456)
    answered = records.Answered(records.messages_of(ITEM), turn("ok"),
                                {"policy": "retry", "first_outcome": Outcome.CUT_IN_ANSWER, "retried": False})
    rec = records.record(CTX, ITEM, 1, answered, timings=timings, copy=True)
    assert list(rec)[-3:] == ["truncation", "timings", "copy"]
    assert rec["timings"] == {"enqueued_at": 1.0, "started_at": 2.0, "finished_at": 3.0, "latency_s": 0.1235}
    assert rec["copy"] is True and rec["model"] == "m" and rec["sampling"]["seed"] == 77
    plain = records.record(CTX, ITEM, 1, records.Answered(records.messages_of(ITEM), turn("ok")))
    assert "timings" not in plain and "copy" not in plain and "truncation" not in plain
    cut = records.record(CTX, ITEM, 1, records.Cut(records.messages_of(ITEM), turn("half", finish="length")),
                         timings=timings)
    assert cut["error"]["class"] == ErrorClass.TRUNCATED and list(cut)[-1] == "timings"
    failed = records.record(CTX, ITEM, 2, records.Failed([], PermanentError("HTTP 400", status=400)))
    assert failed["error"]["class"] == ErrorClass.PERMANENT and failed["messages"] == [] and failed["attempt"] == 2
    crashed = records.record(CTX, ITEM, 1, records.Crashed(KeyError("x")), timings=timings)
    assert crashed["error"]["class"] == ErrorClass.INTERNAL and crashed["timings"] == timings


def test_a_turn_says_whether_the_recorded_tool_results_were_spliced_after_it() -> None:
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    entry, message = records.answered_turn(turn("", tool_calls=calls), 0, 1, None, "m", "drop", spliced=True)
    assert list(entry)[-1] == "tool_results_spliced" and entry["tool_results_spliced"] is True
    assert entry["step"] == 1 and message == {"role": "assistant", "content": "", "tool_calls": calls}
    assert "tool_results_spliced" not in records.turn_record(turn(), 0, 0, None, "m")
    history: list[ChatMessage] = [{"role": "user", "content": "a"}, message]
    conv = records.record(CTX, ITEM, 1, records.Conversation(history, [entry], None, "drop", 1))
    assert conv["turns"][0]["tool_results_spliced"] is True and conv["history_reasoning"] == "drop"


def test_a_run_declared_an_evaluation_names_its_drafter_on_every_record_and_others_do_not() -> None:
    cand = RunContext("r", RunSettings(drafter="eagle3-r2"), "m", CTX.consumer)
    for ctx, want in ((cand, "eagle3-r2"), (CTX, None)):
        base = records.record_base(ctx, ITEM, 1, records.messages_of(ITEM))
        rec = records.result_record(base, turn(), "m")
        assert base.get("drafter") == want and rec.get("drafter") == want
