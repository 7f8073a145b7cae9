"""`producer parity`: prompts rendered with a real tokenizer and chat template (the tiny model's,
scripts/build_tiny_model.py, built here without torch) against recorded prompt ids. The
recorded ids are written by hand as ChatML text encoded by the tokenizer, not by the code under
test: a clean record passes, and each planted drift (a template one character off, a BOS
added twice either way, thinking the server did not render) is named with its position and
the text around it. The command: exit 0 clean, 1 with mismatches (0 with --allow-mismatch), 2
for a user mistake, each in one line."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from genqueue.common.records import ResultRecord
from genqueue.producer.export.parity import first_difference
from tests.conftest import cli, sharegpt, write_jsonl

REPO = Path(__file__).resolve().parents[3]
KEY = "0123456789abcdef0123456789abcdef"
SYSTEM, Q1, A1, T1, Q2 = "be brief", "what is two and two", "four", "add them", "and three and three"
#: What the tiny template renders for [system, user] with the generation prompt (thinking on).
FIRST = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n"


def _tiny() -> Any:
    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts" / "build_tiny_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(the tiny model's tokenizer folder, the tokenizer)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    module = _tiny()
    tok = PreTrainedTokenizerFast(tokenizer_object=module.build_tokenizer(), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", bos_token="<|endoftext|>", model_max_length=2048,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = module.CHAT_TEMPLATE
    where = tmp_path_factory.mktemp("tiny-tokenizer")
    tok.save_pretrained(where)
    return where, tok


def ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def single(tok: Any, *, sampling: dict[str, Any] | None = None, prompt: list[int] | None = None) -> ResultRecord:
    return cast(ResultRecord, {
        "key": KEY, "index": 0, "turn": None, "run": "p", "id": "row-1", "sampling": sampling or {},
        "fingerprint": "f", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}],
        "content": A1, "reasoning": T1, "outcome": "finished", "usage": {}, "tool_calls": [],
        "token_ids": {"prompt": ids(tok, FIRST + "<think>") if prompt is None else prompt, "completion": [5]}})


def regenerated(tok: Any) -> ResultRecord:
    """Two turns, the first answer's thinking kept in the history (the template drops it there:
    it is before the last user turn), the second turn's prompt stored after what it shares."""
    first = ids(tok, FIRST + "<think>")
    second = ids(tok, FIRST + f"{A1}<|im_end|>\n<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n<think>")
    shared = first_difference(first, second)
    assert shared is not None
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1},
                {"role": "assistant", "content": A1, "reasoning_content": T1}, {"role": "user", "content": Q2},
                {"role": "assistant", "content": "six"}]
    turns = [{"turn": 0, "content": A1, "reasoning": T1, "outcome": "finished", "usage": {},
              "token_ids": {"prompt": first, "completion": [5]}},
             {"turn": 1, "content": "six", "reasoning": "t", "outcome": "finished", "usage": {},
              "token_ids": {"prompt": second[shared:], "completion": [6], "prompt_shared": shared}}]
    return cast(ResultRecord, {"key": KEY, "index": 0, "turn": None, "run": "p", "sampling": {}, "fingerprint": "f",
                               "messages": messages, "content": "six", "reasoning": "t", "outcome": "finished",
                               "usage": {}, "tool_calls": [], "turns": turns})


def renderer(where: Path, template: str | None = None) -> Any:
    from genqueue.producer.export.hf_render import load_renderer

    return load_renderer(str(where), template)


def check(rec: ResultRecord, where: Path, template: str | None = None) -> Any:
    from genqueue.producer.export.parity import check_record

    return check_record(rec, renderer(where, template))


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [7]) == 0


def test_clean_records_pass(tiny: tuple[Path, Any]) -> None:
    where, tok = tiny
    for rec in (single(tok), regenerated(tok)):
        found = check(rec, where)
        assert found.problem is None and found.mismatches == []
    assert check(regenerated(tok), where).checked == 2
    # the run's chat_template_kwargs are rendered with: thinking off, no <think> in the prompt
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert check(single(tok, sampling=off, prompt=ids(tok, FIRST)), where).mismatches == []


def test_a_template_one_character_off_is_named_where_it_differs(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    where, tok = tiny
    drifted = _tiny().CHAT_TEMPLATE.replace("'<|im_start|>user\\n'", "'<|im_start|>user:\\n'", 1)
    assert drifted != _tiny().CHAT_TEMPLATE
    (tmp_path / "t.jinja").write_text(drifted)
    [m] = check(single(tok), where, str(tmp_path / "t.jinja")).mismatches
    assert m.position == len(ids(tok, FIRST.split("user\n")[0] + "user"))
    assert m.rendered_text.endswith("|:\n" + Q1[:2]) or "user|:" in m.rendered_text, m
    assert "user|\n" in m.recorded_text and "template" in m.hint and m.id == "row-1"
    # the regenerate record: both turns differ, each named by its turn
    assert [(x.generation, x.turn) for x in check(regenerated(tok), where, str(tmp_path / "t.jinja")).mismatches] \
        == [(0, 0), (1, 1)]


def test_a_bos_added_twice_is_named_at_position_zero(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    where, tok = tiny
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    # the engine's prompt holds a BOS the template did not write (add_special_tokens on a BOS tokenizer)
    [m] = check(single(tok, prompt=[bos, *ids(tok, FIRST + "<think>")]), where).mismatches
    assert (m.position, m.recorded_len - m.rendered_len) == (0, 1)
    assert "BOS" in m.hint and "<|endoftext|>" in m.hint and m.recorded_text.startswith("|<|endoftext|>")
    # the checker's template writes a BOS the server's did not
    (tmp_path / "bos.jinja").write_text("{{- bos_token }}" + _tiny().CHAT_TEMPLATE)
    [m] = check(single(tok), where, str(tmp_path / "bos.jinja")).mismatches
    assert m.position == 0 and "rendered prompt has one token more" in m.hint


def test_thinking_against_the_servers_choice_is_named(tiny: tuple[Path, Any]) -> None:
    where, tok = tiny
    # the run sent enable_thinking false, but the engine's prompt opens the thinking
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    [m] = check(single(tok, sampling=off), where).mismatches
    assert m.position == len(ids(tok, FIRST)) and "thinking" in m.hint and "|<think>" in m.recorded_text


def test_a_tokenization_that_differs_everywhere_blames_the_template_or_tokenizer_not_thinking(
        tiny: tuple[Path, Any]) -> None:
    # was: "thinking rendered here that the engine's prompt does not hold (enable_thinking,
    # --history-reasoning?)" on every row whose ids came from another tokenizer
    # now: "the chat template or the tokenizer differs (...)"; thinking only where it is what differs
    where, tok = tiny
    other = [(i + 7) % tok.vocab_size for i in ids(tok, FIRST + "<think>")]  # another vocabulary's ids
    [m] = check(single(tok, prompt=other), where).mismatches
    assert m.position == 0 and "thinking" not in m.hint and "tokenizer differs" in m.hint, m.hint
    # the same text cut into other ids: the tokenizer, named as such
    split = [i for piece in (FIRST, "<think>") for ch in piece for i in ids(tok, ch)]
    if split != ids(tok, FIRST + "<think>"):
        [m] = check(single(tok, prompt=split), where).mismatches
        assert "same text tokenized into other ids" in m.hint, m.hint
    # a difference inside the thinking of the history is thinking's
    from genqueue.producer.export.parity import hint
    a, b = ids(tok, FIRST + "<think>\nadd them\n</think>\n\nfour"), ids(tok, FIRST + "<think>\nsum them\n</think>\n\nfour")
    pos = first_difference(a, b)
    assert pos is not None and "thinking differs" in hint(a, b, pos, tok.decode), hint(a, b, pos, tok.decode)


def test_a_template_that_raises_is_the_records_problem_not_a_crash(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    where, tok = tiny
    (tmp_path / "bad.jinja").write_text("{{ raise_exception('no system role here') }}")
    found = check(single(tok), where, str(tmp_path / "bad.jinja"))
    assert found.problem is not None and "no system role here" in found.problem


# --- the command ------------------------------------------------------------------------


def _run(tmp: Path, redis_url: str, run: str, *extra: str) -> Path:
    data = write_jsonl(tmp / f"{run}.jsonl", [sharegpt(i, system="be brief") for i in range(2)])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp / "out"), "--rejects",
        str(tmp / f"{run}.rej"), *extra, env={"REDIS_URL": redis_url})
    shards = tmp / "out" / run / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    return shards


@pytest.mark.integration
def test_the_command_exits_by_what_it_found(tiny: tuple[Path, Any], tmp_path: Path, redis_url: str) -> None:
    where, tok = tiny
    env = {"REDIS_URL": redis_url}
    shards = _run(tmp_path, redis_url, "par", "--token-ids")
    clean = single(tok)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    drift = {**single(tok, prompt=[bos, *ids(tok, FIRST + "<think>")]), "key": "f" * 32, "index": 1, "id": "row-2"}
    # a later attempt of row-2, clean: not the copy export keeps, so not the one checked
    stale = {**clean, "key": drift["key"], "index": 1, "id": "row-2", "attempt": 1}
    (shards / "w1-000001.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in (clean, drift, stale)))

    proc = cli("producer", "parity", "--run", "par", "--tokenizer", str(where), env=env, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "row-2 generation 0: differs at token 0" in proc.stdout and "row-1" not in proc.stdout  # clean: silent
    assert proc.stderr.strip().splitlines() == [
        ("error: 1 of 2 generations (1 records) differ from the prompt ids the engine recorded; pass "
         "--allow-mismatch to exit 0 anyway")]
    proc = cli("producer", "parity", "--run", "par", "--tokenizer", str(where), "--allow-mismatch", "--json",
               env=env, check=False)
    report = orjson.loads(proc.stdout)
    assert proc.returncode == 0 and (report["records"], report["matched"], report["mismatched"]) == (2, 1, 1)
    assert report["mismatches"][0]["position"] == 0

    (shards / "w1-000001.jsonl").write_bytes(orjson.dumps(clean) + b"\n")
    proc = cli("producer", "parity", "--run", "par", "--tokenizer", str(where), env=env, check=False)
    assert proc.returncode == 0 and proc.stderr == "" and "matched     1  (100.0%)" in proc.stdout, proc

    # user mistakes: one line, exit 2
    _run(tmp_path, redis_url, "plain")
    for args, said in ((["--run", "plain", "--tokenizer", str(where)], "run plain kept no token ids"),
                       (["--run", "par", "--tokenizer", str(tmp_path / "nowhere")], "no such folder"),
                       (["--run", "par", "--tokenizer", str(tmp_path)], "cannot load a tokenizer"),
                       (["--run", "par", "--tokenizer", str(where), "--chat-template", str(tmp_path / "no.jinja")],
                        "no such file")):
        proc = cli("producer", "parity", *args, env=env, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and said in proc.stderr, proc
    # without transformers (the parity extra): one line naming the extra
    fake = tmp_path / "no-transformers" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no transformers here')\n")
    path = os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])
    proc = cli("producer", "parity", "--run", "par", "--tokenizer", str(where), env={**env, "PYTHONPATH": path},
               check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: producer parity needs transformers to render the chat template: pip install 'genqueue[parity]'"], proc


def test_history_thinking_reaches_the_template_under_both_names(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    """vLLM renames `reasoning_content` to `reasoning` and hands the template both: a template
    that reads only `reasoning_content` (Qwen3's) renders a history answer sent as `reasoning`
    (a history message's other fields are dropped, its thinking is not)."""
    where, tok = tiny
    strict = _tiny().CHAT_TEMPLATE.replace(
        "{%- elif message.reasoning is string %}{%- set reasoning = message.reasoning %}", "")
    (tmp_path / "strict.jinja").write_text(strict)
    text = (f"<|im_start|>user\n{Q1}<|im_end|>\n<|im_start|>assistant\n<think>\n{T1}\n</think>\n\n{A1}<|im_end|>\n"
            f"<|im_start|>user\n{Q2}<|im_end|>\n<|im_start|>assistant\n<think>")
    rec = cast(ResultRecord, {**single(tok, sampling={"chat_template_kwargs": {"preserve_thinking": True}},
                                       prompt=ids(tok, text)),
                              "messages": [{"role": "user", "content": Q1},
                                           {"role": "assistant", "content": A1, "reasoning": T1},
                                           {"role": "user", "content": Q2}]})
    found = check(rec, where, str(tmp_path / "strict.jinja"))
    assert found.checked == 1 and found.mismatches == [], found
