"""Answering one item: the requests it needs, their retries, and the record it becomes.

Modes first/last/each: one request on the item's messages. Mode regenerate: the user turns
are answered in order, each on the history of the answers so far (the original assistant
turns were dropped by the producer), so every assistant token comes from the target model.
A turn cut by max_tokens or failed permanently ends the conversation there; what came before
is kept and the record says where and why it stopped.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from common import __version__
from common.backoff import compute_backoff
from common.errors import PermanentError, TransientError
from common.settings import RunSettings
from consumer.client import EndpointClient, EndpointDown
from consumer.completion import CUT_IN_ANSWER, CUT_IN_THINKING, Turn, parse_completion

log = logging.getLogger(__name__)
HOST = socket.gethostname()


@dataclass
class RunContext:
    """What every item of one run shares on this consumer."""

    run: str
    settings: RunSettings
    model: str
    consumer: dict[str, Any]
    fingerprint: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fingerprint = self.settings.fingerprint
        self.params = self.settings.sampling.request_params()


class Gate:
    """Open while the endpoint is up. Closed on a refused connection until /health is back."""

    def __init__(self, client: EndpointClient, *, probe_interval: float = 1.0) -> None:
        self.client = client
        self.up = asyncio.Event()
        self.up.set()
        self.probe_interval = probe_interval
        self.down_since: float | None = None
        self.outages = 0
        self._monitor: asyncio.Task[None] | None = None

    def mark_down(self, reason: str) -> None:
        if not self.up.is_set():
            return
        self.up.clear()
        self.down_since = time.monotonic()
        self.outages += 1
        log.warning("endpoint %s is down (%s): pausing admission, leases kept alive", self.client.base_url, reason)
        self._monitor = asyncio.create_task(self._wait_until_up())

    async def _wait_until_up(self) -> None:
        while not await self.client.healthy():
            await asyncio.sleep(self.probe_interval)
        down_for = time.monotonic() - (self.down_since or time.monotonic())
        log.warning("endpoint %s is back after %.1f s: resuming", self.client.base_url, down_for)
        self.down_since = None
        self.up.set()

    @property
    def paused(self) -> bool:
        return not self.up.is_set()


class Generator:
    """Sends an item's requests with retries; never raises for a request's failure."""

    def __init__(self, client: EndpointClient, gate: Gate, *, max_attempts: int = 6) -> None:
        self.client = client
        self.gate = gate
        self.max_attempts = max_attempts

    async def request(self, ctx: RunContext, messages: list[dict[str, Any]], tools: Any) -> Turn:
        """One completion. Transient trouble is retried with jittered backoff; while the
        endpoint is down the request waits without spending attempts. Raises PermanentError,
        or TransientError once the attempts are spent."""
        body: dict[str, Any] = {"model": ctx.model, "messages": messages, **ctx.params}
        if tools:
            body["tools"] = tools
        attempt = 0
        while True:
            await self.gate.up.wait()
            try:
                return parse_completion(await self.client.chat(body))
            except EndpointDown as e:
                self.gate.mark_down(str(e))
            except TransientError:
                attempt += 1
                if attempt >= self.max_attempts:
                    raise
                await asyncio.sleep(compute_backoff(attempt - 1))

    async def answer(self, ctx: RunContext, item: dict[str, Any], *, attempt: int = 1,
                     enqueued_at: float | None = None) -> dict[str, Any]:
        """The result record (or error record) for ITEM."""
        started = time.time()
        t0 = time.perf_counter()
        if ctx.settings.multi_turn == "regenerate":
            rec = await self._regenerate(ctx, item)
        else:
            rec = await self._single(ctx, item)
        finished = time.time()
        rec.update(_common_fields(ctx, item, attempt))
        rec["timings"] = {
            "enqueued_at": enqueued_at,
            "started_at": started,
            "finished_at": finished,
            "latency_s": round(time.perf_counter() - t0, 4),
        }
        return rec

    async def _single(self, ctx: RunContext, item: dict[str, Any]) -> dict[str, Any]:
        messages = item["messages"]
        try:
            turn = await self.request(ctx, messages, item.get("tools"))
        except (PermanentError, TransientError) as e:
            return _error_fields(e, messages)
        return {
            "messages": messages,
            "content": turn.content,
            "reasoning": turn.reasoning,
            "reasoning_form": turn.reasoning_form,
            "tool_calls": turn.tool_calls,
            "finish_reason": turn.finish_reason,
            "outcome": turn.outcome,
            "usage": turn.usage,
            "model": turn.model or ctx.model,
        }

    async def _regenerate(self, ctx: RunContext, item: dict[str, Any]) -> dict[str, Any]:
        source = item["messages"]
        history: list[dict[str, Any]] = []
        turns: list[dict[str, Any]] = []
        stopped: dict[str, Any] | None = None
        last: Turn | None = None
        user_turn = 0
        for msg in source:
            history.append(msg)
            if msg["role"] != "user":
                continue
            try:
                turn = await self.request(ctx, list(history), item.get("tools"))
            except (PermanentError, TransientError) as e:
                if not turns:
                    return _error_fields(e, list(history))
                history.pop()
                stopped = {"turn": user_turn, "reason": "error", "error": _error_fields(e, [])["error"]}
                break
            last = turn
            turns.append({
                "turn": user_turn,
                "content": turn.content,
                "reasoning": turn.reasoning,
                "finish_reason": turn.finish_reason,
                "outcome": turn.outcome,
                "usage": turn.usage,
            })
            history.append(_assistant_message(turn, ctx.settings.history_reasoning))
            user_turn += 1
            if turn.outcome in (CUT_IN_THINKING, CUT_IN_ANSWER):
                stopped = {"turn": user_turn - 1, "reason": turn.outcome}
                break
        if last is None:  # the producer never sends such an item; a hand-made job might
            return _error_fields(PermanentError("item has no user turn"), source)
        total_user_turns = sum(1 for m in source if m["role"] == "user")
        usage = _sum_usage(t["usage"] for t in turns)
        rec: dict[str, Any] = {
            "messages": history,
            "turns": turns,
            "content": last.content,
            "reasoning": last.reasoning,
            "reasoning_form": last.reasoning_form,
            "tool_calls": last.tool_calls,
            "finish_reason": last.finish_reason,
            "outcome": last.outcome,
            "usage": usage,
            "model": last.model or ctx.model,
            "history_reasoning": ctx.settings.history_reasoning,
            "turns_total": total_user_turns,
        }
        if stopped is not None:
            rec["stopped"] = stopped
        if item.get("note"):
            rec["note"] = item["note"]
        return rec


def _assistant_message(turn: Turn, history_reasoning: str) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        msg["tool_calls"] = turn.tool_calls
    if history_reasoning == "keep" and turn.reasoning:
        # vLLM's Qwen3-style templates read the thinking of earlier turns from this field.
        msg["reasoning_content"] = turn.reasoning
    return msg


def _sum_usage(usages: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for u in usages:
        for k, v in u.items():
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
    return total


def _error_fields(e: Exception, messages: list[dict[str, Any]]) -> dict[str, Any]:
    kind = "permanent" if isinstance(e, PermanentError) else "transient_exhausted"
    return {
        "messages": messages,
        "error": {"class": kind, "type": type(e).__name__, "status": getattr(e, "status", None), "message": str(e)},
    }


def _common_fields(ctx: RunContext, item: dict[str, Any], attempt: int) -> dict[str, Any]:
    return {
        "key": item["key"],
        "index": item["index"],
        "turn": item.get("turn"),
        "run": ctx.run,
        "sampling": ctx.params,
        "fingerprint": ctx.fingerprint,
        "version": __version__,
        "consumer": ctx.consumer,
        "attempt": attempt,
    }
