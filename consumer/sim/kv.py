"""The stand-in's engine models beyond plain slots (see server.py): a KV cache of a given size
in tokens that fills with the running requests' context and preempts past it, a prefix cache
(an LRU of prompt blocks), and speculative decoding's expected yield per step.

Each is a model for showing a regime faithfully (the engine doctor's tests drive it there), not
a copy of vLLM's scheduler: numbers move the way vLLM's do, at a tick's granularity.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: Characters per token, as text.prompt_tokens counts them.
CHARS_PER_TOKEN = 4


def spec_yield(k: int, p: float) -> float:
    """Expected accepted draft tokens per decode step with K drafts each accepted with
    probability P given the ones before it were: p + p^2 + ... + p^k."""
    return sum(p**i for i in range(1, k + 1))


def step_cost(batch: int, k: int, knee: int, draft_cost: float) -> float:
    """A decode step's time in memory-bound steps: BATCH requests with K drafts each verify
    BATCH x (1 + K) tokens at once; under KNEE tokens (0: no knee) the step costs what reading
    the weights costs, past it time grows with the tokens computed (compute-bound), and each
    draft adds DRAFT_COST of a step (the drafter's own passes). 1.0 at the defaults."""
    compute = batch * (1 + k) / knee if knee > 0 else 0.0
    return max(1.0, compute) + draft_cost * k


def prompt_blocks(messages: list[Any], block_size: int) -> list[bytes]:
    """Chained hashes of the prompt's whole blocks (block_size tokens, CHARS_PER_TOKEN characters
    each): block i's hash covers every block before it, so only a shared prefix matches."""
    text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages if isinstance(m, dict))
    width = block_size * CHARS_PER_TOKEN
    out: list[bytes] = []
    prev = b""
    for i in range(len(text) // width):
        prev = hashlib.blake2b(prev + text[i * width:(i + 1) * width].encode(), digest_size=8).digest()
        out.append(prev)
    return out


class PrefixCache:
    """An LRU of prompt blocks; counts queries and hits in tokens, as vLLM's
    vllm:prefix_cache_queries_total and vllm:prefix_cache_hits_total do."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.queries = 0
        self.hits = 0

    def lookup(self, messages: list[Any], n_prompt: int) -> int:
        """Prompt tokens found cached (then all its blocks are cached, most recent last)."""
        blocks = prompt_blocks(messages, self.block_size)
        hit = 0
        for h in blocks:
            if h not in self.blocks:
                break
            hit += 1
        for h in blocks:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        # vLLM always computes the last prompt token itself, so a full hit is one short
        tokens = max(0, min(hit * self.block_size, n_prompt - 1))
        self.queries += n_prompt
        self.hits += tokens
        return tokens


@dataclass(eq=False)
class Seq:
    """One request in the KV scheduler."""

    prompt: int
    out: int
    prefill: float  # seconds of prefill before its first token (uncached prompt tokens)
    done: asyncio.Future[None]
    generated: float = 0.0
    prefill_left: float = 0.0
    admitted: bool = field(default=False)


class KvScheduler:
    """Running requests hold ceil((prompt + generated + 1) / block_size) blocks; past the cache,
    the last admitted is preempted (back to the front of the queue, its KV recomputed when it
    is admitted again, as vLLM v1 does). At most max_num_seqs run; a waiting request is admitted
    only when its blocks fit."""

    def __init__(self, *, kv_tokens: int, block_size: int, slots: int, step_time: float,
                 prefill_time: float, tokens_per_step: float, on_running: Callable[[int], None],
                 step_cost: Callable[[int], float] = lambda batch: 1.0) -> None:
        self.total_blocks = max(1, kv_tokens // block_size)
        self.block_size = block_size
        self.slots = slots
        self.step_time = step_time
        self.prefill_time = prefill_time
        self.tokens_per_step = tokens_per_step
        self.on_running = on_running
        self.step_cost = step_cost  # a step's time at a batch, in units of step_time
        self.running: list[Seq] = []
        self.waiting: collections.deque[Seq] = collections.deque()
        self.preemptions = 0
        self.decode_steps = 0.0  # request-steps decoded (spec-decode's drafts)
        self._task: asyncio.Task[None] | None = None

    def _blocks(self, s: Seq) -> int:
        return math.ceil((s.prompt + int(s.generated) + 1) / self.block_size)

    def used_blocks(self) -> int:
        return sum(self._blocks(s) for s in self.running)

    def usage(self) -> float:
        return min(1.0, self.used_blocks() / self.total_blocks)

    async def run(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self._admit()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
            self._task.add_done_callback(self._ended)
        try:
            await seq.done
        finally:
            if not seq.done.done():  # the client went away: its KV is freed at once
                seq.done.cancel()
            if seq in self.running:
                self.running.remove(seq)
                self.on_running(len(self.running))
                self._admit()
            elif seq in self.waiting:
                self.waiting.remove(seq)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A scheduler that dies must not leave its requests waiting forever: fail them, loudly."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("stand-in KV scheduler failed", exc_info=task.exception())
        for s in [*self.running, *self.waiting]:
            if not s.done.done():
                s.done.set_exception(RuntimeError("the stand-in's KV scheduler failed"))

    def _admit(self) -> None:
        used = self.used_blocks()
        changed = False
        while self.waiting and len(self.running) < self.slots:
            s = self.waiting[0]
            need = self._blocks(s)
            if self.running and used + need > self.total_blocks:
                break
            self.waiting.popleft()
            # (re)compute the prompt and anything generated before a preemption
            s.prefill_left = s.prefill if not s.admitted else (s.prompt + s.generated) * self.prefill_time
            s.admitted = True
            self.running.append(s)
            used += need
            changed = True
        if changed:
            self.on_running(len(self.running))

    def _preempt(self) -> None:
        changed = False
        while len(self.running) > 1 and self.used_blocks() > self.total_blocks:
            s = self.running.pop()
            self.waiting.appendleft(s)
            self.preemptions += 1
            changed = True
        if changed:
            self.on_running(len(self.running))

    def _advance(self, dt: float) -> None:
        finished = []
        step_time = self.step_time * self.step_cost(len(self.running))
        for s in self.running:
            left = dt
            if s.prefill_left > 0:
                used = min(left, s.prefill_left)
                s.prefill_left -= used
                left -= used
            if left <= 0:
                continue
            steps = left / step_time if step_time > 0 else math.inf
            steps = min(steps, (s.out - s.generated) / self.tokens_per_step)
            self.decode_steps += steps
            s.generated += steps * self.tokens_per_step
            if s.generated >= s.out - 1e-9:
                finished.append(s)
        for s in finished:
            self.running.remove(s)
            if not s.done.done():
                s.done.set_result(None)
        if finished:
            self.on_running(len(self.running))

    async def _loop(self) -> None:
        tick = min(0.05, max(0.005, self.step_time))
        last = time.monotonic()
        while self.running or self.waiting:
            await asyncio.sleep(tick)
            now = time.monotonic()
            self._advance(now - last)
            last = now
            self._preempt()
            self._admit()
