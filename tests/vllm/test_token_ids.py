"""--token-ids against real vLLM: a multi-turn `regenerate` run exported as `--format tokens`,
each row checked against the server itself. `input_ids` begin with exactly what the server's
/tokenize renders for that turn's history (its chat template, generation prompt included), the
completion ids decode (/detokenize) to the answer the record holds, and `loss_mask` sums to the
turn's `usage.completion_tokens`."""

from __future__ import annotations

import orjson

from genqueue.consumer.answer.completion import split_inline
from tests.conftest import cli, sharegpt
from tests.vllm.conftest import SERVED_NAME, VllmServer
from tests.vllm.pipeline import assert_all_done, consume, enqueue, results

SYSTEM = "You answer in one short paragraph."
END_OF_TURN = ("<|im_end|>", "<|endoftext|>")


def rendered(vllm: VllmServer, messages: list[dict]) -> list[int]:
    status, body = vllm.post("/tokenize", {"model": SERVED_NAME, "messages": messages, "add_generation_prompt": True})
    assert status == 200, body
    return list(body["tokens"])


def decoded(vllm: VllmServer, ids: list[int]) -> str:
    status, body = vllm.post("/detokenize", {"model": SERVED_NAME, "tokens": ids})
    assert status == 200, body
    text = str(body["prompt"])
    for end in END_OF_TURN:
        text = text.removesuffix(end)
    return text


def test_tokens_export_is_what_the_server_rendered_and_generated(tmp_path, redis_url, conn, vllm):
    records = [sharegpt(i, turns=3, system=SYSTEM) for i in range(5)]
    enqueue(tmp_path, redis_url, "tok", records, "--token-ids")  # default mode: regenerate
    consume(tmp_path, redis_url, vllm.url, "tok")
    recs = results(tmp_path, "tok")
    assert_all_done(conn, "tok", recs, jobs=1)
    turns = {(r["key"], t["turn"]): (r, k, t) for r in recs for k, t in enumerate(r["turns"])}
    assert len(turns) == 15
    # the shards keep each conversation's history once: a later turn stores what follows the ids
    # its prompt shares with the previous turn's (the template drops old thinking: not all of them)
    assert all(t["token_ids"].get("prompt_shared", 0) > 0 for r in recs for t in r["turns"][1:])
    stored = sum(len(t["token_ids"]["prompt"]) + len(t["token_ids"]["completion"]) for r in recs for t in r["turns"])
    full = sum(t["usage"]["prompt_tokens"] + t["usage"]["completion_tokens"] for r in recs for t in r["turns"])
    print(f"\ntoken ids stored {stored:,} of {full:,} ({stored / full:.0%}); shard bytes "
          f"{sum(len(orjson.dumps(t['token_ids'])) for r in recs for t in r['turns']):,}")

    out = tmp_path / "tok.tokens.jsonl"
    proc = cli("producer", "export", "--run", "tok", "--output", str(out), "--format", "tokens", "--json",
               env={"REDIS_URL": redis_url})
    assert orjson.loads(proc.stdout.splitlines()[-1])["exported"] == 5
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(rows) == len(turns)  # one row per generated turn
    for row in rows:
        rec, k, turn = turns[(row["key"], row["turn"])]
        history = rec["messages"][: 2 + 2 * k]  # system, then user/assistant pairs before this turn's user
        prompt = rendered(vllm, history)
        ids, mask = row["input_ids"], row["loss_mask"]
        assert ids[: len(prompt)] == prompt, (row["id"], "the prompt ids are not the server's render")
        assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        assert sum(mask) == turn["usage"]["completion_tokens"] == row["usage"]["completion_tokens"]
        assert len(prompt) == turn["usage"]["prompt_tokens"]
        # The template opens <think> in the prompt: the completion is "<thinking></think><answer>".
        text = decoded(vllm, ids[len(prompt):])
        answer, thinking, closed = split_inline(text)
        assert closed and (answer, thinking) == (turn["content"], turn["reasoning"]), (row["id"], text)
