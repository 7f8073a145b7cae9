"""Answering one item: the single-turn and regenerate flows, the requests they need and the
truncation policy. What a failed attempt calls for is faults.py's to say; a request's body is
built from the run's settings by common/requests.py (RunContext.shape); a flow comes to a
records.Ending, which records.py turns into the item's complete record (`answer` calls it once).

Modes first/last/each: one request on the item's messages. Mode regenerate: the user turns are
answered in order, each on the history of the answers so far, so every assistant token comes
from the target model. A turn cut by max_tokens or failed permanently ends the conversation
there, what came before kept and the record saying where and why (`stopped`; `partial`, never
`finished`). Tool turns: while the target's calls match the recorded ones (tool_turns.py) the
recorded results are spliced in and the target answers again; at the first divergence the
conversation ends there, noted `tool_call_diverged`.

Capture: each answer kept goes with its capture to the FeatureSink (consumer/capture/features.py),
stored as a checked row before the record naming it (one that does not fit: BadCaptureError). A
capture run never resumes a conversation from a checkpoint: the earlier turns' rows would be in
the spool of the consumer that answered them, which may never ship.

Fail closed: a failed attempt spends one of `max_attempts` (only while the Gate is closed do
requests wait unspent), and `answer` always returns a record, never an exception."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from genqueue.common import defaults
from genqueue.common.backoff import BACKOFF_BASE, BACKOFF_CAP
from genqueue.common.capture import CaptureBudgetSpent, CaptureDecision
from genqueue.common.contracts import ChatMessage, ErrorClass, Item, Mode, Note, Outcome, Truncation
from genqueue.common.records import (
    ConsumerInfo,
    ErrorRecord,
    ResultRecord,
    Stopped,
    TruncationNote,
    TurnRecord,
    error_info,
)
from genqueue.common.requests import RequestShape, item_seed
from genqueue.common.settings import RunSettings
from genqueue.common.variants import Variant
from genqueue.consumer.answer import records
from genqueue.consumer.answer.checkpoints import Checkpoints
from genqueue.consumer.answer.client import EndpointClient, Gate, RepeatedLog
from genqueue.consumer.answer.completion import Turn, parse_completion
from genqueue.consumer.answer.faults import (
    BadResponseError,
    EndpointRefused,
    PermanentError,
    RetryKind,
    RetryPolicy,
    TransientError,
)
from genqueue.consumer.answer.prefill import prefill
from genqueue.consumer.answer.sinks import FeatureSink, TableSink
from genqueue.consumer.answer.tool_turns import call_summary, match_calls, splice_results

__all__ = ["FeatureSink", "Gate", "Generator", "RunContext", "retry_budget"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Why an answer of a --token-ids run is not usable when the server left its ids out.
NO_TOKEN_IDS = ("the run keeps token ids (--token-ids), but the server returned no prompt_token_ids and "
                "choices[0].token_ids (vLLM's return_token_ids)")
#: Why an answer of a --capture run is not usable when the server named no capture file.
NO_CAPTURE = ("the run captures hidden states (--capture), but the server returned no "
              "kv_transfer_params.hidden_states_path (an engine started without extract_hidden_states and its "
              "connector?)")


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
    variant: Variant | None = None  # the request variant of one item (for_item), its fields in shape
    chosen: bool = True  # --capture: the item's answers ask for capture (CaptureSettings.decide; for_item)
    shape: RequestShape = field(init=False)  # what every request of this context carries (common/requests.py)

    def __post_init__(self) -> None:
        self.fingerprint = self.settings.fingerprint
        self.shape = RequestShape.of(self.settings, self.variant)
        if not self.chosen:  # not chosen: it asks for nothing, and costs nothing
            self.shape = replace(self.shape, capture=False)

    @property
    def drafter(self) -> str | None:
        """The drafter the run evaluates (`--drafter`), named in each of its records."""
        return self.settings.drafter

    def for_item(self, item: object) -> RunContext:
        """This context as ITEM is sent: with the request variant its key draws, when the run
        has a mix (the same on every consumer and every attempt; all turns of a conversation),
        and in a --capture run whether its answers are chosen for capture (the same way)."""
        key = item.get("key") if isinstance(item, dict) else None
        variant = self.settings.variant_of(key) if isinstance(key, str) else None
        capture = self.settings.capture
        source = item.get("source") if isinstance(item, dict) else None
        chosen = (capture is None or not isinstance(key, str)
                  or capture.decide(key, source if isinstance(source, str) else None) is CaptureDecision.CAPTURE)
        return self if variant is None and chosen else replace(self, variant=variant, chosen=chosen)


class Generator:
    """Sends an item's requests with bounded retries; `answer` never raises (but for
    cancellation)."""

    def __init__(self, client: EndpointClient, gate: Gate, *, max_attempts: int = defaults.MAX_ATTEMPTS,
                 checkpoints: Checkpoints | None = None, backoff_base: float = BACKOFF_BASE,
                 backoff_cap: float = BACKOFF_CAP, features: FeatureSink | None = None,
                 tables: TableSink | None = None) -> None:
        self.client = client
        self.gate = gate
        self.policy = RetryPolicy(max(1, max_attempts), backoff_base, backoff_cap)
        self.backing_off = 0  # requests sleeping before a retry now
        self.checkpoints = checkpoints
        self.features = features
        self.tables = tables
        #: names each request that asks for hidden states, so its file carries this consumer's
        #: name on the engine's disk (consumer/capture/owner.py); None: the engine names it
        self.request_id: Callable[[], str] | None = None
        self.failures: collections.Counter[RetryKind] = collections.Counter()  # failed attempts by kind
        self._log = RepeatedLog(log)
        self.spec_ignored = 0  # answers whose speculative-decoding figures were malformed (ignored)

    async def request(self, ctx: RunContext, messages: Sequence[Mapping[str, object]], tools: object, *,
                      max_tokens: int | None = None, seed: int | None = None, need_ids: bool = True,
                      capture: bool | None = None) -> Turn:
        """One completion. After a failed attempt faults.RetryPolicy says what to do: back off
        with jitter and ask the gate whether the endpoint is down (while it is, the request
        waits without spending attempts), or give up. Raises PermanentError, or the last
        TransientError (BadResponseError included) once the attempts are spent. A run with
        --token-ids asks for them; an answer without them is a BadResponseError unless not
        NEED_IDS (the pre-flight probe, which says so in one line itself). An answer of a
        --capture run (not the probe) asks for its hidden states, and is a BadResponseError
        without them; CAPTURE asks (True) or not (False) whatever NEED_IDS says (the pre-flight's
        capture probe, which judges the answer itself). A capture the request did not ask for (an
        engine that captures every request) is removed at once: no one else would."""
        capture = (need_ids if capture is None else capture) and ctx.shape.capture
        if capture and need_ids and self.features is not None and ctx.settings.capture is not None:
            capture = await self.features.admits(ctx.run, ctx.settings.capture)  # --capture-budget
        body = ctx.shape.body(ctx.model, messages, tools=tools, max_tokens=max_tokens, seed=seed, capture=capture)
        if capture and self.request_id is not None:
            body["request_id"] = self.request_id()

        async def once() -> Turn:
            turn = parse_completion(await self.client.chat(body), think_opened=ctx.think_opened)
            if need_ids and ctx.shape.token_ids and turn.token_ids is None:
                self.discard(turn)
                raise BadResponseError(NO_TOKEN_IDS, snippet="")
            if not capture and turn.capture_path is not None:
                self.discard(turn)
                turn.capture_path = None
            if capture and need_ids and turn.capture_path is None:
                raise BadResponseError(NO_CAPTURE, snippet="")
            if turn.spec_ignored is not None:  # advisory figures: counted and said, the answer kept
                self.spec_ignored += 1
                self._log.warning("spec:ignored", "ignored the speculative-decoding figures of an answer from "
                                  "%s (%d so far): %s", self.client.base_url, self.spec_ignored,
                                  turn.spec_ignored)
            return turn

        return await self.retrying(once)

    async def retrying(self, once: Callable[[], Awaitable[T]]) -> T:
        """ONCE's answer, asked again after each failed attempt as faults.RetryPolicy says (request's
        loop, and a capture pass's prefill: consumer/answer/prefill.py)."""
        attempt = 0
        while True:
            await self.gate.up.wait()
            try:
                return await once()
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
                    await self.gate.check(str(e), fresh=isinstance(e, EndpointRefused))
                self.backing_off += 1  # in flight, but nowhere near the engine (the doctor, telemetry)
                try:
                    await asyncio.sleep(step.delay)
                finally:
                    self.backing_off -= 1

    async def answer(self, ctx: RunContext, item: Item, *, attempt: int = 1, enqueued_at: float | None = None,
                     copy: bool = False) -> ResultRecord | ErrorRecord:
        """The complete record (result or error) for ITEM, timed, marked when it is an end-of-run
        COPY. Anything unexpected becomes an error record of class internal; only cancellation
        propagates."""
        started = time.time()
        t0 = time.perf_counter()
        ctx = ctx.for_item(item)
        ending: records.Ending
        try:
            if "prefill" in item:  # a capture pass's item (consumer/answer/prefill.py)
                ending = await prefill(item, ctx.run, ctx.settings, ctx.model, sink=self.features,
                                       complete=self.client.completions, retrying=self.retrying,
                                       request_id=self.request_id, tables=self.tables)
            elif ctx.settings.multi_turn == Mode.REGENERATE:
                ending = await self._regenerate(ctx, item)
            else:
                ending = await self._single(ctx, item)
            # built in here too: a record that cannot be built (a checkpoint's turns not of this
            # genqueue, say) is an internal error, not an exception out of the generator
            timings = records.timings(enqueued_at, started, time.time(), time.perf_counter() - t0)
            return records.record(ctx, item, attempt, ending, timings=timings, copy=copy)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every item ends in a record
            key = item.get("key", "?") if isinstance(item, dict) else "?"
            self._log.warning(f"internal:{type(e).__name__}", "item %s: unexpected %s: %s", key,
                              type(e).__name__, e, exc_info=e)
            timings = records.timings(enqueued_at, started, time.time(), time.perf_counter() - t0)
            return records.record(ctx, item, attempt, records.Crashed(e), timings=timings, copy=copy)

    async def complete(self, ctx: RunContext, messages: list[ChatMessage],
                       tools: object, seed: int | None = None) -> tuple[Turn, TruncationNote | None]:
        """A completion under the run's truncation policy: with "retry", a cut answer is asked
        again once with the largest budget the context leaves. Returns (turn, truncation note)."""
        turn = await self.request(ctx, messages, tools, seed=seed)
        if turn.outcome == Outcome.FINISHED or ctx.settings.truncation != Truncation.RETRY:
            return turn, None
        budget = retry_budget(ctx.max_model_len, turn.usage.get("prompt_tokens"), ctx.shape.max_tokens)
        note: TruncationNote = {"policy": Truncation.RETRY, "first_outcome": turn.outcome, "retried": budget is not None}
        if budget is None:
            return turn, note
        note["max_tokens"] = budget
        self.discard(turn)  # the cut answer is not kept
        return await self.request(ctx, messages, tools, max_tokens=budget, seed=seed), note

    def discard(self, turn: Turn) -> None:
        """TURN is not kept: its capture, if the engine made one, goes."""
        if turn.capture_path is not None and self.features is not None:
            self.features.discard(turn.capture_path)

    async def capture(self, ctx: RunContext, row: str, turn: Turn) -> None:
        """--capture: TURN is kept; its hidden states become feature row ROW (turn.features names
        it), and with --logprobs its tables another (turn.tables). Raises BadCaptureError for a
        capture that does not fit TURN, BadLogprobsError for tables that do not."""
        if ctx.settings.logprobs is not None:
            await self.keep_tables(ctx, row, turn)
        capture = ctx.settings.capture
        if capture is None or turn.capture_path is None:
            return
        if self.features is None:
            raise RuntimeError("a capture run's answer reached a generator with no feature sink")
        ids = turn.token_ids
        if ids is None:  # request() refuses such an answer in a capture run (capture needs --token-ids)
            raise RuntimeError("a captured answer without its token ids")
        try:
            turn.features = await self.features.keep(ctx.run, capture, ctx.model, row, turn.capture_path,
                                                     ids["prompt"] + ids["completion"][:-1])
        except CaptureBudgetSpent:  # reached while it was answered: the answer is kept without features
            turn.capture_path = None

    async def keep_tables(self, ctx: RunContext, row: str, turn: Turn) -> None:
        """--logprobs: TURN's tables become feature row ROW (turn.tables names it)."""
        if self.tables is None:
            raise RuntimeError("a --logprobs run's answer reached a generator with no table sink")
        if turn.token_ids is None:  # request() refuses such an answer (--logprobs needs --token-ids)
            raise RuntimeError("an answer with tables but without its token ids")
        turn.tables = await self.tables.keep(ctx.run, ctx.settings, ctx.model, row, turn.logprobs_content,
                                             turn.token_ids["completion"])

    async def _single(self, ctx: RunContext, item: Item) -> records.Ending:
        messages = records.messages_of(item)
        try:
            turn, note = await self.complete(ctx, messages, item.get("tools"), item_seed(item))
            if turn.outcome != Outcome.FINISHED and ctx.settings.truncation == Truncation.ERROR:
                self.discard(turn)
                return records.Cut(messages, turn)
            await self.capture(ctx, item["key"], turn)
        except (PermanentError, TransientError) as e:
            return records.Failed(messages, e)
        return records.Answered(messages, turn, note)

    async def _regenerate(self, ctx: RunContext, item: Item) -> records.Ending:
        source = records.messages_of(item)
        total_user_turns = sum(1 for m in source if m["role"] == "user")
        if not total_user_turns:  # intake refuses such an item; a direct caller might not
            return records.Refused(source, error_info(ErrorClass.INVALID_ITEM, "InvalidItem", "item has no user turn"))
        history: list[ChatMessage] = []
        turns: list[TurnRecord] = []
        pos = 0
        # a checkpoint's turns would name rows a lost spool took with it: capture runs redo them
        resumable = total_user_turns > 1 and ctx.settings.capture is None and ctx.settings.logprobs is None
        state = await self._load_checkpoint(ctx, item, len(source)) if resumable else None
        if state is not None:
            history, turns, pos = state
        stopped: Stopped | None = None
        resumed_at = turns[-1]["turn"] + 1 if state is not None else None
        user_turn = turns[-1]["turn"] if turns else -1
        step = 0  # answers given after tool results within the user turn
        seed, tools, history_reasoning = item_seed(item), item.get("tools"), ctx.settings.history_reasoning
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
                    if turn.outcome != Outcome.FINISHED and ctx.settings.truncation == Truncation.ERROR:
                        self.discard(turn)  # dropped below
                    else:  # kept below, as its turn's answer
                        await self.capture(ctx, feature_row(item["key"], user_turn, step), turn)
                except (PermanentError, TransientError) as e:
                    if not turns:
                        return records.Failed(list(history), e)
                    _drop_unanswered(history)
                    stopped = records.stop(user_turn, step, "error", error=records.fault_info(e))
                    break
                if turn.outcome != Outcome.FINISHED:
                    if ctx.settings.truncation == Truncation.ERROR:
                        if not turns:
                            return records.Cut(list(history), turn)
                        _drop_unanswered(history)
                        stopped = records.stop(user_turn, step, turn.outcome, dropped=True,
                                               error=records.truncated_info(turn.outcome))
                        break
                    self._keep(ctx, turns, history, turn, user_turn, step, note)
                    stopped = records.stop(user_turn, step, turn.outcome)
                    break
                recorded = source[pos] if pos < len(source) and source[pos]["role"] == "assistant" else None
                if recorded is None and not turn.tool_calls:
                    self._keep(ctx, turns, history, turn, user_turn, step, note)
                    break  # answered as the recording did: on to the next user turn
                ids = match_calls(turn.tool_calls, recorded["tool_calls"]) if recorded is not None else None
                self._keep(ctx, turns, history, turn, user_turn, step, note, spliced=ids is not None)
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
            if self.checkpoints is not None and resumable and user_turn + 1 < total_user_turns:
                await self.checkpoints.save(ctx.run, item["key"], {"history": history, "turns": turns, "pos": pos})
        return records.Conversation(history, turns, stopped, history_reasoning, total_user_turns, resumed_at)

    @staticmethod
    def _keep(ctx: RunContext, turns: list[TurnRecord], history: list[ChatMessage], turn: Turn, user_turn: int,
              step: int, note: TruncationNote | None, spliced: bool | None = None) -> None:
        """regenerate: TURN is kept: its entry joins TURNS, its message HISTORY (SPLICED: whether the
        recorded tool results follow it; None when neither it nor the recording made a call)."""
        entry, message = records.answered_turn(turn, user_turn, step, note, ctx.model,
                                               ctx.settings.history_reasoning, spliced)
        turns.append(entry)
        history.append(message)

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


def feature_row(key: str, user_turn: int, step: int) -> str:
    """regenerate: the feature row id of the answer at STEP of USER_TURN of the item KEY."""
    return f"{key}:{user_turn}" + (f".{step}" if step else "")


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
