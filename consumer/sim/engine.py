"""The stand-in's engine: its config, the slot engine with its counters and failure injection,
and the timed generation every handler awaits; shared by the handlers (app.py, completions.py).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from genqueue.consumer.sim import capture
from genqueue.consumer.sim import logprobs as sim_logprobs
from genqueue.consumer.sim.kv import KvScheduler, PrefixCache, Seq, spec_yield, step_cost
from genqueue.consumer.sim.spec import SpecMetrics, SpecRule

REASONING_MODES = ("field", "inline", "none", "reasoning_content")
#: What the stand-in's GET /version answers (vLLM answers its own release).
SIM_VERSION = f"genqueue-sim {metadata.version('genqueue')}"


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
