"""The stand-in vLLM's aiohttp application: config, slot engine, handlers (see server.py)."""

from __future__ import annotations

import asyncio
import random
import time
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from genqueue.consumer.sim import capture
from genqueue.consumer.sim import logprobs as sim_logprobs
from genqueue.consumer.sim.completions import completions
from genqueue.consumer.sim.engine import (
    SIM_ENGINE,
    SIM_VERSION,
    SimConfig,
    SimEngine,
    _error,
    _generate_kv,
    _generate_slots,
    _json,
)
from genqueue.consumer.sim.spec import SpecMetrics, acceptance_for, draw
from genqueue.consumer.sim.text import (
    hinted_mean,
    make_output,
    output_token_ids,
    prompt_token_ids,
    prompt_tokens,
    request_digest,
    tool_calls_for,
)


async def _chat(request: web.Request) -> web.Response:
    eng = request.app[SIM_ENGINE]
    cfg = eng.config
    eng.counts["requests"] += 1
    if cfg.down:
        eng.counts["unavailable"] += 1
        return _error(503, "the server is down (simulated)", "ServiceUnavailableError")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        body = None
    bad = _validate(body, cfg)
    if bad is None and (too_many := sim_logprobs.too_many(body, cfg.max_logprobs)) is not None:
        bad = _error(400, too_many, "BadRequestError")  # as vLLM: before any engine time
    if bad is not None:
        eng.counts["rejected"] += 1
        return bad
    if cfg.record_requests:
        _record_request(cfg.record_requests, body)
    messages = body["messages"]
    n_prompt = prompt_tokens(messages)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is None:
        max_tokens = cfg.max_model_len - n_prompt
        if max_tokens < 1:
            eng.counts["rejected"] += 1
            return _error(400, f"This model's maximum context length is {cfg.max_model_len} "
                          f"tokens. However, your messages resulted in {n_prompt} tokens. "
                          "Please reduce the length of the messages.", "BadRequestError")
    elif n_prompt + max_tokens > cfg.max_model_len:
        eng.counts["rejected"] += 1
        return _error(400, f"This model's maximum context length is {cfg.max_model_len} tokens. "
                      f"However, you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
                      f"messages, {max_tokens} in the completion). Please reduce the length of "
                      "the messages or completion.", "BadRequestError")
    if body.get("stream"):
        # Streaming is answered with one chunk and [DONE]: enough for a client that checks
        # the request is accepted (genqueue's pre-flight), no generation is simulated.
        eng.counts["streamed"] += 1
        chunk = {"id": "chatcmpl-stream", "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": cfg.model, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "finish_reason": None}]}
        return web.Response(body=b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n",
                            content_type="text/event-stream")
    eng.chats += 1
    if cfg.error_rate and eng.chats > cfg.error_after and eng.rng.random() < cfg.error_rate:
        eng.counts["errors"] += 1
        return _error(cfg.error_status, "injected failure", HTTPStatus(cfg.error_status).phrase.replace(" ", ""))
    if cfg.hang_rate and eng.rng.random() < cfg.hang_rate:
        eng.counts["hung"] += 1
        await asyncio.get_running_loop().create_future()  # until the client disconnects

    digest = request_digest(cfg.seed, messages, body.get("seed"))
    mean = hinted_mean(messages, cfg.mean_tokens) if cfg.length_hints else cfg.mean_tokens
    # As Qwen3-style templates do: `enable_thinking: false` in chat_template_kwargs, no thinking.
    kwargs = body.get("chat_template_kwargs")
    thinks = not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)
    content, thought, n_out, finish = make_output(
        digest, mean, max_tokens, cfg.reasoning if thinks else "none", cfg.think_fraction)
    spec = (draw(random.Random(digest), cfg.spec_tokens,
                 acceptance_for(cfg.spec_acceptance_for, cfg.spec_acceptance, messages, n_out), n_out,
                 cfg.per_request_spec_decode_metrics)
            if cfg.spec_tokens else None)
    try:
        if eng.kv is not None:
            await _generate_kv(eng, messages, n_prompt, n_out)
        else:
            await _generate_slots(eng, messages, n_prompt, n_out, None if spec is None else spec["num_spec_steps"])
    except asyncio.CancelledError:  # the client went away (vLLM aborts such a request)
        eng.counts["cancelled"] += 1
        raise
    eng.counts["completed"] += 1
    eng.counts["tokens"] += n_out
    eng.counts["prompt_tokens"] += n_prompt
    if spec is not None:
        eng.spec_drafts += spec["num_spec_steps"]
        eng.spec_draft_tokens += spec["num_draft_tokens"]
        eng.spec_accepted += spec["num_accepted_draft_tokens"]
    calls = tool_calls_for(messages, cfg.tool_calls, digest) if body.get("tools") else None
    if calls:  # as vLLM's tool parsers answer: the calls, no text, finish_reason tool_calls
        content, finish = "", "tool_calls"
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls or []}
    if cfg.reasoning == "reasoning_content":
        message["reasoning_content"] = thought
    else:
        message["reasoning"] = thought if cfg.reasoning == "field" else None
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                              "finish_reason": finish, "stop_reason": None}
    reply: dict[str, Any] = {
        "id": f"chatcmpl-{eng._ids.getrandbits(128):032x}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": cfg.model,
        "choices": [choice],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                  "total_tokens": n_prompt + n_out},
    }
    if body.get("return_token_ids") and cfg.token_ids:  # as vLLM: one id per counted token
        reply["prompt_token_ids"] = prompt_token_ids(cfg.seed, messages)
        choice["token_ids"] = output_token_ids(digest, mean, max_tokens, cfg.reasoning, cfg.think_fraction)
    if eng.capture is not None and (ids := capture.captured_ids(
            prompt_token_ids(cfg.seed, messages),
            output_token_ids(digest, mean, max_tokens, cfg.reasoning, cfg.think_fraction),
            body.get("kv_transfer_params"))) is not None:  # as vLLM's connector: a file, named top-level
        stem = capture.file_stem(body, request.headers.get("X-Request-Id"))  # named as vLLM names it
        path = await asyncio.to_thread(capture.save, eng.capture, stem, ids, digest)
        reply["kv_transfer_params"] = {"hidden_states_path": path}
    choice["logprobs"] = sim_logprobs.content(
        body, output_token_ids(digest, mean, max_tokens, cfg.reasoning, cfg.think_fraction), digest,
        cfg.logprobs_garbled, cfg.logprobs_processed)
    if spec is not None and cfg.per_request_spec_decode_metrics != SpecMetrics.NONE:
        reply["metrics"] = {"time_to_first_token_ms": None, "generation_time_ms": None, "queue_time_ms": None,
                            "mean_itl_ms": None, "tokens_per_second": None, "speculative_decoding": spec}
    return _json(reply)


def _record_request(path: str, body: dict[str, Any]) -> None:
    """A small blocking append, in the loop: the stand-in of a test, not of a benchmark."""
    with open(path, "ab") as f:
        f.write(orjson.dumps(body) + b"\n")



def _validate(body: Any, cfg: SimConfig) -> web.Response | None:
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object", "BadRequestError")
    model = body.get("model")
    if model is not None and model != cfg.model:
        return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _error(400, "messages must be a non-empty list", "BadRequestError")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return _error(400, "each message must be an object with a role", "BadRequestError")
    if body.get("n", 1) not in (1, None):
        return _error(400, "n must be 1 (the stand-in returns one choice)", "BadRequestError")
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None and (type(v) is not int or v < 1):
            return _error(400, f"{key} must be a positive integer, got {v!r}", "BadRequestError")
    return None


async def _health(request: web.Request) -> web.Response:
    if request.app[SIM_ENGINE].config.down:
        return web.Response(status=503)
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[SIM_ENGINE].config
    if cfg.down:
        return _error(503, "the server is down (simulated)", "ServiceUnavailableError")
    return _json({"object": "list", "data": [{
        "id": cfg.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
        "root": cfg.model, "parent": None, "max_model_len": cfg.max_model_len}]})


async def _version(_request: web.Request) -> web.Response:
    """vLLM's GET /version: what a capture's manifest records as the engine's version."""
    return _json({"version": SIM_VERSION})


async def _metrics(request: web.Request) -> web.Response:
    eng = request.app[SIM_ENGINE]
    cfg = eng.config
    label = f'{{model_name="{cfg.model}"}}'
    kv = eng.kv
    rows: list[tuple[str, str, str, str, float]] = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", label,
         eng.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", label,
         eng.num_waiting),
        ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
         label, kv.preemptions if kv is not None else 0),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", label,
         eng.counts["prompt_tokens"]),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", label,
         eng.counts["tokens"]),
    ]
    if kv is not None:  # without the KV model there is no cache to report on
        rows.append(("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", label,
                     float(kv.usage())))
    if eng.prefix is not None:
        rows += [
            ("vllm:prefix_cache_queries_total", "counter",
             "Prefix cache queries, in terms of number of queried tokens.", label, eng.prefix.queries),
            ("vllm:prefix_cache_hits_total", "counter",
             "Prefix cache hits, in terms of number of cached tokens.", label, eng.prefix.hits),
        ]
    if cfg.spec_tokens:  # vLLM's names; added to as each request is answered
        rows += [
            ("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", label,
             eng.spec_drafts),
            ("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", label,
             eng.spec_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.", label,
             eng.spec_accepted),
        ]
    # Without the KV model, usage is running / slots: as if each slot held max_model_len tokens.
    blocks = (kv.total_blocks if kv is not None
              else cfg.slots * cfg.max_model_len // cfg.block_size)
    info = (f'{{block_size="{cfg.block_size}",enable_prefix_caching="{bool(cfg.prefix_cache_blocks)}",'
            f'model_name="{cfg.model}",num_gpu_blocks="{blocks}"}}')
    rows.append(("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", info, 1.0))
    lines = []
    for name, kind, help_, labels, value in rows:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{labels} {value}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def _sim_stats(request: web.Request) -> web.Response:
    """The stand-in's own counters (busy slot-seconds for saturation benchmarks); not vLLM API."""
    eng = request.app[SIM_ENGINE]
    if request.method == "POST":
        eng.reset_stats()
    return web.Response(body=orjson.dumps({**eng.snapshot(), "slots": eng.config.slots}),
                        content_type="application/json")


def build_app(config: SimConfig) -> web.Application:
    """The stand-in's aiohttp application; its SimEngine is app[SIM_ENGINE]."""
    app = web.Application(client_max_size=64 * 1024**2)
    app[SIM_ENGINE] = SimEngine(config)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", completions)  # a capture pass's prefill (sim/completions.py)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/sim/stats", _sim_stats)
    app.router.add_post("/sim/stats", _sim_stats)
    return app
