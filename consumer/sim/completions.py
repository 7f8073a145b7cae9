"""The stand-in's /v1/completions, as far as a capture pass uses it (consumer/answer/prefill.py): a
prompt of token ids, prefilled and answered with one token; with `kv_transfer_params` (and a
--capture-dir) the prompt's hidden states are saved as vLLM's connector saves them (capture.py),
its `include_output_tokens` honoured as on chat; with `prompt_logprobs` every prompt position's
table as vLLM returns them (sim/logprobs.py: prompt_tables). The faults a chat request meets (down, injected
errors, hangs) are met here too, drawn from the same counters.
"""

from __future__ import annotations

import asyncio
import time
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from genqueue.consumer.sim import capture
from genqueue.consumer.sim import logprobs as sim_logprobs
from genqueue.consumer.sim.engine import SIM_ENGINE, _error, _generate_slots, _json
from genqueue.consumer.sim.text import output_token_ids, request_digest


async def completions(request: web.Request) -> web.Response:
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
    prompt = body.get("prompt") if isinstance(body, dict) else None
    max_tokens = body.get("max_tokens", 16) if isinstance(body, dict) else None
    bad = None
    if not isinstance(body, dict):
        bad = "the request body must be a JSON object"
    elif body.get("model") not in (None, cfg.model):
        eng.counts["rejected"] += 1
        return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
    elif not (isinstance(prompt, list) and prompt and all(type(i) is int and i >= 0 for i in prompt)):
        bad = "the stand-in's /v1/completions takes a prompt of token ids (a non-empty list of integers)"
    elif type(max_tokens) is not int or max_tokens < 1:
        bad = f"max_tokens must be a positive integer, got {max_tokens!r}"
    elif (too_many := sim_logprobs.too_many_prompt(body, cfg.max_logprobs)) is not None:
        bad = too_many
    elif len(prompt) + max_tokens > cfg.max_model_len:
        bad = (f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
               f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} in the completion).")
    if bad is not None:
        eng.counts["rejected"] += 1
        return _error(400, bad, "BadRequestError")
    assert isinstance(body, dict) and isinstance(prompt, list) and isinstance(max_tokens, int)
    eng.chats += 1
    if cfg.error_rate and eng.chats > cfg.error_after and eng.rng.random() < cfg.error_rate:
        eng.counts["errors"] += 1
        return _error(cfg.error_status, "injected failure", HTTPStatus(cfg.error_status).phrase.replace(" ", ""))
    if cfg.hang_rate and eng.rng.random() < cfg.hang_rate:
        eng.counts["hung"] += 1
        await asyncio.get_running_loop().create_future()  # until the client disconnects
    as_messages: list[Any] = [{"role": "user", "content": prompt}]  # what the prefix cache and digest key on
    digest = request_digest(cfg.seed, as_messages, body.get("seed"))
    out = output_token_ids(digest, max_tokens, max_tokens, "none", 0.0)[:max_tokens]
    try:
        await _generate_slots(eng, as_messages, len(prompt), len(out), None)
    except asyncio.CancelledError:
        eng.counts["cancelled"] += 1
        raise
    eng.counts["completed"] += 1
    eng.counts["tokens"] += len(out)
    eng.counts["prompt_tokens"] += len(prompt)
    reply: dict[str, Any] = {
        "id": f"cmpl-{eng._ids.getrandbits(128):032x}", "object": "text_completion", "created": int(time.time()),
        "model": cfg.model,
        "choices": [{"index": 0, "text": " ".join(map(str, out)), "logprobs": None,
                     "finish_reason": "length" if len(out) >= max_tokens else "stop", "stop_reason": None}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)},
    }
    if body.get("prompt_logprobs"):  # garbled: the ids scored are not all those sent, as its prompt_token_ids say
        scored = sim_logprobs.prompt_scored(list(prompt), digest, cfg.logprobs_garbled)
        reply["choices"][0]["prompt_logprobs"] = sim_logprobs.prompt_tables(body, scored)
        if body.get("return_token_ids"):
            reply["choices"][0].update({"prompt_token_ids": scored, "token_ids": out})
    elif body.get("return_token_ids"):
        reply["choices"][0].update({"prompt_token_ids": list(prompt), "token_ids": out})
    if eng.capture is not None and (ids := capture.captured_ids(list(prompt), out,
                                                                body.get("kv_transfer_params"))) is not None:
        # named as vLLM names a completion's: cmpl-<request id>-<8 hex>
        stem = "cmpl" + capture.file_stem(body, request.headers.get("X-Request-Id")).removeprefix("chatcmpl")
        path = await asyncio.to_thread(capture.save, eng.capture, stem, ids, digest)
        reply["kv_transfer_params"] = {"hidden_states_path": path}
    return _json(reply)
