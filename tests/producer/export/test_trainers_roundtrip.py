"""Every trainer reads exactly what the server saw: exported rows read back through `datasets`
4.0.0 and 5.x (JSON and Parquet) and through SpecForge's and speculators' own preprocessing
equal what was written, field by field, and the request the stand-in vLLM was sent.

The run holds what varies by row: tool schemas of different shapes (a `get_weather` with
`city` and `unit`, a `calc` with `expr`, a `clock` with no properties at all), tool calls
regenerated through their recorded results, speculative-decoding acceptance, thinking. Arrow
keeps one type per column, so `datasets` unifies the shape of every row's nested objects into
one struct: a key a row lacks comes back as null. genqueue's own objects (a message, a tool
call's envelope, usage, acceptance) have a fixed set of keys, so a null there is an absent key
(`as_written`); a tool schema's shape is the user's, so `tools` is written as JSON text, which
every reader returns as written (docs/export.md, "Nested fields and `datasets`").

datasets 4.0.0 lives in .venv/datasets4 (scripts/setup --tests): tests/producer/export/readback.py
runs in a subprocess with PYTHONPATH set to it, and once under the virtualenv's own 5.x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
import redis

from tests.conftest import RedisServer, sharegpt, write_jsonl
from tests.producer.export.test_export_datasets import enqueue, export, generate, lines

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
#: scripts/setup --tests puts datasets 4.0.0 beside the virtualenv that runs the tests (GENQUEUE_VENV).
DATASETS4 = Path(sys.prefix) / "datasets4"
RUN = "roundtrip"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
CALC = {"type": "function", "function": {
    "name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                   "required": ["expr"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}


def _call(name: str, args: dict[str, Any], cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def records() -> list[dict[str, Any]]:
    """Conversations whose tools differ in shape row by row: weather-and-clock calls, calc
    calls, tools offered and not called, and no tools at all."""
    out: list[dict[str, Any]] = []
    for i in range(4):
        city = {"city": f"c{i}", "unit": "C"}
        out.append({"id": f"w{i}", "tools": [WEATHER, CLOCK], "messages": [
            {"role": "user", "content": f"weather {i}? [call=get_weather:{json.dumps(city)}]"},
            {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", city, "o1")]},
            {"role": "tool", "content": "sunny", "tool_call_id": "o1"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "and the time? [call=clock:{}]"},
            {"role": "assistant", "content": "", "tool_calls": [_call("clock", {}, "o2")]},
            {"role": "tool", "content": "12:00", "tool_call_id": "o2"},
            {"role": "assistant", "content": "Noon."}]})
        expr = {"expr": f"2+{i}"}
        out.append({"id": f"c{i}", "tools": [CALC], "messages": [
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": f"what is 2+{i}? [call=calc:{json.dumps(expr)}]"},
            {"role": "assistant", "content": "", "tool_calls": [_call("calc", expr, "k1")]},
            {"role": "tool", "content": str(2 + i), "tool_call_id": "k1"},
            {"role": "assistant", "content": f"It is {2 + i}."}]})
        out.append({"id": f"t{i}", "tools": [CALC, WEATHER] if i % 2 else [CLOCK],
                    "messages": [{"role": "user", "content": f"just talk {i}"},
                                 {"role": "assistant", "content": "ok"}]})
        plain = sharegpt(i, turns=1 + i % 2)
        plain["id"] = f"p{i}"
        out.append(plain)
    return out


@dataclass
class Run:
    folder: Path
    requests: list[dict[str, Any]]  # every chat request the stand-in was sent (pre-flight probes left out)
    files: dict[str, Path] = field(default_factory=dict)  # export name -> file
    read: dict[str, dict[str, Any]] = field(default_factory=dict)  # datasets release -> readback.py's answer


#: The exports read back: name -> (format, --rows, file name).
EXPORTS = {"openai": ("openai", "generation", "g.openai.jsonl"),
           "parquet": ("openai", "generation", "g.openai.parquet"),
           "specforge": ("specforge", "generation", "g.sf.jsonl"),
           "specforge-conv": ("specforge", "conversation", "c.sf.jsonl"),
           "sharegpt": ("sharegpt", "generation", "g.sg.jsonl"),
           "openai-conv": ("openai", "conversation", "c.openai.jsonl")}


def readback(folder: Path, files: dict[str, Path], *, datasets4: bool) -> dict[str, Any]:
    """tests/producer/export/readback.py on FILES, under datasets 4.0.0 (DATASETS4) or the
    virtualenv's 5.x, in a subprocess whose every cache is in FOLDER."""
    tag = "4" if datasets4 else "5"
    plan = {"files": {name: {"path": str(p), "kind": "parquet" if p.suffix == ".parquet" else "json"}
                      for name, p in files.items()},
            "cache": str(folder / f"hf{tag}"), "specforge": str(files["specforge"]),
            "speculators": str(files["specforge-conv"])}
    (folder / f"plan{tag}.json").write_text(json.dumps(plan))
    path = [str(DATASETS4)] if datasets4 else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(REPO)]), "HF_HOME": str(folder / f"home{tag}"),
           "HF_DATASETS_CACHE": str(folder / f"hf{tag}"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = folder / f"read{tag}.json"
    proc = subprocess.run([sys.executable, "-m", "tests.producer.export.readback", str(folder / f"plan{tag}.json"),
                           str(out)], check=False, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    answer: dict[str, Any] = json.loads(out.read_text())
    return answer


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Run:
    if not (DATASETS4 / "datasets").is_dir():
        raise RuntimeError(f"datasets 4.0.0 is not in {DATASETS4}: run scripts/setup --tests")
    tmp = tmp_path_factory.mktemp("roundtrip")
    redis.Redis.from_url(redis_server.url).flushall()
    env = {"REDIS_URL": redis_server.url}
    recs = records()
    assert enqueue(env, write_jsonl(tmp / "in.jsonl", recs), RUN, "--output", str(tmp / "out"))["enqueued"] == len(recs)
    requests = tmp / "requests.jsonl"
    generate(tmp, env, RUN, "--slots", "8", "--mean-tokens", "24", "--reasoning", "field", "--tool-calls", "recorded",
             "--spec-tokens", "3", "--per-request-spec-decode-metrics", "summary", "--record-requests", str(requests))
    bodies = [orjson.loads(x) for x in requests.read_bytes().splitlines()]
    r = Run(tmp, [b for b in bodies if not b.get("stream")])
    for name, (fmt, rows, file_name) in EXPORTS.items():
        r.files[name] = tmp / file_name
        export(env, "--run", RUN, "-o", str(r.files[name]), "--format", fmt, "--rows", rows, "--no-card")
    r.read = {"4": readback(tmp, r.files, datasets4=True), "5": readback(tmp, r.files, datasets4=False)}
    return r


# --- what a row is, whatever reader read it ----------------------------------------------------
def _set(d: dict[str, Any]) -> dict[str, Any]:
    """D without the keys Arrow filled with null (D's absent keys)."""
    return {k: v for k, v in d.items() if v is not None}


def _message(m: dict[str, Any]) -> dict[str, Any]:
    out = _set(m)
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [{**_set(c), "function": _set(c["function"])} for c in out["tool_calls"]]
    return out


def as_written(row: dict[str, Any]) -> dict[str, Any]:
    """ROW with the nulls dropped where genqueue's own fixed-key objects stand (the row, each
    message or turn, each tool call and its function, usage, acceptance, the stopped note):
    there a null is a key the object lacks. Anything else (a tool schema above all) is compared
    exactly as read."""
    out = _set(row)
    for name in ("messages", "conversations"):
        if isinstance(out.get(name), list):
            out[name] = [_message(m) for m in out[name]]
    for name in ("usage", "acceptance", "stopped"):
        if isinstance(out.get(name), dict):
            out[name] = _set(out[name])
    return out


def tools_of(row: dict[str, Any]) -> Any:
    """ROW's tools as the server was sent them (the JSON text parsed; None: none)."""
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def first_user(messages: list[dict[str, Any]]) -> str:
    return next(str(m.get("content") if "content" in m else m.get("value")) for m in messages
                if m.get("role", m.get("from")) in ("user", "human"))


def sent_tools(r: Run) -> dict[str, Any]:
    """The tools the server was sent with each conversation (by its first user message): the
    same with every request of it."""
    out: dict[str, Any] = {}
    for body in r.requests:
        first = first_user(body["messages"])
        assert out.setdefault(first, body.get("tools")) == body.get("tools")
    return out


def request_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a request carries them: the export's per-turn marks dropped."""
    return [{k: v for k, v in _message(m).items() if k not in ("generated_by_target", "weight")} for m in messages]


def requests_by_messages(r: Run) -> dict[bytes, dict[str, Any]]:
    return {orjson.dumps(body["messages"], option=orjson.OPT_SORT_KEYS): body for body in r.requests}


RELEASES = ["4", "5"]


# --- the tests ------------------------------------------------------------------------------------
def test_the_run_varies_its_tools_row_by_row(run: Run) -> None:
    assert run.read["4"]["datasets"] == "4.0.0" and run.read["5"]["datasets"].startswith("5.")
    rows = lines(run.files["openai"])
    shapes = {orjson.dumps(tools_of(r)) for r in rows if r.get("tools")}
    assert len(shapes) == 4  # weather+clock, calc, calc+weather, clock
    assert sum(1 for r in rows if r.get("tools")) >= 20
    assert sum(1 for r in rows if "acceptance" in r) > len(rows) // 2
    assert sum(1 for r in rows for m in r["messages"] if m.get("tool_calls")) >= 8


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("name", [n for n in EXPORTS if n != "parquet"])
def test_json_rows_read_back_as_written(name: str, release: str, run: Run) -> None:
    """Every row `datasets` reads from a JSONL export equals the line genqueue wrote, field by
    field; `tools` (JSON text) exactly as written, and as the server was sent it."""
    written = lines(run.files[name])
    read = run.read[release]["rows"][name]
    assert len(read) == len(written) > 0
    sent = sent_tools(run)
    for got, want in zip(read, written, strict=True):
        assert as_written(got) == as_written(want), want["id"]
        conversation = got.get("messages") or got["conversations"]
        assert tools_of(got) == sent[first_user(conversation)], want["id"]
    assert sum(1 for r in read if r.get("tools")) == sum(1 for r in written if r.get("tools")) >= 12


@pytest.mark.parametrize("release", RELEASES)
def test_parquet_rows_read_back_as_written(release: str, run: Run) -> None:
    """The Parquet export read by `datasets` equals the table genqueue wrote, and holds the same
    messages and tools as the openai JSONL of the same run."""
    written = pq.read_table(run.files["parquet"]).to_pylist()
    read = run.read[release]["rows"]["parquet"]
    jsonl = {r["id"]: r for r in lines(run.files["openai"])}
    assert len(read) == len(written) == len(jsonl)
    for got, want in zip(read, written, strict=True):
        assert as_written(got) == as_written(want), want["id"]
        same = jsonl[got["id"]]
        assert [_message(m) for m in got["messages"]] == same["messages"] and got.get("tools") == same.get("tools")


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("name", ["openai", "parquet", "specforge"])
def test_generation_rows_read_back_are_the_requests_the_server_was_sent(name: str, release: str, run: Run) -> None:
    """A generation row's history, read back, is the request's messages and its tools the
    request's tools, exactly."""
    requests = requests_by_messages(run)
    rows = run.read[release]["rows"][name]
    for row in rows:
        turns = row.get("messages") or row["conversations"]
        history = request_form(turns[:-1])
        body = requests.get(orjson.dumps(history, option=orjson.OPT_SORT_KEYS))
        assert body is not None, (row["id"], history)
        assert tools_of(row) == body.get("tools"), row["id"]


@pytest.mark.parametrize("release", RELEASES)
def test_specforge_prepares_the_tools_and_history_the_server_was_sent(release: str, run: Run) -> None:
    """SpecForge's prepare_prompt_tasks on the specforge generation rows: every conversation it
    hands its chat template carries the tools the server was sent and, before the answer, the
    request's messages (a system prompt SpecForge inserts aside; it parses each call's
    arguments, so they are compared as JSON)."""
    answer = run.read[release]["specforge"]
    rows = lines(run.files["specforge"])
    calls = list({orjson.dumps(c, option=orjson.OPT_SORT_KEYS): c for c in answer["calls"]}.values())
    assert answer["built"] == len(calls) == len(rows)  # its dataset.map may run the parser more than once
    requests = requests_by_messages(run)
    sent = sent_tools(run)
    for call in calls:
        messages = call["messages"]
        assert call["tools"] == sent[first_user(messages)], messages
        history = [m for m in messages[:-1] if not (m["role"] == "system" and m["content"] == SPECFORGE_SYSTEM)]
        assert any(_same_request(history, body["messages"]) for body in requests.values()), history


@pytest.mark.parametrize("release", RELEASES)
def test_speculators_renders_the_tools_the_server_was_sent(release: str, run: Run) -> None:
    """speculators' preprocessing on the specforge conversation rows: every render it asks vLLM
    for carries the conversation's tools exactly as the server was sent them."""
    answer = run.read[release]["speculators"]
    sent = sent_tools(run)
    tooled = 0
    assert answer["built"] > 0 and answer["calls"]
    for call in answer["calls"]:
        assert call["tools"] == sent[first_user(call["messages"])], call["messages"]
        tooled += bool(call["tools"])
    assert tooled >= 12


#: SpecForge's qwen3-thinking template's system prompt, put in a conversation without one.
SPECFORGE_SYSTEM = "You are a helpful assistant."


def _same_request(history: list[dict[str, Any]], sent: list[dict[str, Any]]) -> bool:
    """HISTORY (as SpecForge's parser keeps a message: role, content, tool calls with parsed
    arguments, reasoning and tool_call_id where present) is the request's messages SENT."""
    if len(history) != len(sent):
        return False
    for got, want in zip(history, sent, strict=True):
        if (got["role"], got.get("content") or "") != (want["role"], want.get("content") or ""):
            return False
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in got.get("tool_calls") or []]
        wanted = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want.get("tool_calls") or []]
        if calls != wanted or got.get("tool_call_id") != want.get("tool_call_id"):
            return False
    return True
