"""Regenerate through tool turns: the matching rule, the generator on the stand-in's
--tool-calls modes, and a whole run (real Redis, consumer subprocess, export's counts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from genqueue.common.contracts import Item, Mode
from genqueue.common.records import record_turns
from genqueue.consumer.answer.checkpoints import Checkpoints
from genqueue.consumer.answer.generate import Generator
from genqueue.consumer.answer.tool_turns import match_calls, splice_results
from genqueue.consumer.sim.server import SimConfig, SimServer
from genqueue.consumer.sim.text import call_hints, tool_calls_for
from genqueue.producer.export.parts import tool_turns_code
from genqueue.producer.ingest.convert import normalize
from genqueue.producer.ingest.items import make_items
from tests.conftest import cli, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results
from tests.consumer.test_generate import Rec, ctx, ok, run, with_gen


def call(name: str, args: Any, cid: str = "c") -> dict[str, Any]:
    text = args if isinstance(args, str) else json.dumps(args)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": text}}


# --- the matching rule -----------------------------------------------------------------

def test_same_name_and_json_equal_arguments_match_whatever_the_key_order_and_spacing() -> None:
    got = [call("f", '{ "b" : [1, {"y": 2, "x": 1}],\n "a": "s" }', "t1")]
    assert match_calls(got, [call("f", '{"a":"s","b":[1,{"x":1,"y":2}]}', "r1")]) == {"r1": "t1"}
    assert match_calls([call("f", "{}", "t")], [call("f", "", "r")]) == {"r": "t"}  # empty is {}
    assert match_calls([call("f", {"n": 1.0}, "t")], [call("f", {"n": 1}, "r")]) == {"r": "t"}


@pytest.mark.parametrize("got", [
    [call("g", {"a": 1})],  # another function
    [call("f", {"a": 2})],  # other arguments
    [call("f", {"a": True})],  # true is not 1
    [call("f", {"a": 1, "b": None})],  # an extra key
    [call("f", '{"a": 1')],  # not JSON
    [],  # no call at all
    [call("f", {"a": 1}), call("f", {"a": 1}, "c2")],  # one call too many
])
def test_a_different_call_diverges(got: list[dict[str, Any]]) -> None:
    assert match_calls(got, [call("f", {"a": 1}, "r")]) is None


def test_parallel_calls_match_as_a_multiset() -> None:
    recorded = [call("f", {"a": 1}, "r1"), call("g", {}, "r2"), call("f", {"a": 1}, "r3")]
    got = [call("g", "{}", "t1"), call("f", '{"a":1}', "t2"), call("f", '{"a": 1}', "t3")]
    ids = match_calls(got, recorded)
    assert ids == {"r1": "t2", "r2": "t1", "r3": "t3"}
    assert match_calls(got[:2] + [call("g", {}, "t3")], recorded) is None  # same set, other counts
    results = [{"role": "tool", "content": "x", "tool_call_id": "r2"}, {"role": "tool", "content": "y", "tool_call_id": "r1"}]
    assert [m["tool_call_id"] for m in splice_results(results, ids)] == ["t1", "t2"]


def test_the_stand_in_reads_call_hints_by_round() -> None:
    text = 'go [call=f:{"a": [1, "]"]},g:{}] then [call=h:{"x": 1}] [call=broken:{'
    assert call_hints(text) == [[("f", {"a": [1, "]"]}), ("g", {})], [("h", {"x": 1})]]
    user = {"role": "user", "content": text}
    first = tool_calls_for([user], "recorded", 7)
    assert first is not None and [c["function"]["name"] for c in first] == ["f", "g"]
    second = tool_calls_for([user, {"role": "assistant", "tool_calls": first}, {"role": "tool"}], "recorded", 8)
    assert second is not None and json.loads(second[0]["function"]["arguments"]) == {"x": 1}
    after = [user, {"role": "assistant", "tool_calls": first}, {"role": "assistant", "tool_calls": second}]
    assert tool_calls_for(after, "recorded", 9) is None  # the hinted rounds are made: text
    diverged = tool_calls_for([user], "diverge", 7)
    assert diverged is not None and match_calls(diverged, first) is None
    assert tool_calls_for([user], "none", 7) is None


# --- the generator on the stand-in ---------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]


def agentic(i: int) -> dict[str, Any]:
    """Two user turns with tool calls (the second parallel, recorded in another order and key
    order than the hints), then one without."""
    return {"id": f"a{i}", "tools": TOOLS, "messages": [
        {"role": "system", "content": "use tools"},
        {"role": "user", "content": f'weather {i}? [call=weather:{{"city": "c{i}", "unit": "C"}}]'},
        {"role": "assistant", "content": "", "tool_calls": [call("weather", f'{{"unit":"C","city":"c{i}"}}', "o1")]},
        {"role": "tool", "content": "sunny", "tool_call_id": "o1"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": f'and the time? [call=weather:{{"city": "c{i}", "day": 1}},clock:{{}}]'},
        {"role": "assistant", "content": "", "tool_calls": [call("clock", "{}", "o2"),
                                                            call("weather", f'{{"day":1,"city":"c{i}"}}', "o3")]},
        {"role": "tool", "content": "12:00", "tool_call_id": "o2"},
        {"role": "tool", "content": "rain", "tool_call_id": "o3"},
        {"role": "assistant", "content": "Noon, rain tomorrow."},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "bye"},
    ]}


def item_of(record: dict[str, Any]) -> Item:
    [item] = make_items(normalize(record), Mode.REGENERATE, 0)
    return item


def regenerate(mode: str, record: dict[str, Any]) -> Rec:
    async def go(gen: Generator, sim: SimServer) -> Rec:
        return await gen.answer(ctx(), item_of(record))

    return run(with_gen(SimConfig(mean_tokens=15, seed=3, tool_calls=mode), go))


def test_matching_calls_splice_the_recorded_results_and_go_on_to_the_end() -> None:
    rec = ok(regenerate("recorded", agentic(1)))
    roles = [m["role"] for m in rec["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool", "tool",
                     "assistant", "user", "assistant"]
    turns = rec["turns"]
    assert [(t["turn"], t.get("step", 0), t.get("tool_results_spliced")) for t in turns] == [
        (0, 0, True), (0, 1, None), (1, 0, True), (1, 1, None), (2, 0, None)]
    assert "stopped" not in rec and "note" not in rec and rec["outcome"] == "finished"
    # the results answer the target's own call ids, in the recorded order
    target_ids = {c["function"]["name"]: c["id"] for c in rec["messages"][6]["tool_calls"]}
    assert [(m["content"], m["tool_call_id"]) for m in rec["messages"][7:9]] == [
        ("12:00", target_ids["clock"]), ("rain", target_ids["weather"])]
    assert rec["messages"][3]["tool_call_id"] == rec["messages"][2]["tool_calls"][0]["id"] != "o1"
    assert rec["messages"][4]["content"] == turns[1]["content"]  # the target's answer, not the recorded one
    assert rec["turns_total"] == 3 and record_turns(rec) == 3  # status counts user turns, not answers


def test_a_diverging_call_stops_the_conversation_there() -> None:
    rec = ok(regenerate("diverge", agentic(2)))
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant"]
    [turn] = rec["turns"]
    assert turn["tool_results_spliced"] is False and turn["tool_calls"] == rec["tool_calls"]
    assert rec["note"] == "tool_call_diverged" and rec["outcome"] == "finished"
    stopped = rec["stopped"]
    assert (stopped["turn"], stopped["reason"]) == (0, "tool_call_diverged")
    assert stopped["recorded"] == [{"name": "weather", "arguments": '{"unit":"C","city":"c2"}'}]
    assert stopped["target"][0]["name"] == "weather"


def test_an_answer_without_the_recorded_call_is_a_divergence() -> None:
    rec = ok(regenerate("none", agentic(3)))
    [turn] = rec["turns"]
    assert "tool_calls" not in turn and turn["tool_results_spliced"] is False and turn["content"]
    assert rec["note"] == "tool_call_diverged" and rec["stopped"]["target"] == []
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant"]


def test_a_call_the_recording_did_not_make_is_a_divergence() -> None:
    record = {"tools": TOOLS, "messages": [{"role": "user", "content": 'hi [call=clock:{}]'},
                                           {"role": "assistant", "content": "hello"},
                                           {"role": "user", "content": "more"}]}
    rec = ok(regenerate("recorded", record))
    assert rec["note"] == "tool_call_diverged" and rec["stopped"]["recorded"] == []
    assert len(rec["turns"]) == 1 and rec["tool_calls"][0]["function"]["name"] == "clock"


def test_a_checkpoint_resumes_after_the_tool_turns_of_the_turns_done(redis_url: str) -> None:
    item = item_of(agentic(4))

    async def go(gen: Generator, sim: SimServer) -> tuple[Rec, int]:
        rec = await gen.answer(ctx(), item)
        return rec, sim.stats["requests"]

    cfg = SimConfig(mean_tokens=15, seed=3, tool_calls="recorded")
    full, n = run(with_gen(cfg, go, Checkpoints(redis_url)))
    assert n == 5  # two answers for each of the two tool turns, one for the last
    resumed, n2 = run(with_gen(cfg, go, Checkpoints(redis_url)))
    assert n2 == 1 and ok(resumed)["resumed_at_turn"] == 2
    assert ok(resumed)["messages"][:-1] == ok(full)["messages"][:-1] and len(ok(resumed)["turns"]) == 5


def test_export_tells_the_tool_turns_apart() -> None:
    spliced = [{"tool_results_spliced": True}, {}]
    assert tool_turns_code({"turns": spliced}) == 1  # regenerated to the end
    assert tool_turns_code({"turns": spliced, "note": "tool_call_diverged", "stopped": {"reason": "tool_call_diverged"}}) == 2
    assert tool_turns_code({"turns": [{}], "note": "stopped_at_tool_turn"}) == 3
    assert tool_turns_code({"turns": spliced, "stopped": {"turn": 0, "step": 1, "reason": "error"}}) == 3
    assert tool_turns_code({"turns": spliced, "stopped": {"turn": 1, "reason": "cut_in_answer"}}) == 0  # cut elsewhere
    assert tool_turns_code({"turns": [{}]}) == 0 and tool_turns_code({"content": "x"}) == 0  # no tool turns; not regenerate


# --- a whole run -------------------------------------------------------------------------

def records() -> list[dict[str, Any]]:
    plain = {"id": "p", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}
    unanswered = {"id": "u", "tools": TOOLS, "messages": [  # a call whose result was never recorded
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "two [call=clock:{}]"},
        {"role": "assistant", "content": "", "tool_calls": [call("clock", "{}", "o")]}]}
    return [agentic(10), agentic(11), plain, unanswered]


def regenerate_run(tmp_path: Path, redis_url: str, mode: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    run_name = f"tools-{mode}"
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / f"{run_name}.jsonl", records())
    out = tmp_path / "out"
    cli("producer", "enqueue", str(data), "--run", run_name, "--output", str(out), "--max-tokens", "256",
        "--rejects", str(tmp_path / "rej.jsonl"), env=env)
    sim = Sim(tmp_path, "--mean-tokens", "15", "--tool-calls", mode)
    try:
        c = Proc("consumer", ["run", "--run", run_name, "--endpoint", sim.url, "--burst", "--spool",
                              str(tmp_path / "spool" / mode), "--shard-max-age", "1"],
                 tmp_path / f"{mode}.log", env=env)
        assert c.wait(90) == 0, c.output()
    finally:
        sim.stop()
    exported = cli("producer", "export", "--run", run_name, "-o", str(tmp_path / f"{mode}.jsonl"), "--json", env=env)
    return read_results(out, run_name), orjson.loads(exported.stdout)


@pytest.mark.integration
def test_a_run_regenerates_through_recorded_tool_turns_and_export_counts_them(tmp_path: Path, redis_url: str) -> None:
    recs, summary = regenerate_run(tmp_path, redis_url, "recorded")
    by_id = {r["id"]: r for r in recs}
    assert len(recs) == 4 and not [r for r in recs if "error" in r]
    for rid in ("a10", "a11"):
        assert [t.get("tool_results_spliced") for t in by_id[rid]["turns"]] == [True, None, True, None, None]
        assert "stopped" not in by_id[rid]
    assert by_id["u"]["note"] == "stopped_at_tool_turn" and len(by_id["u"]["turns"]) == 2
    assert "note" not in by_id["p"]
    counts = {k: summary[k] for k in ("tool_turns_to_end", "tool_call_diverged", "stopped_at_tool_turn")}
    assert counts == {"tool_turns_to_end": 2, "tool_call_diverged": 0, "stopped_at_tool_turn": 1}
    assert summary["complete"] == 4


@pytest.mark.integration
def test_a_run_whose_target_diverges_stops_each_conversation_at_its_first_call(tmp_path: Path,
                                                                            redis_url: str) -> None:
    recs, summary = regenerate_run(tmp_path, redis_url, "diverge")
    by_id = {r["id"]: r for r in recs}
    for rid in ("a10", "a11"):
        rec = by_id[rid]
        assert rec["note"] == "tool_call_diverged" and [t["tool_results_spliced"] for t in rec["turns"]] == [False]
        assert rec["stopped"]["turn"] == 0
    assert by_id["u"]["note"] == "stopped_at_tool_turn"
    counts = {k: summary[k] for k in ("tool_turns_to_end", "tool_call_diverged", "stopped_at_tool_turn")}
    assert counts == {"tool_turns_to_end": 0, "tool_call_diverged": 2, "stopped_at_tool_turn": 1}
    human = cli("producer", "export", "--run", "tools-diverge", "-o", str(tmp_path / "again.jsonl"),
                env={"REDIS_URL": redis_url}).stdout
    assert "0 regenerated to the end, 2 stopped at a divergence (tool_call_diverged), 1 stopped at a tool turn" in human
