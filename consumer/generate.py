"""Answering one item: the requests it needs, their retries, and the record it becomes.

Modes first/last/each: one request on the item's messages. Mode regenerate: the user turns
are answered in order, each on the history of the answers so far (the original assistant
turns were dropped by the producer), so every assistant token comes from the target model.
A turn cut by max_tokens or failed permanently ends the conversation there; what came before
is kept and the record says where and why it stopped (`stopped`); a conversation whose later
turn failed is `partial`, never `finished`. Tool turns (the item keeps the recorded calls and
their results): when the target's calls match the recorded ones (consumer/tool_turns.py), the
recorded results are spliced in, answering the target's call ids, and the target answers
again on them; at the first divergence (other calls, none, or a call the recording did not
make) the conversation ends there, noted `tool_call_diverged`.

Fail closed: every failed attempt (refused, reset, deadline, 5xx, a 200 that is not a usable
completion) spends one of `max_attempts` and backs off with jitter, whatever /health says, so
a misbehaving server gets a bounded number of requests per item. Only while the Gate is
closed (its /health check failed) do requests wait without spending attempts. Whatever goes
wrong, `answer` returns a record: the item never ends in an exception.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from genqueue.common import __version__, defaults
from genqueue.common.backoff import compute_backoff
from genqueue.common.contracts import (
    ConsumerInfo,
    ErrorClass,
    ErrorInfo,
    ErrorRecord,
    HistoryReasoning,
    Item,
    Mode,
    Note,
    Outcome,
    RecordBase,
    ResultRecord,
    Truncation,
    TurnRecord,
    Usage,
    error_info,
)
from genqueue.common.errors import BadResponseError, PermanentError, TransientError
from genqueue.common.settings import RunSettings
from genqueue.consumer.checkpoints import Checkpoints
from genqueue.consumer.client import EndpointClient, Gate, RepeatedLog
from genqueue.consumer.completion import Turn, parse_completion
from genqueue.consumer.tool_turns import call_summary, match_calls, splice_results

__all__ = ["Gate", "Generator", "RunContext", "retry_budget"]

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What every item of one run shares on this consumer."""

    run: str
    settings: RunSettings
    model: str
    consumer: ConsumerInfo
    max_model_len: int | None = None
    reasoning_probe: str | None = None
    think_opened: bool = False  # the template opens <think> in the prompt (only </think> comes back)
    fingerprint: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fingerprint = self.settings.fingerprint
        self.params = self.settings.sampling.request_params()


class Generator:
    """Sends an item's requests with bounded retries; `answer` never raises (but for
    cancellation)."""

    def __init__(self, client: EndpointClient, gate: Gate, *, max_attempts: int = defaults.MAX_ATTEMPTS,
                 checkpoints: Checkpoints | None = None, backoff_base: float = defaults.BACKOFF_BASE,
                 backoff_cap: float = defaults.BACKOFF_CAP) -> None:
        self.client = client
        self.gate = gate
        self.max_attempts = max(1, max_attempts)
        self.checkpoints = checkpoints
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.failures: collections.Counter[str] = collections.Counter()  # failed attempts by type
        self._log = RepeatedLog(log)

    async def request(self, ctx: RunContext, messages: list[dict[str, Any]], tools: Any, *,
                      max_tokens: int | None = None, seed: int | None = None) -> Turn:
        """One completion. A failed attempt spends one of max_attempts and backs off with
        jitter; the gate is asked whether the endpoint is down, and while it is, the request
        waits without spending attempts. Raises PermanentError, or the last TransientError
        (BadResponseError included) once the attempts are spent."""
        body: dict[str, Any] = {"model": ctx.model, "messages": messages, **ctx.params}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if seed is not None:  # one of several samples of a prompt: its own seed
            body["seed"] = seed
        if tools:
            body["tools"] = tools
        attempt = 0
        while True:
            await self.gate.up.wait()
            try:
                return parse_completion(await self.client.chat(body), think_opened=ctx.think_opened)
            except TransientError as e:
                attempt += 1
                kind = type(e).__name__
                self.failures[kind] += 1
                if attempt >= self.max_attempts:
                    self._log.warning(f"exhausted:{kind}", "request to %s failed %d times, giving up: %s",
                                      self.client.base_url, attempt, e)
                    raise
                delay = compute_backoff(attempt - 1, base=self.backoff_base, cap=self.backoff_cap)
                self._log.warning(f"retry:{kind}", "request to %s failed (attempt %d of %d), retrying: %s",
                                  self.client.base_url, attempt, self.max_attempts, e)
                await self.gate.check(str(e))
                await asyncio.sleep(delay)

    async def answer(self, ctx: RunContext, item: Item, *, attempt: int = 1,
                     enqueued_at: float | None = None) -> ResultRecord | ErrorRecord:
        """The result record (or error record) for ITEM. Anything unexpected becomes an error
        record of class internal; only cancellation propagates."""
        started = time.time()
        t0 = time.perf_counter()
        rec: ResultRecord | ErrorRecord
        try:
            if ctx.settings.multi_turn == Mode.REGENERATE:
                rec = await self._regenerate(ctx, item, attempt)
            else:
                rec = await self._single(ctx, item, attempt)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every item ends in a record
            self._log.warning(f"internal:{type(e).__name__}", "item %s: unexpected %s: %s", _get(item, "key", "?"),
                              type(e).__name__, e, exc_info=e)
            msgs = _get(item, "messages", [])
            rec = _error_record(_base(ctx, item, attempt, msgs if isinstance(msgs, list) else []),
                                error_info(ErrorClass.INTERNAL, type(e).__name__, f"{type(e).__name__}: {e}"))
        rec["timings"] = {
            "enqueued_at": enqueued_at,
            "started_at": started,
            "finished_at": time.time(),
            "latency_s": round(time.perf_counter() - t0, 4),
        }
        return rec

    async def complete(self, ctx: RunContext, messages: list[dict[str, Any]],
                       tools: Any, seed: int | None = None) -> tuple[Turn, dict[str, Any] | None]:
        """A completion under the run's truncation policy: with "retry", a cut answer is asked
        again once with the largest budget the context leaves. Returns (turn, truncation note)."""
        turn = await self.request(ctx, messages, tools, seed=seed)
        if turn.outcome == Outcome.FINISHED or ctx.settings.truncation != Truncation.RETRY:
            return turn, None
        budget = retry_budget(ctx.max_model_len, turn.usage.get("prompt_tokens"), ctx.settings.sampling.max_tokens)
        note: dict[str, Any] = {"policy": Truncation.RETRY, "first_outcome": turn.outcome, "retried": budget is not None}
        if budget is None:
            return turn, note
        note["max_tokens"] = budget
        return await self.request(ctx, messages, tools, max_tokens=budget, seed=seed), note

    async def _single(self, ctx: RunContext, item: Item, attempt: int) -> ResultRecord | ErrorRecord:
        messages = item["messages"]
        base = _base(ctx, item, attempt, messages)
        try:
            turn, note = await self.complete(ctx, messages, item.get("tools"), _seed(item))
        except (PermanentError, TransientError) as e:
            return _error_record(base, _error_info(e))
        rec = _result_record(base, turn, ctx.model)
        if note is not None:
            rec["truncation"] = note
        if turn.outcome != Outcome.FINISHED and ctx.settings.truncation == Truncation.ERROR:
            return _truncated_error(base, turn)
        return rec

    async def _regenerate(self, ctx: RunContext, item: Item, attempt: int) -> ResultRecord | ErrorRecord:
        source = item["messages"]
        total_user_turns = sum(1 for m in source if m["role"] == "user")
        if not total_user_turns:  # intake refuses such an item; a direct caller might not
            return _error_record(_base(ctx, item, attempt, source),
                                 error_info(ErrorClass.INVALID_ITEM, "InvalidItem", "item has no user turn"))
        history: list[dict[str, Any]] = []
        turns: list[TurnRecord] = []
        pos = 0
        state = await self._load_checkpoint(ctx, item, len(source)) if total_user_turns > 1 else None
        if state is not None:
            history, turns, pos = state
        stopped: dict[str, Any] | None = None
        resumed_at = turns[-1]["turn"] + 1 if state is not None else None
        user_turn = turns[-1]["turn"] if turns else -1
        step = 0  # answers given after tool results within the user turn
        while pos < len(source):
            msg = source[pos]
            pos += 1
            if msg["role"] == "user":
                user_turn, step = user_turn + 1, 0
            elif msg["role"] != "system":
                continue  # recorded tool turns are read at the answer they follow
            history.append(msg)
            if msg["role"] != "user":
                continue
            while True:  # the user turn's answer, and one more after each spliced tool result
                try:
                    turn, note = await self.complete(ctx, list(history), item.get("tools"), _seed(item))
                except (PermanentError, TransientError) as e:
                    if not turns:
                        return _error_record(_base(ctx, item, attempt, list(history)), _error_info(e))
                    _drop_unanswered(history)
                    stopped = _stop(user_turn, step, "error", error=_error_info(e))
                    break
                entry: TurnRecord = {
                    "turn": user_turn, "content": turn.content, "reasoning": turn.reasoning,
                    "reasoning_form": turn.reasoning_form, "finish_reason": turn.finish_reason,
                    "outcome": turn.outcome, "usage": turn.usage, "model": turn.model or ctx.model}
                if step:
                    entry["step"] = step
                if turn.tool_calls:
                    entry["tool_calls"] = turn.tool_calls
                if note is not None:
                    entry["truncation"] = note
                if turn.outcome != Outcome.FINISHED:
                    if ctx.settings.truncation == Truncation.ERROR:
                        if not turns:
                            return _truncated_error(_base(ctx, item, attempt, list(history)), turn)
                        _drop_unanswered(history)
                        stopped = _stop(user_turn, step, turn.outcome, dropped=True,
                                        error=_truncated_info(turn.outcome))
                        break
                    turns.append(entry)
                    history.append(_assistant_message(turn, ctx.settings.history_reasoning))
                    stopped = _stop(user_turn, step, turn.outcome)
                    break
                turns.append(entry)
                history.append(_assistant_message(turn, ctx.settings.history_reasoning))
                recorded = source[pos] if pos < len(source) and source[pos]["role"] == "assistant" else None
                if recorded is None and not turn.tool_calls:
                    break  # answered as the recording did: on to the next user turn
                ids = match_calls(turn.tool_calls, recorded["tool_calls"]) if recorded is not None else None
                entry["tool_results_spliced"] = ids is not None
                if recorded is None and pos == len(source) and item.get("note") == Note.STOPPED_AT_TOOL_TURN:
                    # where the producer cut a call whose results were not recorded: nothing to
                    # compare with, and nothing to splice
                    stopped = _stop(user_turn, step, Note.STOPPED_AT_TOOL_TURN)
                    break
                if ids is None:
                    stopped = _stop(user_turn, step, Note.TOOL_CALL_DIVERGED,
                                    recorded=call_summary(recorded["tool_calls"]) if recorded is not None else [],
                                    target=call_summary(turn.tool_calls))
                    break
                pos += 1
                results = []
                while pos < len(source) and source[pos]["role"] == "tool":
                    results.append(source[pos])
                    pos += 1
                history.extend(splice_results(results, ids))
                step += 1
            if stopped is not None:
                break
            if self.checkpoints is not None and user_turn + 1 < total_user_turns:
                await self.checkpoints.save(ctx.run, item["key"], {"history": history, "turns": turns, "pos": pos})
        last = turns[-1]
        rec = cast(ResultRecord, dict(_base(ctx, item, attempt, history)))
        rec["turns"] = turns
        rec["content"] = last["content"]
        rec["reasoning"] = last["reasoning"]
        rec["reasoning_form"] = last["reasoning_form"]
        rec["tool_calls"] = history[-1].get("tool_calls", []) if history[-1]["role"] == "assistant" else []
        rec["finish_reason"] = last["finish_reason"]
        # A later turn that failed leaves a conversation the target never finished: never
        # `finished`, so it stays out of a default training file. A cut turn that was kept
        # (--truncation keep) is the last turn, and its own outcome says what it is. A tool
        # call that diverged ends a conversation whose every answer is the target's own: it
        # keeps the last answer's outcome, and the note says why it ends early.
        rec["outcome"] = Outcome.PARTIAL if stopped is not None and "error" in stopped else last["outcome"]
        rec["usage"] = _sum_usage(t["usage"] for t in turns)
        rec["model"] = last["model"]
        rec["history_reasoning"] = ctx.settings.history_reasoning
        rec["turns_total"] = total_user_turns
        if stopped is not None:
            rec["stopped"] = stopped
            if stopped["reason"] == Note.TOOL_CALL_DIVERGED:
                rec["note"] = Note.TOOL_CALL_DIVERGED
        if "truncation" in last:
            rec["truncation"] = last["truncation"]
        if resumed_at is not None:
            rec["resumed_at_turn"] = resumed_at
        return rec

    async def _load_checkpoint(self, ctx: RunContext, item: Item,
                               n_messages: int) -> tuple[list[dict[str, Any]], list[TurnRecord], int] | None:
        """A saved (history, turns, position), or None to start at turn 1 (none saved, or one
        whose shape does not fit this item: better to redo turns than to fail the item)."""
        if self.checkpoints is None:
            return None
        state = await self.checkpoints.load(ctx.run, item["key"])
        if state is None:
            return None
        history, turns, pos = state.get("history"), state.get("turns"), state.get("pos")
        if (isinstance(history, list) and isinstance(turns, list) and isinstance(pos, int)
                and 0 < pos <= n_messages and turns and all(isinstance(t, dict) for t in turns)):
            return history, turns, pos
        self._log.warning("checkpoint", "checkpoint of %s does not fit the item; starting at turn 1", item["key"])
        return None


def retry_budget(max_model_len: int | None, prompt_tokens: int | None, max_tokens: int) -> int | None:
    """The larger completion budget for a truncation retry: what the context leaves after the
    prompt. None when it is unknown or no larger than the budget that was cut."""
    if not max_model_len or not prompt_tokens:
        return None
    budget = max_model_len - prompt_tokens
    return budget if budget > max_tokens else None


def _result_record(base: RecordBase, turn: Turn, model: str) -> ResultRecord:
    # cast, then typed assignments: a TypedDict literal cannot spread RecordBase under mypy's
    # strict extra checks.
    rec = cast(ResultRecord, dict(base))
    rec["content"] = turn.content
    rec["reasoning"] = turn.reasoning
    rec["reasoning_form"] = turn.reasoning_form
    rec["tool_calls"] = turn.tool_calls
    rec["finish_reason"] = turn.finish_reason
    rec["outcome"] = turn.outcome
    rec["usage"] = turn.usage
    rec["model"] = turn.model or model
    return rec


def _error_record(base: RecordBase, info: ErrorInfo, partial: dict[str, Any] | None = None) -> ErrorRecord:
    rec = cast(ErrorRecord, dict(base))
    rec["error"] = info
    if partial is not None:
        rec["partial"] = partial
    return rec


def _truncated_info(outcome: str) -> ErrorInfo:
    return error_info(ErrorClass.TRUNCATED, outcome,
                      f"the completion was cut by max_tokens ({outcome}); the run's truncation policy is error")


def _truncated_error(base: RecordBase, turn: Turn) -> ErrorRecord:
    partial = {"content": turn.content, "reasoning": turn.reasoning, "finish_reason": turn.finish_reason,
               "usage": turn.usage}
    return _error_record(base, _truncated_info(turn.outcome), partial)


def _stop(user_turn: int, step: int, reason: str, **detail: Any) -> dict[str, Any]:
    """The record's `stopped`: the user turn, the answer's step after tool results (when not
    the first answer), the reason and its details."""
    stopped: dict[str, Any] = {"turn": user_turn, "reason": reason}
    if step:
        stopped["step"] = step
    stopped.update(detail)
    return stopped


def _drop_unanswered(history: list[dict[str, Any]]) -> None:
    """A failed answer leaves its user turn unanswered: drop it. Spliced tool results stay,
    after the call that asked for them (the turns say they were spliced)."""
    if history and history[-1]["role"] == "user":
        history.pop()


def _assistant_message(turn: Turn, history_reasoning: str) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        msg["tool_calls"] = turn.tool_calls
    if history_reasoning == HistoryReasoning.KEEP and turn.reasoning:
        # vLLM's Qwen3-style templates read the thinking of earlier turns from this field.
        msg["reasoning_content"] = turn.reasoning
    return msg


_USAGE_KEYS: tuple[Literal["prompt_tokens", "completion_tokens", "total_tokens", "reasoning_tokens"], ...] = (
    "prompt_tokens", "completion_tokens", "total_tokens", "reasoning_tokens")


def _sum_usage(usages: Iterable[Usage]) -> Usage:
    total: Usage = {}
    for u in usages:
        for k in _USAGE_KEYS:
            v = u.get(k)
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
    return total


def _error_info(e: PermanentError | TransientError) -> ErrorInfo:
    if isinstance(e, PermanentError):
        cls = ErrorClass.PERMANENT
    elif isinstance(e, BadResponseError):
        cls = ErrorClass.BAD_RESPONSE
    else:
        cls = ErrorClass.TRANSIENT_EXHAUSTED
    return error_info(cls, type(e).__name__, str(e), e.status)


def _get(item: Any, key: str, default: Any) -> Any:
    return item.get(key, default) if isinstance(item, dict) else default


def _seed(item: Any) -> int | None:
    """The item's own request seed (one of several samples of a prompt), if it has one."""
    seed = _get(item, "seed", None)
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def _base(ctx: RunContext, item: Item, attempt: int, messages: list[dict[str, Any]]) -> RecordBase:
    """The fields every record carries. Reads ITEM defensively: it also builds the record of
    an item that made answering fail (then it may not even be a dict)."""
    get: Callable[..., Any] = item.get if isinstance(item, dict) else _NOTHING.get  # once per item
    key, index, turn, seed = get("key", ""), get("index", -1), get("turn"), _seed(item)
    base: RecordBase = {
        "key": key if isinstance(key, str) else str(key),
        "index": index if isinstance(index, int) else -1,
        "turn": turn if isinstance(turn, int) else None,
        "run": ctx.run,
        "messages": messages,
        "sampling": ctx.params if seed is None else {**ctx.params, "seed": seed},
        "fingerprint": ctx.fingerprint,
        "version": __version__,
        "consumer": ctx.consumer,
        "attempt": attempt,
    }
    tools, note = get("tools"), get("note")
    if tools:
        base["tools"] = tools
    if isinstance(note, str) and note:
        base["note"] = note
    # provenance: the input record's id, its source and place, the sample (the export's order)
    for name in ("id", "source"):
        text = get(name)
        if isinstance(text, str):
            base[name] = text
    for field_ in ("source_seq", "sample", "seed"):
        number = get(field_)
        if isinstance(number, int) and not isinstance(number, bool):
            base[field_] = number
    return base


_NOTHING: dict[str, Any] = {}
