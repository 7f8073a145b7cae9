"""Thinking where the trainers read it: the `openai` export (JSONL and Parquet) rendered by
transformers' own `apply_chat_template` with Qwen3's own chat template and a tiny byte-level
BPE tokenizer built here (no hub download, no torch).

What the template is meant to render: it reads an assistant turn's thinking from
`reasoning_content` (else from a `<think>` block inline in `content`) and, by design, renders
the thinking only of the assistant turns after the last user turn; the thinking of earlier
turns is dropped. So the proof is: every row whose answers after its last user turn have
thinking renders that thinking, and the earlier turns render their answers without it.

The template is Qwen/Qwen3-0.6B's `chat_template` as llama.cpp keeps it,
models/templates/Qwen-Qwen3-0.6B.jinja (read at ye-NX/llama.cpp, a fork of ggml-org/llama.cpp,
commit b354d7c9ecb76c97c07098617cdebbdfffa2583e). It is public code, so it is not committed
here: the tests read it from the folder $GENQUEUE_CHAT_TEMPLATES, else ../shared/chat_templates
beside the repository; when neither holds it they use the tiny model's Qwen3-style template
(scripts/build_tiny_model.py, genqueue's own) with Qwen3's reading rule: `reasoning_content` only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
import redis

from genqueue.producer.export.formats.openai import to_openai
from tests.conftest import sharegpt, write_jsonl
from tests.producer.export.test_formats import CALL, CALL2, TOOLS, regenerated, single, with_tools

TEMPLATE_NAME = "Qwen-Qwen3-0.6B.jinja"
TEMPLATE_SOURCE = ("models/templates/Qwen-Qwen3-0.6B.jinja at ye-NX/llama.cpp "
                   "b354d7c9ecb76c97c07098617cdebbdfffa2583e (Qwen/Qwen3-0.6B's chat_template)")
REPO = Path(__file__).resolve().parents[3]


def _template() -> str:
    """Qwen3's own template when it is here; else genqueue's tiny model's Qwen3-style template
    (scripts/build_tiny_model.py, written here) held to Qwen3's reading rule: thinking from
    `reasoning_content` only (the tiny model's also reads vLLM's `reasoning`, to be lenient)."""
    folders = [Path(p) for p in (os.environ.get("GENQUEUE_CHAT_TEMPLATES"),) if p]
    folders.append(REPO.parent / "shared" / "chat_templates")
    for folder in folders:
        path = folder / TEMPLATE_NAME
        if path.is_file():
            return path.read_text()
    return strict_tiny_template()


def strict_tiny_template() -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts" / "build_tiny_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lenient = "{%- elif message.reasoning is string %}{%- set reasoning = message.reasoning %}"
    template: str = module.CHAT_TEMPLATE
    assert lenient in template, "the tiny model's template changed: update the strict reading rule here"
    return template.replace(lenient, "")


def tiny_qwen3(cls: type | None = None) -> Any:
    """A tokenizer of class CLS (PreTrainedTokenizerFast or a subclass) with Qwen3's chat
    template and a byte-level BPE vocabulary trained here: the one the chat-template and the
    trainer-loader tests render with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template = _template()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([template, "question answer thinking <think> </think> <tool_call>"], trainer)
    hf = (cls or PreTrainedTokenizerFast)(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    return hf


@pytest.fixture(scope="module")
def qwen3() -> Any:
    """A PreTrainedTokenizerFast with Qwen3's chat template and a BPE vocabulary trained here."""
    pytest.importorskip("transformers")
    return tiny_qwen3()


def tools_of(row: dict[str, Any]) -> Any:
    """ROW's tools as a chat template takes them: a list (the export writes JSON text)."""
    tools = row.get("tools")
    return orjson.loads(tools) if isinstance(tools, str) else tools


def render(tokenizer: Any, row: dict[str, Any]) -> str:
    text: str = tokenizer.apply_chat_template(row["messages"], tools=tools_of(row) or None, tokenize=False)
    assert tokenizer.decode(tokenizer.encode(text)) == text  # the tiny tokenizer round-trips it
    return text


def render_template(tokenizer: Any, row: dict[str, Any]) -> str:
    """ROW through the template alone, in transformers' own Jinja environment. Recent
    transformers releases copy `reasoning` (or `thinking`) into `reasoning_content` before
    rendering; older ones, and every loader that renders the template itself, do not: this is
    what they see."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    text: str = _compile_jinja_template(tokenizer.chat_template).render(
        messages=row["messages"], tools=tools_of(row) or None, add_generation_prompt=False)
    return text


def meant_to_render(row: dict[str, Any]) -> list[str]:
    """The thinking Qwen3's template renders for ROW: that of the assistant turns after the
    last user turn (the template's last_query_index)."""
    msgs = row["messages"]
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    return [m["reasoning_content"] for m in msgs[last_user + 1:]
            if m["role"] == "assistant" and m.get("reasoning_content")]


def rendered_thinking(tokenizer: Any, rows: list[dict[str, Any]], *, old_name: bool = False) -> tuple[int, int]:
    """(rows with thinking meant to render, rows whose rendering holds all of it); OLD_NAME:
    rendered as the export wrote them before, the thinking under vLLM's name `reasoning`."""
    want = got = 0
    for row in rows:
        thoughts = meant_to_render(row)
        if not thoughts:
            continue
        want += 1
        text = render_template(tokenizer, as_vllm_named(row)) if old_name else render(tokenizer, row)
        got += all(f"<think>\n{t.strip()}\n</think>\n\n" in text for t in thoughts)
    return want, got


def as_vllm_named(row: dict[str, Any]) -> dict[str, Any]:
    """ROW as the export wrote it before: the thinking under vLLM's response name `reasoning`."""
    msgs = [{("reasoning" if k == "reasoning_content" else k): v for k, v in m.items()} for m in row["messages"]]
    return {**row, "messages": msgs}


def test_every_kind_of_row_renders_its_thinking(qwen3: Any) -> None:
    rows = [to_openai(r) for r in (single(), regenerated(), with_tools(), single(reasoning=None),
                                   single(content="", reasoning="still thinking about", outcome="cut_in_thinking"))]
    parallel = single(content="", reasoning="both cities", tools=TOOLS)
    parallel["tool_calls"] = [CALL, CALL2]
    rows.append(to_openai(parallel))
    assert [len(meant_to_render(r)) for r in rows] == [1, 1, 1, 0, 1, 1]
    assert rendered_thinking(qwen3, rows) == (5, 5)
    # a regenerated conversation: the last turn's thinking renders, turn 0's is dropped by design
    regen = render(qwen3, rows[1])
    assert "<think>\nr1 never clos\n</think>" in regen and "r0" not in regen and "a0" in regen
    calls = render(qwen3, rows[5])
    assert calls.count('<tool_call>\n{"name": "weather"') == 2 and "<think>\nboth cities\n</think>" in calls
    # the same rows under vLLM's name: the template itself renders none of their thinking
    assert rendered_thinking(qwen3, rows, old_name=True) == (5, 0)
    assert all(render_template(qwen3, r) == render(qwen3, r) for r in rows)  # same template, same text


@pytest.mark.integration
def test_a_regenerated_run_renders_every_thinking_trace(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                        qwen3: Any) -> None:
    """regenerate on the stand-in (thinking in `message.reasoning`, as vLLM's parser returns
    it), exported as openai JSONL and Parquet: rows in = rows rendered with their thinking."""
    from tests.producer.export.test_export_datasets import _prune, enqueue, export, generate, lines

    env = {"REDIS_URL": redis_url}
    recs = [sharegpt(i, turns=1 + i % 3, system="Answer briefly." if i % 4 == 0 else None) for i in range(24)]
    data = write_jsonl(tmp_path / "t.jsonl", recs)
    assert enqueue(env, data, "tmpl", "--output", str(tmp_path / "out"))["enqueued"] == 24
    generate(tmp_path, env, "tmpl", "--slots", "8", "--mean-tokens", "24", "--reasoning", "field")
    export(env, "--rows", "conversation", "--run", "tmpl", "-o", str(tmp_path / "d.jsonl"), "--include-outcomes", "all")
    export(env, "--rows", "conversation", "--run", "tmpl", "-o", str(tmp_path / "d.parquet"), "--include-outcomes", "all")
    rows = lines(tmp_path / "d.jsonl")
    assert len(rows) == 24
    with_thinking = [r for r in rows if meant_to_render(r)]
    assert len(with_thinking) >= 20  # the stand-in thinks in nearly every answer
    assert rendered_thinking(qwen3, rows) == (len(with_thinking), len(with_thinking))
    assert rendered_thinking(qwen3, rows, old_name=True) == (len(with_thinking), 0)  # before: none rendered
    from_parquet = [_prune(r) for r in pq.read_table(tmp_path / "d.parquet").to_pylist()]
    for r in from_parquet:
        if isinstance(r.get("tools"), str):
            r["tools"] = orjson.loads(r["tools"])
    assert rendered_thinking(qwen3, from_parquet) == (len(with_thinking), len(with_thinking))
