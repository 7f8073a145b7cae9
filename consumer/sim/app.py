"""The stand-in vLLM's aiohttp application: config, slot engine, handlers (see server.py)."""

from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from genqueue.common import __version__
from genqueue.consumer.sim import capture
from genqueue.consumer.sim import logprobs as sim_logprobs
from genqueue.consumer.sim.completions import completions
from genqueue.consumer.sim.kv import KvScheduler, PrefixCache, Seq, spec_yield, step_cost
from genqueue.consumer.sim.spec import SpecMetrics, SpecRule, acceptance_for, draw
from genqueue.consumer.sim.text import (
    hinted_mean,
    make_output,
    output_token_ids,
    prompt_token_ids,
    prompt_tokens,
    request_digest,
    tool_calls_for,
)

REASONING_MODES = ("field", "inline", "none", "reasoning_content")
#: What the stand-in's GET /version answers (vLLM answers its own release).
SIM_VERSION = f"genqueue-sim {__version__}"


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
    error_rate: float = 0.0  # fraction of requests answered error_status
    error_status: int = 500  # the HTTP status of an injected failure (500, 502, 503, ...)
    error_after: int = 0  # the first this many chat requests are answered normally (breaks mid-run)
    hang_rate: float = 0.0  # fraction of requests never answered (until the client gives up)
    down: bool = False  # /health, /v1/models and chat answer 503
    length_hints: bool = False  # a "[len=N]" in the last user message sets the mean length (benchmarks)
    tool_calls: str = "none"  # none | recorded | diverge: answer a request with tools by the hinted calls
    record_requests: str = ""  # a file each chat request's body is appended to, one JSON line each (tests)
    # Engine models for the doctor's regimes (kv.py); the defaults keep plain slots.
    kv_cache_tokens: int = 0  # 0: no KV model (no KV usage reported); else its size in tokens
    block_size: int = 16  # tokens per KV block (vLLM's --block-size)
    prefix_cache_blocks: int = 0  # 0: no prefix cache; else an LRU of this many prompt blocks
    prefill_time: float = 0.0  # seconds per uncached prompt token before the first output token
    spec_tokens: int = 0  # speculative decoding: draft tokens per step (0: off)
    spec_acceptance: float = 0.7  # probability a draft token is accepted (given those before it)
    spec_acceptance_for: tuple[SpecRule, ...] = ()  # categories with their own acceptance (sim/spec.py)
    # A step's cost (kv.step_cost): past compute_knee tokens a step (0: never) its time grows with
    # them, and each draft adds draft_cost of a step; the defaults keep a step at step_time.
    compute_knee: int = 0
    draft_cost: float = 0.0
    # vLLM's --per-request-spec-decode-metrics: answers carry metrics.speculative_decoding (not at none)
    per_request_spec_decode_metrics: SpecMetrics = SpecMetrics.NONE
    token_ids: bool = True  # honour return_token_ids (False: an engine that ignores it, as vLLM < 0.10.2)
    # hidden-states capture (sim/capture.py), as vLLM's extract_hidden_states with its connector:
    # "" is an engine started without it (kv_transfer_params are ignored)
    capture_dir: str = ""
    capture_layers: tuple[int, ...] = (2, 4)
    hidden_size: int = 64
    capture_wrong_ids: float = 0.0  # the share of captures saved with one token id wrong (tests)
    # log-probabilities (sim/logprobs.py): vLLM's --max-logprobs, and the share of answers whose
    # tables are planted out of order (tests)
    max_logprobs: int = sim_logprobs.MAX_LOGPROBS
    logprobs_garbled: float = 0.0
    logprobs_processed: bool = False  # vLLM's --logprobs-mode processed_logprobs (not its default)

    def capture_config(self) -> capture.CaptureConfig | None:
        if not self.capture_dir:
            return None
        return capture.CaptureConfig(Path(self.capture_dir), tuple(self.capture_layers), self.hidden_size, self.seed,
                                     self.capture_wrong_ids)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _error(status: int, message: str, type_: str) -> web.Response:
    return _json(
        {"object": "error", "message": message, "type": type_, "param": None, "code": status},
        status,
    )


class SimEngine:
    """Slot accounting, counters and failure injection, shared by the handlers of one app."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.running = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.rng = random.Random(config.seed)  # injection decisions
        self._ids = random.Random(config.seed ^ 0x5EED)
        self.spec_per_step = spec_yield(config.spec_tokens, config.spec_acceptance)
        self.prefix = (PrefixCache(config.prefix_cache_blocks, config.block_size)
                       if config.prefix_cache_blocks else None)
        self.kv = (KvScheduler(kv_tokens=config.kv_cache_tokens, block_size=config.block_size,
                               slots=config.slots, step_time=config.step_time,
                               prefill_time=config.prefill_time, tokens_per_step=1 + self.spec_per_step,
                               on_running=self._set_running, step_cost=self.step_cost)
                   if config.kv_cache_tokens else None)
        # vLLM's spec_decode counters: the figures drawn for each answered request, added up
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0
        self.chats = 0  # chat requests to generate, since start (error_after counts these)
        self.capture = config.capture_config()
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

    def _set_running(self, n: int) -> None:
        """The KV scheduler's running count, for the same busy and max accounting as slots."""
        self._tick()
        if n > self.running and self._first_admit is None:
            self._first_admit = self._last
        if n < self.running:
            self._last_release = self._last
        self.running = n
        self.max_running = max(self.max_running, n)
        self.counts["max_waiting"] = max(self.counts["max_waiting"], self.num_waiting)

    def step_cost(self, batch: int) -> float:
        """A decode step's time at BATCH running, in units of --step-time (kv.step_cost)."""
        cfg = self.config
        return step_cost(batch, cfg.spec_tokens, cfg.compute_knee, cfg.draft_cost)

    @property
    def num_waiting(self) -> int:
        return len(self.kv.waiting) if self.kv is not None else len(self.waiting)

    def snapshot(self) -> dict[str, Any]:
        self._tick()
        active = (self._last_release - self._first_admit
                  if self._first_admit is not None and self._last_release is not None else 0.0)
        return {**self.counts, "max_running": self.max_running, "busy_slot_seconds": self._busy,
                "active_seconds": active,
                "running": self.running, "waiting": self.num_waiting,
                "preemptions": self.kv.preemptions if self.kv is not None else 0}

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


def _prefill(eng: SimEngine, messages: list[Any], n_prompt: int) -> float:
    """Seconds of prefill: the prompt tokens the prefix cache does not hold."""
    hit = eng.prefix.lookup(messages, n_prompt) if eng.prefix is not None else 0
    return (n_prompt - hit) * eng.config.prefill_time


async def _generate_kv(eng: SimEngine, messages: list[Any], n_prompt: int, n_out: int) -> None:
    assert eng.kv is not None
    seq = Seq(prompt=n_prompt, out=n_out, prefill=_prefill(eng, messages, n_prompt),
              done=asyncio.get_running_loop().create_future())
    await eng.kv.run(seq)


async def _generate_slots(eng: SimEngine, messages: list[Any], n_prompt: int, n_out: int,
                          spec_steps: int | None) -> None:
    """SPEC_STEPS: the verify steps drawn for the answer (speculative decoding), else a step a token."""
    cfg = eng.config
    await eng.acquire()
    try:
        steps = 1 + spec_steps if spec_steps is not None else n_out
        # without the KV model a request's steps are timed at once, at the batch it starts in
        delay = _prefill(eng, messages, n_prompt) + steps * cfg.step_time * eng.step_cost(eng.running)
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
    if kv is not None:  # without the KV model there is no cache to report on (issue 31)
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
