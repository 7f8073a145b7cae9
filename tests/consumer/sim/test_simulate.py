"""The stand-in vLLM (consumer/sim/server.py), over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re

import aiohttp
import openai
import pytest
from click.testing import CliRunner

from genqueue.consumer.sim.server import SimConfig, SimServer, sample_length, simulate_command

pytestmark = pytest.mark.timeout(30)

USER = [{"role": "user", "content": "Tell me about queues."}]


def run(coro):
    return asyncio.run(coro)


def client(sim: SimServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim.url, api_key="x", max_retries=0, timeout=10)


@contextlib.asynccontextmanager
async def serve(config: SimConfig):
    async with SimServer(config) as sim, client(sim) as c:
        yield sim, c


def reasoning_of(message) -> str | None:
    extra = message.model_extra or {}
    return extra.get("reasoning", getattr(message, "reasoning", None))


async def post(session: aiohttp.ClientSession, sim: SimServer, body: dict):
    async with session.post(f"{sim.url}/chat/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


def test_openai_client_gets_completion_with_usage_and_reasoning():
    async def main():
        async with SimServer(SimConfig(mean_tokens=40)) as sim, client(sim) as c:
            resp = await c.chat.completions.create(
                model="sim-model", messages=USER, max_tokens=1000)
        choice = resp.choices[0]
        assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
        assert choice.finish_reason == "stop" and choice.message.role == "assistant"
        assert choice.message.content and "<think>" not in choice.message.content
        assert reasoning_of(choice.message)
        u = resp.usage
        assert u.prompt_tokens == len(USER[0]["content"]) // 4 + 4
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens > u.prompt_tokens
        return resp
    run(main())


def test_inline_and_none_modes():
    async def main():
        async with serve(SimConfig(reasoning="inline", mean_tokens=40)) as (sim, c):
            resp = await c.chat.completions.create(model="sim-model", messages=USER)
            msg = resp.choices[0].message
            assert msg.content.startswith("<think>") and "</think>" in msg.content
            assert reasoning_of(msg) is None
            sim.config.reasoning = "none"
            resp = await c.chat.completions.create(model="sim-model", messages=USER)
            msg = resp.choices[0].message
            assert "<think>" not in msg.content and reasoning_of(msg) is None
    run(main())


def test_length_cut_inside_thinking():
    async def main():
        cfg = SimConfig(mean_tokens=400, think_fraction=0.9)
        async with serve(cfg) as (sim, c):
            resp = await c.chat.completions.create(model="sim-model", messages=USER, max_tokens=3)
            ch = resp.choices[0]
            assert ch.finish_reason == "length" and ch.message.content == ""
            assert reasoning_of(ch.message) and resp.usage.completion_tokens == 3
            sim.config.reasoning = "inline"
            resp = await c.chat.completions.create(model="sim-model", messages=USER, max_tokens=3)
            ch = resp.choices[0]
            assert ch.finish_reason == "length"
            assert ch.message.content.startswith("<think>") and "</think>" not in ch.message.content
    run(main())


def test_validation_errors():
    async def main():
        async with serve(SimConfig(max_model_len=1024)) as (sim, c):
            with pytest.raises(openai.NotFoundError) as e:
                await c.chat.completions.create(model="other", messages=USER)
            assert e.value.body["message"] == "The model `other` does not exist."
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": "x" * 4000}],
                    max_tokens=100)
            assert "maximum context length is 1024 tokens" in e.value.body["message"]
            with pytest.raises(openai.BadRequestError):
                await c.chat.completions.create(model="sim-model", messages=[])
            async with aiohttp.ClientSession() as s:
                # streaming: one chunk and [DONE], enough for the consumer's pre-flight
                async with s.post(f"{sim.url}/chat/completions",
                                  json={"model": "sim-model", "messages": USER, "stream": True}) as r:
                    assert r.status == 200 and r.content_type == "text/event-stream"
                    text = await r.text()
                assert text.startswith("data: {") and text.endswith("data: [DONE]\n\n")
                status, body = await post(s, sim, {"model": "sim-model", "messages": USER, "max_tokens": 99999,
                                                   "stream": True})
                assert status == 400 and "maximum context length" in body["message"]
                status, body = await post(s, sim, {"model": "sim-model", "messages": "hi"})
                assert status == 400 and body["object"] == "error" and body["code"] == 400
                status, body = await post(s, sim, {"model": "sim-model", "messages": USER,
                                                   "n": 2})
                assert status == 400
            assert sim.stats["rejected"] == 6 and sim.stats["completed"] == 0
    run(main())


def test_models_health_and_metrics_shape():
    async def main():
        async with SimServer(SimConfig(model="m1", max_model_len=2048)) as sim, aiohttp.ClientSession() as s:
            async with s.get(f"{sim.url}/models") as r:
                data = await r.json()
            assert data["object"] == "list"
            assert data["data"][0]["id"] == "m1" and data["data"][0]["max_model_len"] == 2048
            base = sim.url[: -len("/v1")]
            async with s.get(f"{base}/health") as r:
                assert r.status == 200
            sim.config.down = True
            async with s.get(f"{base}/health") as r:
                assert r.status == 503
            status, _ = await post(s, sim, {"model": "m1", "messages": USER})
            assert status == 503
            sim.config.down = False
            status, _ = await post(s, sim, {"model": "m1", "messages": USER})
            assert status == 200
            async with s.get(f"{base}/metrics") as r:
                text = await r.text()
        for name in ("num_requests_running", "num_requests_waiting",
                     "generation_tokens_total", "prompt_tokens_total"):
            assert f"# TYPE vllm:{name} " in text
            assert re.search(rf'^vllm:{name}{{model_name="m1"}} [0-9.]+$', text, re.MULTILINE)
        # no KV model (no --kv-cache-tokens): no KV-cache usage is made up from running / slots
        assert "vllm:kv_cache_usage_perc" not in text
    run(main())


def test_slots_queue_fifo_and_metrics_show_waiting():
    async def main():
        cfg = SimConfig(slots=4, step_time=0.01, mean_tokens=20)
        async with SimServer(cfg) as sim:
            base = sim.url[: -len("/v1")]
            async with aiohttp.ClientSession() as s:
                body = {"model": "sim-model", "max_tokens": 30}
                reqs = [asyncio.ensure_future(post(s, sim, {**body, "messages": [
                    {"role": "user", "content": f"q{i}"}]})) for i in range(12)]
                seen_waiting, seen_usage = 0, 0.0
                while not all(r.done() for r in reqs):
                    async with s.get(f"{base}/metrics") as r:
                        text = await r.text()
                    m = re.search(r"^vllm:num_requests_waiting\{.*\} (\d+)$", text, re.MULTILINE)
                    seen_waiting = max(seen_waiting, int(m.group(1)))
                    seen_usage = max(seen_usage, float("vllm:kv_cache_usage_perc" in text))
                    await asyncio.sleep(0.005)
                results = await asyncio.gather(*reqs)
            assert all(status == 200 for status, _ in results)
            st = sim.stats
        assert seen_waiting > 0 and st["max_waiting"] >= 8
        assert st["max_running"] == 4 and seen_usage == 0.0  # slots only: no KV cache to report
        assert st["completed"] == 12 and st["running"] == 0 and st["waiting"] == 0
        tokens = sum(b["usage"]["completion_tokens"] for _, b in results)
        assert st["tokens"] == tokens
        # every running request holds a slot for tokens * step_time
        assert st["busy_slot_seconds"] == pytest.approx(tokens * 0.01, rel=0.3)
    run(main())


def test_client_disconnect_frees_slot_and_ends_hang():
    async def main():
        cfg = SimConfig(slots=1, step_time=1.0, mean_tokens=50)
        async with SimServer(cfg) as sim:
            async with aiohttp.ClientSession() as s:
                body = {"model": "sim-model", "messages": USER, "max_tokens": 20}
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(post(s, sim, body), 0.2)
                await asyncio.sleep(0.05)
                assert sim.stats["running"] == 0 and sim.stats["cancelled"] == 1
                sim.config.step_time = 0.0
                sim.config.hang_rate = 1.0
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(post(s, sim, body), 0.2)
                sim.config.hang_rate = 0.0
                status, _ = await post(s, sim, body)
                assert status == 200
            assert sim.stats["hung"] == 1
    run(main())


def test_error_injection_and_outages():
    async def main():
        async with SimServer(SimConfig()) as sim:
            sim.config.error_rate = 1.0
            with pytest.raises(openai.InternalServerError) as e:
                async with client(sim) as c:
                    await c.chat.completions.create(model="sim-model", messages=USER)
            assert e.value.body["message"] == "injected failure"
            sim.config.error_rate = 0.0
            body = {"model": "sim-model", "messages": USER, "max_tokens": 5}
            async with aiohttp.ClientSession() as s:
                assert (await post(s, sim, body))[0] == 200  # leaves a keep-alive connection
                port = sim.port
                up = await sim.go_down(1.0, refuse=True)
                with pytest.raises(aiohttp.ClientConnectorError):
                    await post(s, sim, body)
                await up
                assert sim.port == port and (await post(s, sim, body))[0] == 200
                up = await sim.go_down(0.3, refuse=False)
                assert (await post(s, sim, body))[0] == 503
                await up
                assert (await post(s, sim, body))[0] == 200
            assert sim.stats["errors"] == 1 and sim.stats["unavailable"] == 1
    run(main())


def test_same_request_same_output():
    async def main():
        async with serve(SimConfig(mean_tokens=100)) as (sim, c):
            a = await c.chat.completions.create(model="sim-model", messages=USER)
            b = await c.chat.completions.create(model="sim-model", messages=USER)
            other = await c.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "something else"}])
            cut = await c.chat.completions.create(model="sim-model", messages=USER, max_tokens=2)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert reasoning_of(a.choices[0].message) == reasoning_of(b.choices[0].message)
        assert a.usage.completion_tokens == b.usage.completion_tokens
        assert a.choices[0].message.content != other.choices[0].message.content
        assert reasoning_of(a.choices[0].message).startswith(
            reasoning_of(cut.choices[0].message))
    run(main())


def test_length_sampler_mean_and_bounds():
    rng = random.Random(7)
    draws = [sample_length(rng, 200) for _ in range(2000)]
    assert abs(sum(draws) / len(draws) - 200) < 0.15 * 200
    assert min(draws) >= 1 and max(draws) > 600  # heavy tail
    rng = random.Random(7)
    assert max(sample_length(rng, 200, cap=50) for _ in range(500)) == 50


def test_cli_help():
    result = CliRunner().invoke(simulate_command, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "a stand-in for vLLM for tests, demos and benchmarks" in text
    assert "the real target stays vLLM" in text
    for opt in ("--port", "--host", "--slots", "--step-time", "--mean-tokens", "--max-model-len",
                "--seed", "--reasoning", "--error-rate", "--hang-rate", "--model"):
        assert opt in text


async def _metrics_of(s: aiohttp.ClientSession, sim: SimServer) -> dict:
    from genqueue.consumer.engine.readings import engine_view
    async with s.get(sim.url[: -len("/v1")] + "/metrics") as r:
        return dict(engine_view(await r.text()))


def test_kv_cache_fills_with_context_and_preempts_past_it():
    async def main():
        # 40 requests of ~110 prompt + up to 200 output tokens cannot all fit in 2,000 tokens
        cfg = SimConfig(slots=64, step_time=0.002, mean_tokens=150, kv_cache_tokens=2000, block_size=16)
        async with SimServer(cfg) as sim, aiohttp.ClientSession() as s:
            reqs = [asyncio.ensure_future(post(s, sim, {"max_tokens": 200, "messages": [
                {"role": "user", "content": f"q{i} " + "x" * 400}]})) for i in range(40)]
            seen = []
            while not all(r.done() for r in reqs):
                seen.append(await _metrics_of(s, sim))
                await asyncio.sleep(0.02)
            results = await asyncio.gather(*reqs)
            end = await _metrics_of(s, sim)
        assert all(status == 200 for status, _ in results)
        assert max(m["kv_cache_usage"] for m in seen) >= 0.9
        assert max(m["running"] for m in seen) < 40 and max(m["waiting"] for m in seen) > 0
        assert end["preemptions"] > 0 and end["running"] == 0 and end["kv_cache_usage"] == 0
        assert end["num_gpu_blocks"] == 125 and end["block_size"] == 16 and end["prefix_caching"] is False
        assert end["generation_tokens"] == sum(b["usage"]["completion_tokens"] for _, b in results)
        assert end["prompt_tokens"] == sum(b["usage"]["prompt_tokens"] for _, b in results)
    run(main())


def test_prefix_cache_counts_tokens_and_spec_decode_counts_drafts():
    async def main():
        cfg = SimConfig(step_time=0.001, mean_tokens=60, prefix_cache_blocks=64, block_size=16,
                        spec_tokens=3, spec_acceptance=0.5)
        system = {"role": "system", "content": "You are terse. " * 40}
        async with SimServer(cfg) as sim, aiohttp.ClientSession() as s:
            first = await post(s, sim, {"max_tokens": 100, "messages": [system, {"role": "user", "content": "a"}]})
            cold = await _metrics_of(s, sim)
            second = await post(s, sim, {"max_tokens": 100, "messages": [system, {"role": "user", "content": "b"}]})
            warm = await _metrics_of(s, sim)
        assert first[0] == second[0] == 200
        assert cold["prefix_hits"] == 0 and cold["prefix_queries"] == first[1]["usage"]["prompt_tokens"]
        # the shared prefix is "<system>" and 600 characters: 9 whole blocks of 16 tokens (64 characters)
        assert warm["prefix_hits"] == (8 + 600) // 64 * 16 and cold["prefix_caching"] is True
        assert warm["prefix_queries"] == cold["prefix_queries"] + second[1]["usage"]["prompt_tokens"]
        # accepted per step: 0.5 + 0.25 + 0.125 = 0.875 of 3 drafted; each draft step yields 1.875 tokens
        # (drawn per request: two answers of ~60 tokens are ~64 steps, a loose check; test_spec_sim.py holds
        # the rate within 5% over 300 requests)
        assert warm["spec_accepted_tokens"] / warm["spec_draft_tokens"] == pytest.approx(0.875 / 3, abs=0.15)
        assert warm["spec_draft_tokens"] == 3 * warm["spec_drafts"]
        tokens = first[1]["usage"]["completion_tokens"] + second[1]["usage"]["completion_tokens"]
        assert warm["spec_drafts"] == pytest.approx((tokens - 2) / 1.875, rel=0.3)
        # the default (vLLM's --per-request-spec-decode-metrics none): answers carry no figures
        assert "metrics" not in first[1] and "metrics" not in second[1]
    run(main())


def test_max_num_seqs_is_slots():
    result = CliRunner().invoke(simulate_command, ["--help"])
    text = " ".join(result.output.split())
    for opt in ("--max-num-seqs", "--kv-cache-tokens", "--block-size", "--prefix-cache-blocks",
                "--prefill-time", "--spec-tokens", "--spec-acceptance", "--spec-acceptance-for",
                "--per-request-spec-decode-metrics"):
        assert opt in text
