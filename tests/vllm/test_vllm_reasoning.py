"""genqueue end to end against real vLLM started with `--reasoning-parser qwen3`.

vLLM 0.32's qwen3 parser starts in the thinking state unless the request's
`chat_template_kwargs` say `enable_thinking: false`, and splits at `</think>`: the thinking
comes back in `message.reasoning`, the answer in `content` (null when the budget ran out
inside the thinking), and `usage.completion_tokens_details.reasoning_tokens` is filled.
"""

from __future__ import annotations

from tests.conftest import sharegpt
from tests.vllm.conftest import SERVED_NAME
from tests.vllm.pipeline import assert_all_done, consume, enqueue, results


def test_reasoning_comes_back_in_the_field(tmp_path, redis_url, conn, vllm_qwen3):
    enqueue(tmp_path, redis_url, "field", [sharegpt(i) for i in range(12)], "--multi-turn", "first")
    consume(tmp_path, redis_url, vllm_qwen3.url, "field")
    recs = results(tmp_path, "field")
    assert_all_done(conn, "field", recs, jobs=2)
    for r in recs:
        assert r["model"] == SERVED_NAME and "error" not in r
        assert r["finish_reason"] == "stop" and r["outcome"] == "finished"
        assert r["reasoning_form"] == "field"
        assert r["reasoning"] and r["content"]
        assert "think>" not in r["content"] and "think>" not in r["reasoning"]
        u = r["usage"]
        # vLLM counts the thinking tokens (not `</think>` itself) when a parser is on.
        assert 0 < u["reasoning_tokens"] < u["completion_tokens"]
        assert u["prompt_tokens"] == vllm_qwen3.prompt_tokens(r["messages"])


def test_cut_inside_the_thinking(tmp_path, redis_url, conn, vllm_qwen3):
    """max_tokens=1 always stops inside the tiny model's thinking: content is null, the
    partial thinking is in `reasoning`, and the regenerated conversation stops there."""
    enqueue(tmp_path, redis_url, "cut", [sharegpt(i, turns=2) for i in range(4)], "--max-tokens", "1")
    consume(tmp_path, redis_url, vllm_qwen3.url, "cut")
    recs = results(tmp_path, "cut")
    assert_all_done(conn, "cut", recs, jobs=1)
    for r in recs:
        assert r["finish_reason"] == "length" and r["outcome"] == "cut_in_thinking"
        assert r["content"] == "" and r["reasoning"] and r["reasoning_form"] == "field"
        assert r["usage"]["completion_tokens"] == 1 and r["usage"]["reasoning_tokens"] == 1
        assert r["stopped"] == {"turn": 0, "reason": "cut_in_thinking"}
        assert len(r["turns"]) == 1 and r["turns_total"] == 2
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]


def test_thinking_disabled_with_the_parser_on(tmp_path, redis_url, conn, vllm_qwen3):
    extra = '{"chat_template_kwargs": {"enable_thinking": false}}'
    enqueue(tmp_path, redis_url, "off", [sharegpt(i) for i in range(6)], "--sampling-json", extra,
            "--multi-turn", "first")
    consume(tmp_path, redis_url, vllm_qwen3.url, "off")
    recs = results(tmp_path, "off")
    assert_all_done(conn, "off", recs, jobs=1)
    for r in recs:
        assert r["reasoning"] is None and r["reasoning_form"] == "none"
        assert r["content"] and r["outcome"] == "finished"
        assert r["usage"]["reasoning_tokens"] == 0


def test_regenerate_with_the_parser(tmp_path, redis_url, conn, vllm_qwen3):
    enqueue(tmp_path, redis_url, "regenf", [sharegpt(i, turns=2) for i in range(4)])
    consume(tmp_path, redis_url, vllm_qwen3.url, "regenf")
    recs = results(tmp_path, "regenf")
    assert_all_done(conn, "regenf", recs, jobs=1)
    for r in recs:
        msgs = r["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert [m["content"] for m in msgs[1::2]] == [t["content"] for t in r["turns"]]
        assert all(t["reasoning_form"] == "field" and t["reasoning"] for t in r["turns"])
        assert "reasoning_content" not in msgs[1] and "reasoning" not in msgs[1]  # --history-reasoning drop
        assert r["turns"][1]["usage"]["prompt_tokens"] == vllm_qwen3.prompt_tokens(msgs[:3])


def test_history_reasoning_keep_reaches_the_template(tmp_path, redis_url, conn, vllm_qwen3):
    """With --history-reasoning keep, turn 2's prompt holds turn 1's thinking. The tiny
    template renders earlier thinking when asked (`preserve_thinking`, as interleaved-thinking
    templates do), so the server's prompt token count tells whether it arrived. genqueue sends
    it as `reasoning_content`: vLLM 0.32's chat endpoint accepts that name (its /tokenize
    endpoint does not: there only `reasoning` reaches the template, hence the renaming below)."""
    extra = '{"chat_template_kwargs": {"preserve_thinking": true}}'
    enqueue(tmp_path, redis_url, "keep", [sharegpt(i, turns=2) for i in range(2)], "--history-reasoning", "keep",
            "--sampling-json", extra)
    consume(tmp_path, redis_url, vllm_qwen3.url, "keep")
    recs = results(tmp_path, "keep")
    assert_all_done(conn, "keep", recs, jobs=1)
    kw = {"chat_template_kwargs": {"preserve_thinking": True}}
    for r in recs:
        first = r["messages"][1]
        assert first.get("reasoning_content") or first.get("reasoning")
        with_thinking = [r["messages"][0], {"role": "assistant", "content": first["content"],
                                            "reasoning": r["turns"][0]["reasoning"]}, r["messages"][2]]
        without = [r["messages"][0], {"role": "assistant", "content": first["content"]}, r["messages"][2]]
        assert vllm_qwen3.prompt_tokens(with_thinking, **kw) > vllm_qwen3.prompt_tokens(without, **kw)
        assert r["turns"][1]["usage"]["prompt_tokens"] == vllm_qwen3.prompt_tokens(with_thinking, **kw)
