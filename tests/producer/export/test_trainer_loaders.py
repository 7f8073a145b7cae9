"""Every export format loaded by the trainers' own code, on one stand-in run.

The run mixes system prompts, multi-turn conversations, tools (parallel calls too, regenerated
through their recorded results) and thinking (vLLM's `reasoning` field). Each format's file is
read by the code of the tools it is for, imported from the releases tests/trainers.txt pins
(tests/producer/export/trainer_code.py says what stands in for torch):

| format | tool | its code |
| --- | --- | --- |
| openai | transformers | `apply_chat_template` with Qwen3's chat template, a tokenizer built here |
| openai | LLaMA-Factory | data/parser.py `get_dataset_list` + data/converter.py `align_dataset` (openai) |
| parquet | datasets + transformers | `load_dataset("parquet")`, then the template as for openai |
| sharegpt | LLaMA-Factory | `get_dataset_list` with the `<stem>.dataset_info.json` export writes + `align_dataset`, |
|  |  | then data/formatter.py's qwen FunctionFormatter on each call turn and ToolFormatter on `tools` |
| sharegpt, specforge | SpecForge | specforge/data/preprocessing.py `build_eagle3_dataset` (qwen3-thinking) |
| specforge | SpecForge | scripts/validate_regenerated_data.py `validate_row` (specforge_validation.py) |
| sharegpt, specforge | speculators | data_generation/preprocessing.py `load_raw_dataset` + |
|  |  | `build_speculator_training_dataset`, its vLLM `/render` served here by the same template |
| batch | openai | `openai.types.chat.ChatCompletion` on every response body |

Each cell counts rows in (lines of the training file) and rows accepted: loaded, with the
thinking the tool reads rendered where the row has it, the system prompt and the tools present
where the row has them, and a loss mask that is non-zero on every answer the target generated.
Where a tool does not read a format meant for another (KNOWN), what it does is asserted on exactly
the rows it does it to.
`pytest -s` prints the table (docs/export.md has it).
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
import redis

from tests.conftest import RedisServer, sharegpt, write_jsonl
from tests.consumer.test_tool_regen import agentic
from tests.producer.export import specforge_validation, trainer_code
from tests.producer.export.test_chat_template import meant_to_render, tiny_qwen3, tools_of
from tests.producer.export.test_export_datasets import _prune, enqueue, export, generate, lines

pytestmark = pytest.mark.integration

RUN = "trainers"
THINK = "<think>\n{}\n</think>\n\n"  # how Qwen3's template and LLaMA-Factory's ReasoningTemplate write a thought
#: SpecForge's qwen3-thinking template's system_prompt (specforge/data/template.py), put in every row without one.
SPECFORGE_DEFAULT_SYSTEM = "You are a helpful assistant."
#: What LLaMA-Factory's OpenAIDatasetConverter appends to (or makes) the system prompt of a row without tools.
LF_THINKING_OFF = "detailed thinking off"


# --- one run, every format -------------------------------------------------------------------
@dataclass
class Exports:
    folder: Path
    files: dict[str, Path]  # format -> the training file
    info: Path  # the sharegpt export's <stem>.dataset_info.json
    truth: dict[str, dict[str, Any]]  # line id -> the openai line (messages with reasoning_content)
    #: The same run in the default layout, one row per generation (--rows generation):
    #: format -> the training file, and each export's --json summary.
    gen: dict[str, Path] = field(default_factory=dict)
    gen_summary: dict[str, dict[str, Any]] = field(default_factory=dict)
    conversation_summary: dict[str, Any] = field(default_factory=dict)  # the openai conversation rows' summary


def records() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """ShareGPT records (1-3 turns, a system prompt on every fourth, tools on every sixth) and
    OpenAI agentic records (tool calls, parallel ones, recorded results)."""
    tools = orjson.dumps(agentic(0)["tools"]).decode()
    plain = []
    for i in range(24):
        rec = sharegpt(i, turns=1 + i % 3, system=f"Answer briefly, {i}." if i % 4 == 0 else None)
        if i % 6 == 0:
            rec["tools"] = tools
        plain.append(rec)
    return plain, [agentic(i) for i in range(6)]


@pytest.fixture(scope="module")
def exports(trainer_exports: Exports) -> Exports:
    """The run of build_exports (made once a session: tests/producer/export/conftest.py)."""
    return trainer_exports


def build_exports(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Exports:
    """The run, exported in every format as conversation rows (the table below) and as
    generation rows (test_trainer_generation_rows.py)."""
    tmp = tmp_path_factory.mktemp("trainers")
    redis.Redis.from_url(redis_server.url).flushall()
    env = {"REDIS_URL": redis_server.url}
    plain, tooled = records()
    out = ["--output", str(tmp / "out")]
    assert enqueue(env, write_jsonl(tmp / "plain.jsonl", plain), RUN, *out)["enqueued"] == len(plain)
    assert enqueue(env, write_jsonl(tmp / "tools.jsonl", tooled), RUN, *out)["enqueued"] == len(tooled)
    # The engine speculates and returns its per-request figures: every row carries `acceptance`
    # (issue 33), which each loader below must take as it takes the rows' other extra keys.
    generate(tmp, env, RUN, "--slots", "8", "--mean-tokens", "24", "--reasoning", "field", "--tool-calls", "recorded",
             "--spec-tokens", "3", "--per-request-spec-decode-metrics", "summary")
    files = {"openai": tmp / "d.openai.jsonl", "parquet": tmp / "d.openai.parquet", "sharegpt": tmp / "d.sg.jsonl",
             "specforge": tmp / "d.sf.jsonl", "batch": tmp / "d.batch.jsonl"}
    for fmt, path in files.items():
        rows = ("--rows", "conversation") if fmt != "batch" else ()
        proc = export(env, "--run", RUN, "-o", str(path), "--format", "openai" if fmt == "parquet" else fmt, *rows,
                      "--json", check=False)
        if fmt == "openai":
            conversation_summary = orjson.loads(proc.stdout.splitlines()[-1])
    truth = {r["id"]: r for r in lines(files["openai"])}
    assert all("acceptance" in r for r in truth.values())  # what every loader below is shown to take
    assert len(truth) >= 25  # nearly every conversation finished whole
    gen = {"openai": tmp / "g.openai.jsonl", "parquet": tmp / "g.openai.parquet", "sharegpt": tmp / "g.sg.jsonl",
           "specforge": tmp / "g.sf.jsonl"}
    summaries = {}
    for fmt, path in gen.items():  # the default layout: no --rows
        proc = export(env, "--run", RUN, "-o", str(path), "--format", "openai" if fmt == "parquet" else fmt,
                      "--json", check=False)
        summaries[fmt] = orjson.loads(proc.stdout.splitlines()[-1])
    return Exports(tmp, files, tmp / "d.sg.dataset_info.json", truth, gen, summaries, conversation_summary)


# --- what a row holds, from the openai line --------------------------------------------------
def system_of(row: dict[str, Any]) -> str:
    first = row["messages"][0]
    return str(first["content"]) if first["role"] == "system" else ""


def answers(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's assistant messages (every one generated by the target: mode regenerate)."""
    return [m for m in row["messages"] if m["role"] == "assistant"]


def first_user(row: dict[str, Any]) -> str:
    return next(str(m["content"]) for m in row["messages"] if m["role"] == "user")


def said(msg: dict[str, Any]) -> str:
    """What an assistant message renders as its answer: its text, else its first call's name as
    Qwen3's template writes it."""
    if msg.get("content"):
        return str(msg["content"])
    return f'"name": "{msg["tool_calls"][0]["function"]["name"]}"'


def tool_names(row: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in tools_of(row) or []]


@dataclass
class Cell:
    fmt: str
    tool: str
    rows_in: int = 0
    accepted: int = 0
    problems: dict[str, list[str]] = field(default_factory=dict)  # what -> the ids it happened to
    notes: dict[str, list[str]] = field(default_factory=dict)  # what the tool does beside, not a refusal

    def bad(self, what: str, rid: str) -> None:
        self.problems.setdefault(what, []).append(rid)

    def note(self, what: str, rid: str) -> None:
        self.notes.setdefault(what, []).append(rid)

    def summary(self) -> str:
        told = "; ".join(f"{what}: {len(ids)} ({', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''})"
                         for what, ids in self.problems.items())
        return f"{self.fmt} x {self.tool}: {self.accepted}/{self.rows_in}" + (f" [{told}]" if told else "")


def check(cell: Cell, rid: str, ok: dict[str, bool]) -> None:
    """One row of CELL: accepted when every check in OK holds."""
    cell.rows_in += 1
    for what, good in ok.items():
        if not good:
            cell.bad(what, rid)
    cell.accepted += all(ok.values())


# --- the tokenizer: Qwen3's chat template over a byte-level BPE trained here -------------------
@functools.cache
def tokenizer() -> Any:
    """test_chat_template.py's tokenizer (Qwen3's chat template) that answers SpecForge's
    `return_tensors="pt"` with numpy arrays (no torch here)."""
    from transformers import PreTrainedTokenizerFast

    class NumpyForTorch(PreTrainedTokenizerFast):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("return_tensors") == "pt":
                kwargs["return_tensors"] = "np"
            return super().__call__(*args, **kwargs)

    return tiny_qwen3(NumpyForTorch)


def render(messages: list[dict[str, Any]], tools: Any, *, add_generation_prompt: bool = False) -> str:
    """MESSAGES and TOOLS (a list, or the export's JSON text, parsed as a user of the file does)
    through the template."""
    if isinstance(tools, str):
        tools = json.loads(tools)
    text: str = tokenizer().apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    return text


def tools_rendered(row: dict[str, Any], text: str) -> bool:
    """ROW's tool schemas in TEXT, where Qwen3's template lists them (its `<tools>` block)."""
    names = tool_names(row)
    if not names:
        return True
    block = re.search(r"<tools>\n(.*?)\n</tools>", text, re.DOTALL)
    return block is not None and all(f'"name": "{n}"' in block.group(1) for n in names)


def thoughts_rendered(row: dict[str, Any], text: str) -> bool:
    """Every thought Qwen3's template renders for ROW (those after its last user turn) is in TEXT."""
    return all(THINK.format(t.strip()) in text for t in meant_to_render(row))


# --- the cells ---------------------------------------------------------------------------------
def openai_transformers(ex: Exports, rows: list[dict[str, Any]], fmt: str = "openai") -> Cell:
    cell = Cell(fmt, "transformers apply_chat_template")
    for row in rows:
        text = render(row["messages"], row.get("tools"))
        truth = ex.truth[row["id"]]
        check(cell, row["id"], {
            "thinking not rendered": thoughts_rendered(truth, text),
            "system lost": system_of(truth) in text,
            "tools lost": tools_rendered(truth, text),
            "answer not rendered": all(said(m) in text for m in answers(truth)),
        })
    return cell


def openai_cell(ex: Exports) -> Cell:
    return openai_transformers(ex, lines(ex.files["openai"]))


def parquet_cell(ex: Exports) -> Cell:
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(ex.files["parquet"]), split="train",
                               cache_dir=str(ex.folder / "hf"))
    assert ds.num_rows == pq.read_metadata(ex.files["parquet"]).num_rows
    rows = [_prune(r) for r in ds]
    return openai_transformers(ex, rows, "parquet")


def _llamafactory(ex: Exports, fmt: str, data: Path, entry: dict[str, Any]) -> Cell:
    """LLaMA-Factory's get_dataset_list on a dataset_dir holding ENTRY as dataset_info.json,
    the file loaded as its loader loads a local JSONL (`load_dataset("json", ...)`), then
    align_dataset. Accepted as its supervised processor keeps a row (processor/supervised.py:
    an odd number of prompt messages and one response)."""
    import datasets

    lf = trainer_code.llamafactory()
    folder = ex.folder / f"lf-{fmt}"
    folder.mkdir(exist_ok=True)
    shutil.copy(data, folder / data.name)
    (folder / "dataset_info.json").write_text(json.dumps(entry))
    [name] = entry
    [attr] = lf.parser.get_dataset_list([name], str(folder))
    assert attr.load_from == "file"
    ds = datasets.load_dataset("json", data_files=str(folder / attr.dataset_name), split="train",
                               cache_dir=str(ex.folder / "hf"))
    data_args = _Args(streaming=False, preprocessing_num_workers=None, overwrite_cache=True, media_dir=str(folder))
    aligned = lf.converter.align_dataset(ds, attr, data_args, _Args(local_process_index=0))
    # Qwen3's template in LLaMA-Factory (data/template.py register_template "qwen3"): its function
    # and tool formatters, with ReasoningTemplate's thought and tool-call words.
    function = lf.formatter.FunctionFormatter(slots=["{{content}}<|im_end|>\n"], tool_format="qwen")
    tools_format = lf.formatter.ToolFormatter(tool_format="qwen")
    words = {"thought_words": ("<think>\n", "\n</think>\n\n"), "tool_call_words": ("<tool_call>", "</tool_call>")}
    cell = Cell(fmt, f"LLaMA-Factory align_dataset ({attr.formatting})")
    for row, out in zip(lines(data), aligned, strict=True):
        truth = ex.truth[row["id"]]
        turns = [m for m in out["_prompt"] + out["_response"] if m["role"] in ("assistant", "function")]
        thought = [m.get("reasoning_content") for m in answers(truth)]
        calls = [[c["function"]["name"] for c in m.get("tool_calls") or []] for m in answers(truth)]
        check(cell, row["id"], {
            "dropped": len(out["_prompt"]) % 2 == 1 and len(out["_response"]) == 1,
            "thinking not rendered": len(turns) == len(thought) and all(
                t is None or THINK.format(t) in m["content"] for m, t in zip(turns, thought, strict=True)),
            "a tool call not read": len(turns) == len(calls) and all(
                _lf_calls(function, m, words) == names for m, names in zip(turns, calls, strict=True)),
            "system lost": out["_system"].startswith(system_of(truth)),
            "tools lost": bool(out["_tools"]) == bool(truth.get("tools")) and all(
                f'"name": "{n}"' in "".join(tools_format.apply(content=out["_tools"])) for n in tool_names(truth)),
        })
        if LF_THINKING_OFF in out["_system"]:
            cell.note(f"`{LF_THINKING_OFF}` added to its system prompt", row["id"])
    return cell


def _lf_calls(function: Any, message: dict[str, Any], words: dict[str, Any]) -> list[str]:
    """The names of the calls LLaMA-Factory's FunctionFormatter reads in a `function` turn (it
    raises on one it cannot read); none for an assistant turn."""
    if message["role"] != "function":
        return []
    rendered = "".join(function.apply(content=message["content"], **words))
    return re.findall(r'<tool_call>\n\{"name": "([^"]+)"', rendered)


class _Args:
    """The fields of LLaMA-Factory's DataArguments / Seq2SeqTrainingArguments align_dataset reads."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


#: LLaMA-Factory's dataset_info.json entry for OpenAI-style `messages` (its openai converter):
#: role/content tags, tool results under role `tool`.
LF_OPENAI_ENTRY = {"formatting": "openai", "columns": {"messages": "messages", "tools": "tools"},
                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                            "assistant_tag": "assistant", "observation_tag": "tool", "system_tag": "system"}}


def openai_llamafactory_cell(ex: Exports) -> Cell:
    return _llamafactory(ex, "openai", ex.files["openai"], {"d.openai": {"file_name": "d.openai.jsonl",
                                                                           **LF_OPENAI_ENTRY}})


def sharegpt_llamafactory_cell(ex: Exports) -> Cell:
    entry = json.loads(ex.info.read_text())
    return _llamafactory(ex, "sharegpt", ex.files["sharegpt"], entry)


def _eagle3(ex: Exports, fmt: str) -> Cell:
    """SpecForge's build_eagle3_dataset with its qwen3-thinking template: the rendered text
    (input_ids decoded) and the text under loss_mask == 1."""
    import datasets
    import numpy as np

    path = ex.files[fmt]
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(ex.folder / "hf"))
    order = ds.shuffle(seed=42)["id"]  # build_eagle3_dataset shuffles with its default seed and drops ids
    with trainer_code.numpy_for_torch_format():
        built = trainer_code.specforge().preprocessing.build_eagle3_dataset(
            ds, tokenizer(), chat_template="qwen3-thinking", max_length=4096, num_proc=1)
    assert len(built) == len(order)
    tok = tokenizer()
    cell = Cell(fmt, "SpecForge build_eagle3_dataset")
    for rid, out in zip(order, built, strict=True):
        truth = ex.truth[rid]
        ids, mask = np.asarray(out["input_ids"]).reshape(-1), np.asarray(out["loss_mask"]).reshape(-1)
        text, trained = tok.decode(ids), tok.decode(ids[mask == 1])
        check(cell, rid, {
            "thinking not rendered": thoughts_rendered(truth, text),
            "system lost": system_of(truth) in text,
            "tools lost": tools_rendered(truth, text),
            "an answer not under the loss mask": all(said(m) in trained for m in answers(truth)),
            "thinking not under the loss mask": all(t.strip() in trained for t in meant_to_render(truth)),
        })
        if not system_of(truth) and SPECFORGE_DEFAULT_SYSTEM in text:
            cell.note("its default system prompt inserted", rid)
    return cell


def sharegpt_specforge_cell(ex: Exports) -> Cell:
    return _eagle3(ex, "sharegpt")


def specforge_specforge_cell(ex: Exports) -> Cell:
    return _eagle3(ex, "specforge")


def specforge_validator_cell(ex: Exports) -> Cell:
    """SpecForge's validator for regenerated data, row by row (validate_dataset's loop)."""
    cell = Cell("specforge", "SpecForge validate_regenerated_data")
    for row in lines(ex.files["specforge"]):
        try:
            specforge_validation.validate_row(row, expect_non_reasoning=False, strict_think_markers=True)
            ok = True
        except ValueError as exc:
            ok = False
            cell.bad("refused: " + re.sub(r"\d+", "N", str(exc)), row["id"])
        cell.rows_in += 1
        cell.accepted += ok
    ids = [r["id"] for r in lines(ex.files["specforge"])]
    assert len(set(ids)) == len(ids)  # validate_dataset counts duplicate ids
    return cell


class RenderHandler(http.server.BaseHTTPRequestHandler):
    """vLLM's `/v1/chat/completions/render` as speculators calls it (render_client.py): the
    messages through the chat template, tokenized, cut to truncate_prompt_tokens on the right.
    A subclass that sets HEARD gets each request's messages and tools appended to it."""

    heard: list[dict[str, Any]] | None = None

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.heard is not None:
            self.heard.append({"messages": body["messages"], "tools": body.get("tools")})
        text = render(body["messages"], body.get("tools"), add_generation_prompt=body["add_generation_prompt"])
        ids = tokenizer().encode(text, add_special_tokens=False)
        if body.get("truncate_prompt_tokens"):
            ids = ids[: body["truncate_prompt_tokens"]]
        reply = json.dumps({"token_ids": ids}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def render_endpoint() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RenderHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _speculators(ex: Exports, fmt: str, endpoint: str) -> Cell:
    """speculators' load_raw_dataset + build_speculator_training_dataset on the whole file: one
    training row per assistant turn after the first message, masked from its render boundary.
    Its rows carry no id: each is the conversation's whose first user message it renders."""
    import numpy as np

    sp = trainer_code.speculators().preprocessing
    raw, _ = sp.load_raw_dataset(str(ex.files[fmt]))
    tok = tokenizer()
    with trainer_code.numpy_for_torch_format():
        built = sp.build_speculator_training_dataset(raw, tok, max_length=4096, num_proc=1, render_endpoint=endpoint)
    firsts = {rid: first_user(ex.truth[rid]) for rid in raw["id"]}
    rows_of: dict[str, list[tuple[str, str]]] = {rid: [] for rid in raw["id"]}
    for r in built:
        ids, mask = np.asarray(r["input_ids"]), np.asarray(r["loss_mask"])
        text = tok.decode(ids)
        [owner] = [rid for rid, first in firsts.items() if first in text]
        rows_of[owner].append((text, tok.decode(ids[mask == 1])))
    cell = Cell(fmt, "speculators build_speculator_training_dataset")
    for rid, rows in rows_of.items():
        truth = ex.truth[rid]
        want = answers(truth)
        pairs = list(zip(want, rows, strict=False))
        check(cell, rid, {
            "rows are not one per answer": len(rows) == len(want),
            "an answer not under the loss mask": all(said(m) in trained for m, (_, trained) in pairs),
            "thinking not rendered": all(
                not m.get("reasoning_content") or THINK.format(m["reasoning_content"].strip()) in text
                for m, (text, _) in pairs),
            "thinking not under the loss mask": all(
                not m.get("reasoning_content") or m["reasoning_content"].strip() in trained
                for m, (_, trained) in pairs),
            "system lost": all(system_of(truth) in text for text, _ in rows),
            "tools lost": all(tools_rendered(truth, text) for text, _ in rows),
        })
    return cell


def batch_cell(ex: Exports) -> Cell:
    from openai.types.chat import ChatCompletion

    cell = Cell("batch", "openai ChatCompletion")
    out = lines(ex.files["batch"])
    for line in out:
        body = ChatCompletion.model_validate(line["response"]["body"])
        truth = ex.truth[line["custom_id"]]
        last = answers(truth)[-1]
        message = body.choices[0].message
        check(cell, line["custom_id"], {
            "not a 200": line["response"]["status_code"] == 200 and line["error"] is None,
            "answer differs": (message.content or "") == str(last["content"]),
            "thinking lost": (message.model_extra or {}).get("reasoning") == last.get("reasoning_content"),
        })
    assert len({line["custom_id"] for line in out}) == len(out)
    return cell


# --- the table ---------------------------------------------------------------------------------
CELLS: dict[str, Callable[..., Cell]] = {
    "openai-transformers": openai_cell,
    "openai-llamafactory": openai_llamafactory_cell,
    "parquet-transformers": parquet_cell,
    "sharegpt-llamafactory": sharegpt_llamafactory_cell,
    "sharegpt-specforge": sharegpt_specforge_cell,
    "sharegpt-speculators": lambda ex, endpoint: _speculators(ex, "sharegpt", endpoint),
    "specforge-validator": specforge_validator_cell,
    "specforge-specforge": specforge_specforge_cell,
    "specforge-speculators": lambda ex, endpoint: _speculators(ex, "specforge", endpoint),
    "batch-openai": batch_cell,
}
_measured: dict[tuple[str, int], Cell] = {}


def measure(name: str, ex: Exports, endpoint: str) -> Cell:
    """The cell NAME of the export EX, measured once (the table test reads them all)."""
    key = (name, id(ex))
    if key not in _measured:
        fn = CELLS[name]
        _measured[key] = fn(ex, endpoint) if name.endswith("speculators") else fn(ex)
    return _measured[key]


def table(cells: list[Cell]) -> str:
    rows = ["| format | tool | rows in | rows accepted | what the tool did |", "| --- | --- | --- | --- | --- |"]
    for c in cells:
        did = "; ".join(f"{what}: {len(ids)}" for what, ids in {**c.problems, **c.notes}.items())
        rows.append(f"| {c.fmt} | {c.tool} | {c.rows_in} | {c.accepted} | {did} |")
    return "\n".join(rows)


def with_thinking(ex: Exports) -> set[str]:
    return {rid for rid, row in ex.truth.items() if any(m.get("reasoning_content") for m in answers(row))}


def with_tool_turns(ex: Exports) -> set[str]:
    return {rid for rid, row in ex.truth.items() if any(m["role"] == "tool" for m in row["messages"])}


#: The cells where a tool does not read a format that is not its own (docs/export.md names each
#: format's tools): what it does, and on which rows. Asserted exactly, rows in and rows out.
KNOWN: dict[str, tuple[str, Callable[[Exports], set[str]]]] = {
    "openai-llamafactory": (
        ("LLaMA-Factory's OpenAIDatasetConverter reads an assistant turn's `content` only: the thinking "
         "(`reasoning_content`) of every row that has it is dropped; its format is sharegpt"), with_thinking),
    "sharegpt-specforge": (
        ("SpecForge's parser knows human/gpt only: a `function_call` turn ends the conversation there "
         "('Conversation truncated'), so the answers after it are not trained; its format is specforge"),
        with_tool_turns),
    "sharegpt-speculators": (
        ("speculators maps unknown roles to assistant: `function_call` and `observation` turns become "
         "assistant turns with rows of their own; its format is specforge"), with_tool_turns),
    "specforge-validator": (
        ("SpecForge's validator for regenerated data accepts system/user/assistant turns with non-empty "
         "text only: a row with tool turns is refused (its build_eagle3_dataset reads it whole)"), with_tool_turns),
}


@pytest.mark.parametrize("name", list(CELLS))
def test_every_row_loads_in_the_trainers_own_code(name: str, exports: Exports, render_endpoint: str) -> None:
    cell = measure(name, exports, render_endpoint)
    print(cell.summary())
    refused = set().union(*cell.problems.values())
    expected = KNOWN[name][1](exports) if name in KNOWN else set()
    assert cell.rows_in == len(exports.truth) and expected <= set(exports.truth)
    assert refused == expected, cell.summary()
    assert cell.accepted == cell.rows_in - len(expected)


def test_the_table(exports: Exports, render_endpoint: str) -> None:
    """Every cell, as the table docs/export.md shows (pytest -s prints it)."""
    cells = [measure(n, exports, render_endpoint) for n in CELLS]
    print("\n" + table(cells))
    assert all(c.rows_in == len(exports.truth) for c in cells)
    assert len(with_tool_turns(exports)) == 6 and len(with_thinking(exports)) >= 25
