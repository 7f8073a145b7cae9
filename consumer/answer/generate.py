"""Answering one item: the single-turn and regenerate flows, the requests they need and the
truncation policy. What a failed attempt calls for is faults.py's to say, and the record an
item becomes is built in records.py (both in this wing).

Modes first/last/each: one request on the item's messages. Mode regenerate: the user turns
are answered in order, each on the history of the answers so far (the original assistant
turns were dropped by the producer), so every assistant token comes from the target model.
A turn cut by max_tokens or failed permanently ends the conversation there; what came before
is kept and the record says where and why it stopped (`stopped`); a conversation whose later
turn failed is `partial`, never `finished`. Tool turns (the item keeps the recorded calls and
their results): when the target's calls match the recorded ones (tool_turns.py), the
recorded results are spliced in, answering the target's call ids, and the target answers
again on them; at the first divergence (other calls, none, or a call the recording did not
make) the conversation ends there, noted `tool_call_diverged`.

Fail closed: every failed attempt spends one of `max_attempts` (faults.RetryPolicy). Only
while the Gate is closed (its /health check failed) do requests wait without spending
attempts. Whatever goes wrong, `answer` returns a record: the item never ends in an exception.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from genqueue.common import defaults
from genqueue.common.contracts import (
    ChatMessage,
    ConsumerInfo,
    ErrorClass,
    ErrorRecord,
    Item,
    Mode,
    Note,
    Outcome,
    ResultRecord,
    Stopped,
    Truncation,
    TruncationNote,
    TurnRecord,
    error_info,
)
from genqueue.common.errors import BadResponseError, PermanentError, TransientError
from genqueue.common.settings import RunSettings
from genqueue.common.variants import Variant
from genqueue.consumer.answer import records
from genqueue.consumer.answer.checkpoints import Checkpoints
from genqueue.consumer.answer.client import EndpointClient, Gate, RepeatedLog
from genqueue.consumer.answer.completion import Turn, parse_completion
from genqueue.consumer.answer.faults import RetryKind, RetryPolicy
from genqueue.consumer.answer.tool_turns import call_summary, match_calls, splice_results

__all__ = ["Gate", "Generator", "RunContext", "retry_budget"]

log = logging.getLogger(__name__)

#: Why an answer of a --token-ids run is not usable when the server left its ids out.
NO_TOKEN_IDS = ("the run keeps token ids (--token-ids), but the server returned no prompt_token_ids and "
                "choices[0].token_ids (vLLM's return_token_ids)")


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
    variant: Variant | None = None  # the request variant of one item (for_item), its fields in params

    def __post_init__(self) -> None:
        self.fingerprint = self.settings.fingerprint
        self.params = self.settings.request_params(self.variant)

    def for_item(self, item: object) -> RunContext:
        """This context as ITEM is sent: with the request variant its key draws, when the run
        has a mix (the same on every consumer and every attempt; all turns of a conversation)."""
        key = item.get("key") if isinstance(item, dict) else None
        variant = self.settings.variant_of(key) if isinstance(key, str) else None
        return self if variant is None else replace(self, variant=variant)


class Generator:
    """Sends an item's requests with bounded retries; `answer` never raises (but for
    cancellation)."""

    def __init__(self, client: EndpointClient, gate: Gate, *, max_attempts: int = defaults.MAX_ATTEMPTS,
                 checkpoints: Checkpoints | None = None, backoff_base: float = defaults.BACKOFF_BASE,
                 backoff_cap: float = defaults.BACKOFF_CAP) -> None:
        self.client = client
        self.gate = gate
        self.policy = RetryPolicy(max(1, max_attempts), backoff_base, backoff_cap)
        self.backing_off = 0  # requests sleeping before a retry now
        self.checkpoints = checkpoints
        self.failures: collections.Counter[RetryKind] = collections.Counter()  # failed attempts by kind
        self._log = RepeatedLog(log)
        self.spec_ignored = 0  # answers whose speculative-decoding figures were malformed (ignored)

    async def request(self, ctx: RunContext, messages: Sequence[Mapping[str, object]], tools: object, *,
                      max_tokens: int | None = None, seed: int | None = None, need_ids: bool = True) -> Turn:
        """One completion. After a failed attempt faults.RetryPolicy says what to do: back off
        with jitter and ask the gate whether the endpoint is down (while it is, the request
        waits without spending attempts), or give up. Raises PermanentError, or the last
        TransientError (BadResponseError included) once the attempts are spent. A run with
        --token-ids asks for them; an answer without them is a BadResponseError unless not
        NEED_IDS (the pre-flight probe, which says so in one line itself)."""
        body: dict[str, object] = {"model": ctx.model, "messages": messages, **ctx.params}
        if ctx.settings.token_ids:
            body["return_token_ids"] = True
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
                turn = parse_completion(await self.client.chat(body), think_opened=ctx.think_opened)
                if need_ids and ctx.settings.token_ids and turn.token_ids is None:
                    raise BadResponseError(NO_TOKEN_IDS, snippet="")
                if turn.spec_ignored is not None:  # advisory figures: counted and said, the answer kept
                    self.spec_ignored += 1
                    self._log.warning("spec:ignored", "ignored the speculative-decoding figures of an answer from "
                                      "%s (%d so far): %s", self.client.base_url, self.spec_ignored,
                                      turn.spec_ignored)
                return turn
            except TransientError as e:
                attempt += 1
                step = self.policy.after(e, attempt)
                self.failures[step.kind] += 1
                if step.give_up:
                    self._log.warning(f"exhausted:{step.kind}", "request to %s failed %d times, giving up: %s",
                                      self.client.base_url, attempt, e)
                    raise
                self._log.warning(f"retry:{step.kind}", "request to %s failed (attempt %d of %d), retrying: %s",
                                  self.client.base_url, attempt, self.policy.max_attempts, e)
                if step.ask_gate:
                    await self.gate.check(str(e))
                self.backing_off += 1  # in flight, but nowhere near the engine (the doctor, telemetry)
                try:
                    await asyncio.sleep(step.delay)
                finally:
                    self.backing_off -= 1

    async def answer(self, ctx: RunContext, item: Item, *, attempt: int = 1,
                     enqueued_at: float | None = None) -> ResultRecord | ErrorRecord:
        """The result record (or error record) for ITEM. Anything unexpected becomes an error
        record of class internal; only cancellation propagates."""
        started = time.time()
        t0 = time.perf_counter()
        ctx = ctx.for_item(item)
        rec: ResultRecord | ErrorRecord
        try:
            if ctx.settings.multi_turn == Mode.REGENERATE:
                rec = await self._regenerate(ctx, item, attempt)
            else:
                rec = await self._single(ctx, item, attempt)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every item ends in a record
            key = item.get("key", "?") if isinstance(item, dict) else "?"
            self._log.warning(f"internal:{type(e).__name__}", "item %s: unexpected %s: %s", key,
                              type(e).__name__, e, exc_info=e)
            rec = records.internal_error(ctx, item, attempt, e)
        rec["timings"] = records.timings(enqueued_at, started, time.time(), time.perf_counter() - t0)
        return rec

    async def complete(self, ctx: RunContext, messages: list[ChatMessage],
                       tools: object, seed: int | None = None) -> tuple[Turn, TruncationNote | None]:
        """A completion under the run's truncation policy: with "retry", a cut answer is asked
        again once with the largest budget the context leaves. Returns (turn, truncation note)."""
        turn = await self.request(ctx, messages, tools, seed=seed)
        if turn.outcome == Outcome.FINISHED or ctx.settings.truncation != Truncation.RETRY:
            return turn, None
        sent = ctx.params.get("max_tokens", ctx.settings.sampling.max_tokens)  # a variant may set its own
        budget = retry_budget(ctx.max_model_len, turn.usage.get("prompt_tokens"), sent)
        note: TruncationNote = {"policy": Truncation.RETRY, "first_outcome": turn.outcome, "retried": budget is not None}
        if budget is None:
            return turn, note
        note["max_tokens"] = budget
        return await self.request(ctx, messages, tools, max_tokens=budget, seed=seed), note

    async def _single(self, ctx: RunContext, item: Item, attempt: int) -> ResultRecord | ErrorRecord:
        messages = records.messages_of(item)
        base = records.record_base(ctx, item, attempt, messages)
        try:
            turn, note = await self.complete(ctx, messages, item.get("tools"), records.seed_of(item))
        except (PermanentError, TransientError) as e:
            return records.fault_error(base, e)
        rec = records.result_record(base, turn, ctx.model)
        if note is not None:
            rec["truncation"] = note
        if turn.outcome != Outcome.FINISHED and ctx.settings.truncation == Truncation.ERROR:
            return records.truncated_error(base, turn)
        return rec

    async def _regenerate(self, ctx: RunContext, item: Item, attempt: int) -> ResultRecord | ErrorRecord:
        source = records.messages_of(item)
        total_user_turns = sum(1 for m in source if m["role"] == "user")
        if not total_user_turns:  # intake refuses such an item; a direct caller might not
            return records.error_record(records.record_base(ctx, item, attempt, source),
                                        error_info(ErrorClass.INVALID_ITEM, "InvalidItem", "item has no user turn"))
        history: list[ChatMessage] = []
        turns: list[TurnRecord] = []
        pos = 0
        state = await self._load_checkpoint(ctx, item, len(source)) if total_user_turns > 1 else None
        if state is not None:
            history, turns, pos = state
        stopped: Stopped | None = None
        resumed_at = turns[-1]["turn"] + 1 if state is not None else None
        user_turn = turns[-1]["turn"] if turns else -1
        step = 0  # answers given after tool results within the user turn
        seed, tools, history_reasoning = records.seed_of(item), item.get("tools"), ctx.settings.history_reasoning
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
                    turn, note = await self.complete(ctx, list(history), tools, seed)
                except (PermanentError, TransientError) as e:
                    if not turns:
                        return records.fault_error(records.record_base(ctx, item, attempt, list(history)), e)
                    _drop_unanswered(history)
                    stopped = records.stop(user_turn, step, "error", error=records.fault_info(e))
                    break
                entry = records.turn_record(turn, user_turn, step, note, ctx.model)
                if turn.outcome != Outcome.FINISHED:
                    if ctx.settings.truncation == Truncation.ERROR:
                        if not turns:
                            return records.truncated_error(records.record_base(ctx, item, attempt, list(history)),
                                                           turn)
                        _drop_unanswered(history)
                        stopped = records.stop(user_turn, step, turn.outcome, dropped=True,
                                               error=records.truncated_info(turn.outcome))
                        break
                    turns.append(entry)
                    history.append(records.assistant_message(turn, history_reasoning))
                    stopped = records.stop(user_turn, step, turn.outcome)
                    break
                turns.append(entry)
                history.append(records.assistant_message(turn, history_reasoning))
                recorded = source[pos] if pos < len(source) and source[pos]["role"] == "assistant" else None
                if recorded is None and not turn.tool_calls:
                    break  # answered as the recording did: on to the next user turn
                ids = match_calls(turn.tool_calls, recorded["tool_calls"]) if recorded is not None else None
                entry["tool_results_spliced"] = ids is not None
                if recorded is None and pos == len(source) and item.get("note") == Note.STOPPED_AT_TOOL_TURN:
                    # where the producer cut a call whose results were not recorded: nothing to
                    # compare with, and nothing to splice
                    stopped = records.stop(user_turn, step, Note.STOPPED_AT_TOOL_TURN)
                    break
                if ids is None:
                    stopped = records.stop(user_turn, step, Note.TOOL_CALL_DIVERGED,
                                           recorded=call_summary(recorded["tool_calls"]) if recorded is not None
                                           else [],
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
        return records.conversation_record(records.record_base(ctx, item, attempt, history), turns, history, stopped,
                                           history_reasoning=history_reasoning, turns_total=total_user_turns,
                                           resumed_at=resumed_at)

    async def _load_checkpoint(self, ctx: RunContext, item: Item,
                               n_messages: int) -> tuple[list[ChatMessage], list[TurnRecord], int] | None:
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


def _drop_unanswered(history: list[ChatMessage]) -> None:
    """A failed answer leaves its user turn unanswered: drop it. Spliced tool results stay,
    after the call that asked for them (the turns say they were spliced)."""
    if history and history[-1]["role"] == "user":
        history.pop()
