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
import time
from dataclasses import dataclass, field
from typing import Any

from genqueue.common import __version__
from genqueue.common.backoff import compute_backoff
from genqueue.common.errors import PermanentError, TransientError
from genqueue.common.settings import RunSettings
from genqueue.consumer.client import EndpointClient, EndpointDown
from genqueue.consumer.checkpoints import Checkpoints
from genqueue.consumer.completion import FINISHED, Turn, parse_completion

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What every item of one run shares on this consumer."""

    run: str
    settings: RunSettings
    model: str
    consumer: dict[str, Any]
    max_model_len: int | None = None
    reasoning_probe: str | None = None
    think_opened: bool = False  # the template opens <think> in the prompt (only </think> comes back)
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

    def __init__(self, client: EndpointClient, gate: Gate, *, max_attempts: int = 6,
                 checkpoints: Checkpoints | None = None) -> None:
        self.client = client
        self.gate = gate
        self.max_attempts = max_attempts
        self.checkpoints = checkpoints

    async def request(self, ctx: RunContext, messages: list[dict[str, Any]], tools: Any, *,
                      max_tokens: int | None = None) -> Turn:
        """One completion. Transient trouble is retried with jittered backoff; while the
        endpoint is down the request waits without spending attempts. Raises PermanentError,
        or TransientError once the attempts are spent."""
        body: dict[str, Any] = {"model": ctx.model, "messages": messages, **ctx.params}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if tools:
            body["tools"] = tools
        attempt = 0
        while True:
            await self.gate.up.wait()
            try:
                return parse_completion(await self.client.chat(body), think_opened=ctx.think_opened)
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

    async def complete(self, ctx: RunContext, messages: list[dict[str, Any]],
                       tools: Any) -> tuple[Turn, dict[str, Any] | None]:
        """A completion under the run's truncation policy: with "retry", a cut answer is asked
        again once with the largest budget the context leaves. Returns (turn, truncation note)."""
        turn = await self.request(ctx, messages, tools)
        if turn.outcome == FINISHED or ctx.settings.truncation != "retry":
            return turn, None
        budget = retry_budget(ctx.max_model_len, turn.usage.get("prompt_tokens"), ctx.settings.sampling.max_tokens)
        note: dict[str, Any] = {"policy": "retry", "first_outcome": turn.outcome, "retried": budget is not None}
        if budget is None:
            return turn, note
        note["max_tokens"] = budget
        return await self.request(ctx, messages, tools, max_tokens=budget), note

    async def _single(self, ctx: RunContext, item: dict[str, Any]) -> dict[str, Any]:
        messages = item["messages"]
        try:
            turn, note = await self.complete(ctx, messages, item.get("tools"))
        except (PermanentError, TransientError) as e:
            return _error_fields(e, messages)
        rec = {
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
        if note is not None:
            rec["truncation"] = note
        if turn.outcome != FINISHED and ctx.settings.truncation == "error":
            return _truncated_error(rec)
        return rec

    async def _regenerate(self, ctx: RunContext, item: dict[str, Any]) -> dict[str, Any]:
        source = item["messages"]
        total_user_turns = sum(1 for m in source if m["role"] == "user")
        history: list[dict[str, Any]] = []
        turns: list[dict[str, Any]] = []
        pos = 0
        state = await self.checkpoints.load(ctx.run, item["key"]) if self.checkpoints and total_user_turns > 1 else None
        if state is not None:
            history, turns, pos = state["history"], state["turns"], state["pos"]
        stopped: dict[str, Any] | None = None
        resumed_at = len(turns) if state is not None else None
        while pos < len(source):
            msg = source[pos]
            pos += 1
            history.append(msg)
            if msg["role"] != "user":
                continue
            user_turn = len(turns)
            try:
                turn, note = await self.complete(ctx, list(history), item.get("tools"))
            except (PermanentError, TransientError) as e:
                if not turns:
                    return _error_fields(e, list(history))
                history.pop()
                stopped = {"turn": user_turn, "reason": "error", "error": _error_fields(e, [])["error"]}
                break
            entry = {"turn": user_turn, "content": turn.content, "reasoning": turn.reasoning,
                     "reasoning_form": turn.reasoning_form, "finish_reason": turn.finish_reason,
                     "outcome": turn.outcome, "usage": turn.usage, "model": turn.model or ctx.model}
            if note is not None:
                entry["truncation"] = note
            if turn.outcome != FINISHED:
                if ctx.settings.truncation == "error":
                    if not turns:
                        return _truncated_error({"messages": list(history), **entry})
                    history.pop()
                    stopped = {"turn": user_turn, "reason": turn.outcome, "dropped": True}
                    break
                turns.append(entry)
                history.append(_assistant_message(turn, ctx.settings.history_reasoning))
                stopped = {"turn": user_turn, "reason": turn.outcome}
                break
            turns.append(entry)
            history.append(_assistant_message(turn, ctx.settings.history_reasoning))
            if self.checkpoints is not None and len(turns) < total_user_turns:
                await self.checkpoints.save(ctx.run, item["key"], {"history": history, "turns": turns, "pos": pos})
        if not turns:  # the producer never sends such an item; a hand-made job might
            return _error_fields(PermanentError("item has no user turn"), source)
        last = turns[-1]
        rec: dict[str, Any] = {
            "messages": history,
            "turns": turns,
            "content": last["content"],
            "reasoning": last["reasoning"],
            "reasoning_form": last["reasoning_form"],
            "tool_calls": history[-1].get("tool_calls", []) if history[-1]["role"] == "assistant" else [],
            "finish_reason": last["finish_reason"],
            "outcome": last["outcome"],
            "usage": _sum_usage(t["usage"] for t in turns),
            "model": last["model"],
            "history_reasoning": ctx.settings.history_reasoning,
            "turns_total": total_user_turns,
        }
        if stopped is not None:
            rec["stopped"] = stopped
        if "truncation" in last:
            rec["truncation"] = last["truncation"]
        if resumed_at is not None:
            rec["resumed_at_turn"] = resumed_at
        if item.get("note"):
            rec["note"] = item["note"]
        return rec


def retry_budget(max_model_len: int | None, prompt_tokens: int | None, max_tokens: int) -> int | None:
    """The larger completion budget for a truncation retry: what the context leaves after the
    prompt. None when it is unknown or no larger than the budget that was cut."""
    if not max_model_len or not prompt_tokens:
        return None
    budget = max_model_len - prompt_tokens
    return budget if budget > max_tokens else None


def _truncated_error(rec: dict[str, Any]) -> dict[str, Any]:
    outcome = rec.get("outcome")
    return {
        "messages": rec["messages"],
        "partial": {k: rec.get(k) for k in ("content", "reasoning", "finish_reason", "usage")},
        "error": {"class": "truncated", "type": outcome, "status": None,
                  "message": f"the completion was cut by max_tokens ({outcome}); the run's truncation policy is error"},
    }


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
        **({"tools": item["tools"]} if item.get("tools") else {}),
    }
