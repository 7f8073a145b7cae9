"""Each export shape, field by field, against what its training tool's loader reads.

The rules come from the tools' own files (tests/producer/export/loaders.py cites each; SpecForge's
validator is run as copied): LLaMA-Factory's sharegpt converter and templates, EAGLE-3's
preprocessing, SpecForge's validate_row, the OpenAI SDK's ChatCompletion model for Batch
bodies. Nothing fabricated: a turn cut in its thinking never gets a closing tag.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessage

from genqueue.common.errors import UserError
from genqueue.producer.export import parquet as export_parquet
from genqueue.producer.export.command import _shape_and_container, export_command
from genqueue.producer.export.formats import FORMATS, ExportFormat, converter
from genqueue.producer.export.formats.batch import batch_error, to_batch
from genqueue.producer.export.formats.lines import has_original_turns, line_id, target_turns
from genqueue.producer.export.formats.openai import to_openai
from genqueue.producer.export.formats.sharegpt import THINK_CLOSE, THINK_OPEN, llamafactory_dataset_info, to_sharegpt
from genqueue.producer.export.formats.specforge import to_specforge
from tests.producer.export import loaders
from tests.producer.export.specforge_validation import validate_row

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
CALL = {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
CALL2 = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
MADE_BY = {"model": "tiny", "fingerprint": "fp0123456789abcd"}


def single(content: str = "It is 4.", reasoning: str | None = "2+2 is 4", outcome: str = "finished",
           **extra: Any) -> dict[str, Any]:
    rec = {"key": "ab" * 16, "index": 3, "turn": None, "run": "r", "id": "q-3", "source": "data/a.jsonl",
           "source_seq": 0, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "What is 2+2?"}],
           "content": content, "reasoning": reasoning, "reasoning_form": "field", "tool_calls": [],
           "finish_reason": "length" if outcome.startswith("cut") else "stop", "outcome": outcome,
           "usage": {"prompt_tokens": 12, "completion_tokens": 9}, "attempt": 1,
           "timings": {"enqueued_at": 1.0, "started_at": 2.0, "finished_at": 1700000000.5, "latency_s": 1.0},
           **MADE_BY}
    rec.update(extra)
    return rec


def regenerated(last_outcome: str = "finished") -> dict[str, Any]:
    """Two user turns; the model called a tool in turn 0 (answered by hand in the prompt's
    history is not possible in regenerate, so: thinking + text turn 0, turn 1 as given)."""
    rec = single()
    rec["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "u0"},
                       {"role": "assistant", "content": "a0"}, {"role": "user", "content": "u1"},
                       {"role": "assistant", "content": "" if last_outcome == "cut_in_thinking" else "a1"}]
    rec["turns"] = [{"turn": 0, "content": "a0", "reasoning": "r0", "outcome": "finished"},
                    {"turn": 1, "content": "", "reasoning": "r1 never clos", "outcome": last_outcome}]
    rec["content"], rec["reasoning"], rec["outcome"] = rec["messages"][-1]["content"], "r1 never clos", last_outcome
    return rec


def with_tools() -> dict[str, Any]:
    """Mode last on a conversation with a tool round trip; the model answers with two calls."""
    rec = single(content="Checking both.", reasoning="need weather", tools=TOOLS)
    rec["messages"] = [{"role": "user", "content": "Weather in Oslo?"},
                       {"role": "assistant", "content": "", "tool_calls": [CALL]},
                       {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_0"},
                       {"role": "assistant", "content": "3 degrees."},
                       {"role": "user", "content": "And Oslo and Rome?"},
                       {"role": "assistant", "content": "", "tool_calls": [CALL, CALL2]},
                       {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_0"},
                       {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "call_1"},
                       {"role": "assistant", "content": "3 and 20."},
                       {"role": "user", "content": "Thanks, and Paris?"}]
    rec["tool_calls"] = [CALL]
    rec["turn"] = 2
    return rec


# --- the registry: one entry per --format ------------------------------------------------------
def test_every_format_is_one_registry_entry_and_one_choice_of_the_command() -> None:
    """A format is added as its module of formats/ and its member and row in the registry alone:
    the CLI's choices and help all follow from them."""
    assert list(FORMATS) == list(ExportFormat)
    option = next(p for p in export_command.params if p.name == "fmt")
    assert list(option.type.choices) == [f.value for f in ExportFormat]  # type: ignore[attr-defined]
    for fmt, spec in FORMATS.items():
        assert f"{fmt}: {spec.help}" in (option.help or "")
        assert spec.lines is None or FORMATS[spec.lines].lines is None  # lines name a shape of their own


def test_a_format_is_written_as_parquet_only_with_a_schema_and_otherwise_refused(tmp_path: Any) -> None:
    for fmt, spec in FORMATS.items():
        shape = spec.lines or fmt
        if spec.parquet:
            assert FORMATS[shape].schema is not None, f"{fmt} may be written as Parquet but has no Arrow schema"
            assert export_parquet.schema_for(shape).names
            assert _shape_and_container(fmt, tmp_path / "d.parquet") == (shape, True)
        else:
            with pytest.raises(UserError, match=f"--format {fmt} writes .*: name the output"):
                _shape_and_container(fmt, tmp_path / "d.parquet")
        if spec.only_parquet:
            with pytest.raises(UserError, match="name the output \\*.parquet"):
                _shape_and_container(fmt, tmp_path / "d.jsonl")
        else:
            assert _shape_and_container(fmt, tmp_path / "d.jsonl") == (shape, False)


def test_error_records_take_the_errors_line_of_their_format() -> None:
    err = {"key": "ab" * 16, "index": 3, "turn": None, "id": "q-3",
           "error": {"class": "permanent", "type": "HTTPError", "status": 400, "message": "too long"}}
    batch = FORMATS[ExportFormat.BATCH].error_line
    assert batch is not None and batch(err)["custom_id"] == "q-3"  # type: ignore[arg-type]
    assert all(spec.error_line is None for fmt, spec in FORMATS.items() if fmt != ExportFormat.BATCH)
    assert converter(ExportFormat.OPENAI, per_turn=True)(single(turn=1))["id"] == "q-3-t1"  # type: ignore[arg-type]


# --- every shape: provenance and what made the line ------------------------------------------
@pytest.mark.parametrize("convert", [to_openai, to_sharegpt, to_specforge, to_batch])
def test_every_line_says_where_from_and_what_made_it(convert: Any) -> None:
    line = convert(single(sample=2, seed=7))
    assert line["model"] == "tiny" and line["fingerprint"] == "fp0123456789abcd" and line["outcome"] == "finished"
    assert (line["key"], line["source"], line["index"], line["sample"], line["seed"]) == (
        "ab" * 16, "data/a.jsonl", 3, 2, 7)
    assert line.get("custom_id", line["id"]) == "q-3-s2"  # unique per sample
    orjson.dumps(line)  # plain JSON all the way down
    no_id = single()
    del no_id["id"]
    assert convert(no_id).get("custom_id", convert(no_id)["id"]) == "ab" * 16  # the key stands in


def test_line_ids_name_the_turn_in_mode_each_and_the_sample() -> None:
    rec = single(turn=2)
    assert line_id(rec) == "q-3" and line_id(rec, per_turn=True) == "q-3-t2"
    assert line_id({**rec, "sample": 2}, per_turn=True) == "q-3-t2-s2" and line_id({**rec, "sample": 0}) == "q-3"
    assert line_id({**rec, "id": None}, per_turn=True) == "ab" * 16  # the key is unique per item already
    assert to_batch(rec, per_turn=True)["custom_id"] == "q-3-t2" == to_sharegpt(rec, per_turn=True)["id"]
    assert batch_error({**rec, "error": {"class": "permanent", "status": 400}}, per_turn=True)["custom_id"] == "q-3-t2"


# --- openai ----------------------------------------------------------------------------------
def test_openai_messages_keep_the_thinking_as_reasoning_content() -> None:
    # reasoning_content: the name chat templates read (tests/producer/export/test_chat_template.py renders it)
    line = to_openai(single())
    assert line["id"] == "q-3" and line["messages"][:2] == single()["messages"]
    answer = line["messages"][-1]
    assert answer == {"role": "assistant", "content": "It is 4.", "reasoning_content": "2+2 is 4",
                      "generated_by_target": True}
    parsed = ChatCompletionMessage.model_validate(answer)  # the OpenAI SDK's own message type
    assert parsed.content == "It is 4." and parsed.model_extra == {"reasoning_content": "2+2 is 4",
                                                                   "generated_by_target": True}
    regen = to_openai(regenerated())
    assert [m.get("reasoning_content") for m in regen["messages"]] == [None, None, "r0", None, "r1 never clos"]
    assert not any("reasoning" in m for m in regen["messages"])
    tools = to_openai(with_tools())
    assert orjson.loads(tools["tools"]) == TOOLS and tools["messages"][-1]["tool_calls"] == [CALL]


# --- sharegpt as LLaMA-Factory reads it ------------------------------------------------------
def test_sharegpt_is_what_llamafactory_trains_on() -> None:
    line = to_sharegpt(single())
    assert line["conversations"] == [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is 2+2?"},
        {"from": "gpt", "value": "<think>\n2+2 is 4\n</think>\n\nIt is 4."}]
    assert "system" not in line and line["id"] == "q-3"
    assert loaders.llamafactory_sharegpt(line) == []
    assert loaders.llamafactory_thought(line["conversations"][2]["value"]) == ("2+2 is 4", "It is 4.")
    bare = to_sharegpt(single(reasoning=None))["conversations"][2]["value"]
    assert bare == "It is 4." and loaders.llamafactory_thought(bare) == (None, "It is 4.")  # LF adds an empty cot
    regen = to_sharegpt(regenerated())
    assert loaders.llamafactory_sharegpt(regen) == []
    assert [t["from"] for t in regen["conversations"]] == ["system", "human", "gpt", "human", "gpt"]


def test_system_prompts_and_tools_reach_every_sharegpt_loader() -> None:
    """The system prompt as the leading system turn, tools as a JSON string: LLaMA-Factory
    (with the dataset_info.json entry export prints), SpecForge and speculators all read both;
    EAGLE-3 skips the system turn and trains on the rest."""
    rec = single(tools=TOOLS)
    line = to_sharegpt(rec)
    entry = llamafactory_dataset_info("d", "d.jsonl", tools=True)
    assert entry["d"]["columns"] == {"messages": "conversations", "tools": "tools"}
    system, tools, turns = loaders.llamafactory_read(line, entry["d"])
    assert (system, orjson.loads(tools), turns) == ("Be brief.", TOOLS, 2)
    assert loaders.llamafactory_read(line)[:2] == ("Be brief.", "")  # no entry: the system turn alone survives
    assert loaders.specforge_read(line) == ("Be brief.", TOOLS)
    assert loaders.speculators_read(line) == (["system", "user", "assistant"], TOOLS)
    assert loaders.eagle3([line]) == []
    # without a system prompt nothing stands in for one, and no tools column is named
    bare = to_sharegpt(single(messages=[{"role": "user", "content": "hi"}]))
    assert bare["conversations"][0]["from"] == "human"
    assert loaders.specforge_read(bare)[0] == loaders.SPECFORGE_DEFAULT_SYSTEM
    assert "tools" not in llamafactory_dataset_info("d", "d.jsonl", tools=False)["d"]["columns"]


def test_tool_turns_for_speculators_are_in_the_specforge_shape() -> None:
    """speculators reads any role it does not know as assistant: sharegpt's function_call and
    observation turns would all be answers there. The specforge shape carries the calls as
    OpenAI tool_calls and the results as tool turns, which it reads as they are."""
    roles, tools = loaders.speculators_read(to_specforge(with_tools()))
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant", "tool", "tool", "assistant",
                     "user", "assistant"] and tools == TOOLS
    shared = loaders.speculators_read(to_sharegpt(with_tools()))[0]
    assert shared.count("assistant") == 7  # function_call and observation turns taken for answers


def test_sharegpt_tool_turns_alternate_as_llamafactory_demands() -> None:
    line = to_sharegpt(with_tools())
    assert loaders.llamafactory_sharegpt(line) == []
    turns = line["conversations"]
    assert [t["from"] for t in turns] == ["human", "function_call", "observation", "gpt", "human",
                                          "function_call", "observation", "gpt", "human", "function_call"]
    assert orjson.loads(turns[1]["value"]) == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert orjson.loads(turns[5]["value"]) == [{"name": "weather", "arguments": {"city": "Oslo"}},
                                               {"name": "weather", "arguments": {"city": "Rome"}}]
    # parallel results: one observation, joined as LLaMA-Factory's own OpenAI converter joins them
    assert turns[6]["value"] == '{"temp": 3}\n</tool_response>\n<tool_response>\n{"temp": 20}'
    # the answer: thinking, its text, then the call in the block FunctionFormatter looks for
    assert turns[9]["value"] == ('<think>\nneed weather\n</think>\n\nChecking both.<tool_call>'
                                 '{"name":"weather","arguments":{"city":"Oslo"}}</tool_call>')
    assert orjson.loads(line["tools"]) == TOOLS


def test_the_loader_checks_catch_what_the_loaders_refuse() -> None:
    # the shape genqueue wrote before issue 14: text and calls as two turns, gpt then function_call
    old = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "Checking."},
                             {"from": "function_call", "value": '{"name": "f", "arguments": {}}'}]}
    assert loaders.llamafactory_sharegpt(old) == ["turn 2: role 'function_call' out of place ('Invalid role tag')",
                                                  "odd number of turns ('Invalid message count')"]
    assert loaders.llamafactory_sharegpt({"conversations": [{"from": "human", "value": "q"}, {
        "from": "function_call", "value": "weather(Oslo)"}]}) == [
        "turn 1: function_call is not JSON ('Invalid JSON format in function message')"]
    assert loaders.eagle3([{"conversations": [{"from": "human", "value": "q"}]}]) == ["row 0: no id"]


def test_eagle3_reads_sharegpt_without_tool_turns() -> None:
    rows = [to_sharegpt(single()), to_sharegpt(regenerated())]
    assert loaders.eagle3(rows) == []
    assert loaders.eagle3([to_sharegpt(with_tools())])  # tool turns: EAGLE-3's role map has no place for them


# --- specforge -------------------------------------------------------------------------------
def test_specforge_rows_pass_specforges_own_validator() -> None:
    line = to_specforge(single())
    assert line["conversations"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4.", "generated_by_target": True, "reasoning_content": "2+2 is 4"}]
    assert line["status"] == "success" and line["id"] == "q-3"
    assert validate_row(line, expect_non_reasoning=False, expect_reasoning=True, strict_think_markers=True) == 1
    regen = to_specforge(regenerated())
    assert validate_row(regen, expect_non_reasoning=False, expect_reasoning=True, strict_think_markers=True) == 2
    tools = to_specforge(with_tools())
    assert orjson.loads(tools["tools"]) == TOOLS  # JSON text: preprocessing.py parses a string
    assert tools["conversations"][2] == {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_0"}
    assert tools["conversations"][1]["tool_calls"] == [CALL]
    assert tools["conversations"][-1]["tool_calls"] == [CALL]  # parse.py _sanitize_message parses the arguments
    with pytest.raises(ValueError, match="content must be a non-empty string"):  # the validator does fail
        validate_row(to_specforge(single(content="", outcome="cut_in_thinking")), expect_non_reasoning=False,
                     strict_think_markers=True)


# --- batch -----------------------------------------------------------------------------------
def test_batch_output_line_is_an_openai_batch_line_with_a_chat_completion_body() -> None:
    line = to_batch(single(custom_id="ignored", id="req-7"))
    assert set(line) >= {"id", "custom_id", "response", "error"} and line["error"] is None
    assert line["id"] == "batch_req_" + "ab" * 16 and line["custom_id"] == "req-7"
    resp = line["response"]
    assert set(resp) == {"status_code", "request_id", "body"} and resp["status_code"] == 200
    body = ChatCompletion.model_validate(resp["body"])  # the OpenAI SDK's own response model
    assert body.object == "chat.completion" and body.model == "tiny" and body.system_fingerprint == "fp0123456789abcd"
    assert body.choices[0].message.content == "It is 4." and body.choices[0].finish_reason == "stop"
    assert body.choices[0].message.model_extra == {"reasoning": "2+2 is 4"}
    assert body.usage is not None and (body.usage.prompt_tokens, body.usage.total_tokens) == (12, 21)
    assert body.created == 1700000000
    regen = ChatCompletion.model_validate(to_batch(regenerated())["response"]["body"])
    assert regen.choices[0].message.content == "a1"  # the final turn answers the request


def test_batch_error_lines_as_the_batch_error_file_has_them() -> None:
    http = {"key": "cd" * 16, "index": 1, "turn": None, "custom_id": "x", "id": "req-9", "messages": [],
            "error": {"class": "permanent", "type": "PermanentError", "status": 400, "message": "too long"}}
    line = batch_error(http)
    assert line["custom_id"] == "req-9" and line["error"] is None
    assert line["response"] == {"status_code": 400, "request_id": "req_" + "cd" * 16, "body": {"error": {
        "message": "too long", "type": "PermanentError", "param": None, "code": "permanent"}}}
    other = copy.deepcopy(http)
    other["error"] = {"class": "job_failed", "type": "rq", "status": None, "message": "abandoned"}
    line = batch_error(other)
    assert line["response"] is None and line["error"] == {"code": "job_failed", "message": "abandoned"}


# --- nothing fabricated ----------------------------------------------------------------------
@pytest.mark.parametrize("outcome", ["cut_in_thinking", "no_answer"])
def test_an_unclosed_thought_never_gets_a_closing_tag(outcome: str) -> None:
    rec = single(content="", reasoning="still thinking about", outcome=outcome)
    value = to_sharegpt(rec)["conversations"][-1]["value"]
    assert value == THINK_OPEN + "still thinking about" and "</think>" not in value
    assert loaders.llamafactory_thought(value) == (None, value)
    assert to_openai(rec)["messages"][-1] == {"role": "assistant", "content": "",
                                              "reasoning_content": "still thinking about", "generated_by_target": True}
    regen = to_sharegpt(regenerated("cut_in_thinking"))["conversations"][1:]  # after the system turn
    assert regen[1]["value"] == THINK_OPEN + "r0" + THINK_CLOSE + "a0"  # the finished turn closes
    assert regen[3]["value"] == THINK_OPEN + "r1 never clos"


def test_cut_in_answer_keeps_the_close_the_model_wrote() -> None:
    value = to_sharegpt(single(content="It is", outcome="cut_in_answer"))["conversations"][-1]["value"]
    assert value == "<think>\n2+2 is 4\n</think>\n\nIt is"


# --- which assistant turns the target generated ----------------------------------------------
def each_turn() -> dict[str, Any]:
    """Mode each, the second user turn: the history's answer is the input's, the final the target's."""
    rec = single(content="It is 6.", reasoning="3+3")
    rec["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "4 (the input's own answer)"},
                       {"role": "user", "content": "3+3?"}]
    rec["turn"] = 1
    return rec


def test_every_format_states_which_assistant_turns_the_target_wrote() -> None:
    rec = each_turn()
    assert target_turns(rec) == [False, True] and has_original_turns(rec)
    assert target_turns(single()) == [True] and not has_original_turns(single())
    assert target_turns(regenerated()) == [True, True] and not has_original_turns(regenerated())
    tools = with_tools()  # mode last through tool turns: three original answers, then the target's
    assert target_turns(tools) == [False, False, False, False, True]

    openai = to_openai(rec)["messages"]
    assert [(m["role"], m.get("generated_by_target")) for m in openai] == [
        ("system", None), ("user", None), ("assistant", False), ("user", None), ("assistant", True)]
    assert [m.get("generated_by_target") for m in to_openai(regenerated())["messages"]] == [
        None, None, True, None, True]

    specforge = to_specforge(rec)
    assert [t.get("generated_by_target") for t in specforge["conversations"]] == [None, None, False, None, True]
    # SpecForge's own validator takes the extra field
    assert validate_row(specforge, expect_non_reasoning=False, expect_reasoning=False, strict_think_markers=True) == 2

    sharegpt = to_sharegpt(rec)
    assert sharegpt["target_turns"] == [4]  # system, human, gpt (input's), human, gpt (target's)
    assert sharegpt["conversations"][4]["value"].endswith("It is 6.")
    assert loaders.llamafactory_sharegpt(sharegpt) == []  # turns stay exactly {from, value}
    assert to_sharegpt(regenerated())["target_turns"] == [2, 4]
    shared_tools = to_sharegpt(tools)
    assert [shared_tools["conversations"][i]["from"] for i in shared_tools["target_turns"]] == ["function_call"]

    batch = to_batch(rec)  # the body holds the final answer alone: the target's
    assert batch["response"]["body"]["choices"][0]["message"]["content"] == "It is 6."


def test_the_trainers_train_on_the_target_turns_only_when_configured_or_filtered() -> None:
    """LLaMA-Factory's mask_history trains on the last turn only: in modes each and last exactly
    the target's turn. SpecForge and speculators train on every assistant turn: only a row the
    target wrote entirely (what --only-target-turns keeps) trains on the target's turns alone."""
    for rec in (each_turn(), with_tools()):
        row = to_sharegpt(rec)
        assert loaders.llamafactory_trained_turns(row, mask_history=True) == row["target_turns"]
        assert loaders.llamafactory_trained_turns(row, mask_history=False) != row["target_turns"]
        spec = to_specforge(rec)
        trained = loaders.every_assistant_turn(spec)
        assert [spec["conversations"][i]["generated_by_target"] for i in trained] != [True] * len(trained)
        assert has_original_turns(rec)  # --only-target-turns keeps it out
    regen = to_sharegpt(regenerated())  # regenerate: every answer is the target's, no mask needed
    assert loaders.llamafactory_trained_turns(regen, mask_history=False) == regen["target_turns"]
    spec = to_specforge(regenerated())
    assert all(spec["conversations"][i]["generated_by_target"] for i in loaders.every_assistant_turn(spec))


def test_target_turns_survive_parquet(tmp_path: Any) -> None:
    import pyarrow.parquet as pq

    for convert, shape in ((to_openai, ExportFormat.OPENAI), (to_sharegpt, ExportFormat.SHAREGPT),
                           (to_specforge, ExportFormat.SPECFORGE)):
        path = tmp_path / f"{shape}.parquet"
        sink = export_parquet.ParquetSink(path, export_parquet.schema_for(shape))
        for rec in (each_turn(), regenerated()):
            sink.write(orjson.dumps(export_parquet.arrow_row(convert(copy.deepcopy(rec)))) + b"\n")
        sink.close()
        rows = pq.read_table(path).to_pylist()
        if shape == ExportFormat.SHAREGPT:
            assert [r["target_turns"] for r in rows] == [[4], [2, 4]]
        else:
            msgs = [r["messages" if shape == ExportFormat.OPENAI else "conversations"] for r in rows]
            assert [[m["generated_by_target"] for m in ms if m["role"] == "assistant"] for ms in msgs] == [
                [False, True], [True, True]]
