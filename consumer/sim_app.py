"""The stand-in vLLM's aiohttp application: config, slot engine, handlers (see simulate.py)."""

from __future__ import annotations

import asyncio
import collections
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from genqueue.consumer.sim_text import make_output, request_digest

REASONING_MODES = ("field", "inline", "none", "reasoning_content")


@dataclass
class SimConfig:
    model: str = "sim-model"
    slots: int = 256  # max_num_seqs: requests running at once; the rest wait FIFO
    step_time: float = 0.0  # seconds per decode step (each running request gets a token per step)
    mean_tokens: int = 200  # mean of the lognormal output length
    max_model_len: int = 8192
    seed: int = 0
    reasoning: str = "field"  # field | inline | none | reasoning_content (older vLLM's name)
    think_fraction: float = 0.3  # fraction of output tokens that are thinking
    error_rate: float = 0.0  # fraction of requests answered 500
    hang_rate: float = 0.0  # fraction of requests never answered (until the client gives up)
    down: bool = False  # /health, /v1/models and chat answer 503
    length_hints: bool = False  # a "[len=N]" in the last user message sets the mean length (benchmarks)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _error(status: int, message: str, type_: str) -> web.Response:
    return _json(
        {"object": "error", "message": message, "type": type_, "param": None, "code": status},
        status,
    )


def prompt_tokens(messages: list[Any]) -> int:
    """vLLM-ish estimate: characters of all message text // 4, plus 4 per message."""
    chars = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        c = m.get("content")
        if isinstance(c, str):
            chars += len(c)
        elif isinstance(c, list):
            for part in c:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    chars += len(part["text"])
    return chars // 4 + 4 * len(messages)


class SimEngine:
    """Slot accounting, counters and failure injection, shared by the handlers of one app."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.running = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.rng = random.Random(config.seed)  # injection decisions
        self._ids = random.Random(config.seed ^ 0x5EED)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.counts = dict.fromkeys(
            ("requests", "completed", "errors", "rejected", "unavailable", "hung",
             "cancelled", "tokens", "prompt_tokens", "max_waiting", "streamed"), 0)
        self.max_running = self.running
        self._busy = 0.0
        self._last = time.monotonic()
        self._first_admit: float | None = None
        self._last_release: float | None = None

    def _tick(self) -> None:
        now = time.monotonic()
        self._busy += self.running * (now - self._last)
        self._last = now

    def snapshot(self) -> dict[str, Any]:
        self._tick()
        active = (self._last_release - self._first_admit
                  if self._first_admit is not None and self._last_release is not None else 0.0)
        return {**self.counts, "max_running": self.max_running, "busy_slot_seconds": self._busy,
                "active_seconds": active,
                "running": self.running, "waiting": len(self.waiting)}

    def _admit(self) -> None:
        slots = self.config.slots
        while self.waiting and self.running < slots:
            fut = self.waiting.popleft()
            if fut.done():
                continue
            fut.set_result(None)
            self._tick()
            if self._first_admit is None:
                self._first_admit = self._last
            self.running += 1
            self.max_running = max(self.max_running, self.running)

    async def acquire(self) -> None:
        if self.waiting:
            self._admit()
        if not self.waiting and self.running < self.config.slots:
            self._tick()
            if self._first_admit is None:
                self._first_admit = self._last
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self.counts["max_waiting"] = max(self.counts["max_waiting"], len(self.waiting))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the slot was handed over: give it back
                self.release()
            else:
                try:
                    self.waiting.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        self._tick()
        self._last_release = self._last
        self.running -= 1
        self._admit()


SIM_ENGINE = web.AppKey("sim_engine", SimEngine)


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
    if bad is not None:
        eng.counts["rejected"] += 1
        return bad
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
    if cfg.error_rate and eng.rng.random() < cfg.error_rate:
        eng.counts["errors"] += 1
        return _error(500, "injected failure", "InternalServerError")
    if cfg.hang_rate and eng.rng.random() < cfg.hang_rate:
        eng.counts["hung"] += 1
        await asyncio.get_running_loop().create_future()  # until the client disconnects

    digest = request_digest(cfg.seed, messages, body.get("seed"))
    mean = hinted_mean(messages, cfg.mean_tokens) if cfg.length_hints else cfg.mean_tokens
    content, thought, n_out, finish = make_output(
        digest, mean, max_tokens, cfg.reasoning, cfg.think_fraction)
    try:
        await eng.acquire()
        try:
            delay = n_out * cfg.step_time
            if delay > 0:  # one timer per request, no per-token work
                loop = asyncio.get_running_loop()
                done = loop.create_future()
                timer = loop.call_later(delay, _finish, done)
                try:
                    await done
                finally:
                    timer.cancel()
        finally:
            eng.release()
    except asyncio.CancelledError:  # the client went away (vLLM aborts such a request)
        eng.counts["cancelled"] += 1
        raise
    eng.counts["completed"] += 1
    eng.counts["tokens"] += n_out
    eng.counts["prompt_tokens"] += n_prompt
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": []}
    if cfg.reasoning == "reasoning_content":
        message["reasoning_content"] = thought
    else:
        message["reasoning"] = thought if cfg.reasoning == "field" else None
    return _json({
        "id": f"chatcmpl-{eng._ids.getrandbits(128):032x}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": cfg.model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish, "stop_reason": None}],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                  "total_tokens": n_prompt + n_out},
    })


def _finish(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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


async def _metrics(request: web.Request) -> web.Response:
    eng = request.app[SIM_ENGINE]
    label = f'{{model_name="{eng.config.model}"}}'
    usage = eng.running / eng.config.slots if eng.config.slots else 0.0
    rows = [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
         eng.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
         len(eng.waiting)),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         float(min(1.0, usage))),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         eng.counts["prompt_tokens"]),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
         eng.counts["tokens"]),
    ]
    lines = []
    for name, kind, help_, value in rows:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{label} {value}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def _sim_stats(request: web.Request) -> web.Response:
    """The stand-in's own counters (busy slot-seconds for saturation benchmarks); not vLLM API."""
    eng = request.app[SIM_ENGINE]
    if request.method == "POST":
        eng.reset_stats()
    return web.Response(body=orjson.dumps({**eng.snapshot(), "slots": eng.config.slots}),
                        content_type="application/json")


_HINT = re.compile(r"\[len=(\d+)\]")


def hinted_mean(messages: list[Any], default: int) -> int:
    """With --length-hints, the model's answer length follows the dataset's original answer:
    a "[len=N]" in the last user message makes N the mean of the drawn length (a stand-in for
    "the target answers about as long as the original did", for longest-first benchmarks)."""
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            found = _HINT.search(m["content"])
            return max(1, int(found.group(1))) if found else default
    return default


def build_app(config: SimConfig) -> web.Application:
    """The stand-in's aiohttp application; its SimEngine is app[SIM_ENGINE]."""
    app = web.Application(client_max_size=64 * 1024**2)
    app[SIM_ENGINE] = SimEngine(config)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/sim/stats", _sim_stats)
    app.router.add_post("/sim/stats", _sim_stats)
    return app
