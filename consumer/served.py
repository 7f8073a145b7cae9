"""Which runs a consumer serves: the endpoint's models, the runs in Redis whose model it
serves, and one probe request per run that learns how the server returns thinking."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from genqueue.common.capture import CaptureSettings
from genqueue.common.capture_model import check_model
from genqueue.common.contracts import ExitCode, ReasoningForm
from genqueue.common.errors import CorruptStateError, GenqueueError, ModelNotServedError, UserError, as_clause
from genqueue.common.eta import format_duration
from genqueue.common.keepers.pause import Pause
from genqueue.common.keepers.rqaccess import job_counts
from genqueue.common.keepers.runs import RunInfo, RunStore
from genqueue.common.records import ConsumerInfo, SpecFigures
from genqueue.common.requests import RequestShape
from genqueue.common.storage import OutputProbeError, probe_output
from genqueue.common.variants import Variant
from genqueue.consumer.answer.client import EndpointClient
from genqueue.consumer.answer.faults import PermanentError, TransientError, classify_status
from genqueue.consumer.answer.generate import Generator, RunContext
from genqueue.consumer.answer.spec import speculation_note
from genqueue.consumer.capture import probe as capture_probe
from genqueue.consumer.capture import tables
from genqueue.consumer.capture.facts import PROBE_TIMEOUT, EngineFactsReader
from genqueue.consumer.capture.features import other_capture
from genqueue.consumer.capture.owner import CaptureOwner
from genqueue.consumer.engine.readings import engine_view
from genqueue.consumer.rqthread import RqThread

log = logging.getLogger(__name__)

#: Seconds before a run that failed this consumer's pre-flight is checked again (its settings or engine may change).
PREFLIGHT_RETRY = 300.0


@dataclass(frozen=True, slots=True)
class ServedSnapshot:
    models: list[str]
    max_model_len: dict[str, int | None]
    runs: dict[str, RunContext]
    refused: dict[str, str]  # run -> why this consumer does not serve it (pre-flight, or paused)


@dataclass(slots=True)
class _Refusal:
    reason: str
    code: ExitCode  # what it makes a --burst consumer's exit: REFUSED (placement) or PREFLIGHT
    fingerprint: str  # _version() of the run refused: a refusal holds until it changes, or PREFLIGHT_RETRY
    at: float


def _version(info: RunInfo) -> str:
    """What a refusal depends on: the run's settings, and where its output lives (a run declared
    --shared-fs is served at once)."""
    return f"{info.fingerprint}@{info.placement.host or ''}"


class ServedRuns:
    """Finds and prepares the runs this consumer may serve."""

    def __init__(self, rq: RqThread, store: RunStore, client: EndpointClient, gen: Generator, *,
                 endpoint: str, only_run: str | None, identity: ConsumerInfo, worker: str,
                 request_timeout: float, endpoint_wait: float, shared_fs: bool = False) -> None:
        self.rq = rq
        self.store = store
        self.client = client
        self.gen = gen
        self.endpoint = endpoint
        self.only_run = only_run
        self.identity = identity
        self.worker = worker
        self.request_timeout = request_timeout
        self.endpoint_wait = endpoint_wait
        self.shared_fs = shared_fs
        self.models: list[str] = []
        self.model_lens: dict[str, int | None] = {}
        self.facts = EngineFactsReader(endpoint)  # the engine's version, model revision and template hash
        self.model_roots: dict[str, str] = {}
        self.capture_owner: CaptureOwner | None = None  # names this consumer's capture files (worker sets it)
        self.contexts: dict[str, RunContext] = {}
        self._skipped: set[str] = set()
        self._refused: dict[str, _Refusal] = {}
        self.paused: dict[str, str] = {}  # runs paused in Redis (the breaker), with the reason
        self._tripped: dict[str, str] = {}  # paused here, not yet seen paused in Redis
        self.vanished: dict[str, str] = {}  # runs served here that are gone from Redis
        self.priorities: dict[str, int] = {}  # each run's priority, as of the last resolve
        self._count = -1  # how many runs Redis held at the last resolve
        self._started = False

    def pause(self, run: str, reason: str) -> None:
        """This consumer's breaker paused RUN: in force here at once."""
        self.paused[run] = self._tripped[run] = reason

    def names(self) -> list[str]:
        """The runs prepared so far (the sweeper's list)."""
        return list(self.contexts)

    async def wait_for_models(self) -> None:
        """Read /v1/models, waiting up to endpoint_wait for the endpoint to answer: vLLM takes
        minutes to load a large model, and a restarted node may start its consumer first.
        (A stop cancels the wait: the consumer races its start-up against it.)"""
        t0 = time.monotonic()
        deadline = t0 + self.endpoint_wait
        last_log = 0.0
        while True:
            try:
                models = await self.client.models()
                break
            except TransientError as e:  # refused, reset, 5xx, a garbled /v1/models: wait
                now = time.monotonic()
                if now >= deadline:
                    raise UserError(f"endpoint {self.endpoint} is not reachable after "
                                    f"{format_duration(now - t0)} (--endpoint-wait): {e}") from None
                if now - last_log >= 10.0:
                    log.warning("waiting for endpoint %s (%s): waited %s, waiting %s more (--endpoint-wait %s)",
                                self.endpoint, as_clause(e), format_duration(now - t0), format_duration(deadline - now),
                                format_duration(self.endpoint_wait))
                    last_log = now
                await asyncio.sleep(1.0)
        self.models = [m["id"] for m in models if isinstance(m.get("id"), str)]
        self.model_lens = {m["id"]: m.get("max_model_len") for m in models if isinstance(m.get("id"), str)}
        # vLLM's `root`: the model's folder or hub id, whose config.json a capture run is checked against
        self.model_roots = {m["id"]: m["root"] for m in models if isinstance(m.get("id"), str)
                            and isinstance(m.get("root"), str)}
        if not self.models:
            raise UserError(f"endpoint {self.endpoint} serves no model (/v1/models is empty)")
        log.info("endpoint %s serves %s", self.endpoint, ", ".join(self.models))

    async def resolve(self) -> list[str]:
        """The runs this consumer may serve now, highest priority first, then oldest first, with
        contexts ready: not paused in Redis, and past this consumer's pre-flight."""
        names = [self.only_run] if self.only_run else await self.rq.call(self.store.names)
        self._count = len(names)
        paused = await self.rq.call(Pause.reasons, self.store.conn, names)
        priorities = await self.rq.call(self.store.priorities, names)
        for name, p in priorities.items():
            if p != self.priorities.get(name, p):
                log.info("run %s: priority %d -> %d", name, self.priorities[name], p)
        self.priorities = priorities
        # A pause this consumer made is in force before Redis has it (its write may be on its way).
        for run in list(self._tripped):
            if run in paused:
                del self._tripped[run]
            else:
                paused[run] = self._tripped[run]
        for name, why in paused.items():
            if name not in self.paused:
                log.warning("run %s is paused (%s): not taking its jobs until `producer resume --run %s`",
                            name, why, name)
        for name in set(self.paused) - set(paused):
            log.info("run %s resumed", name)
            self.contexts.pop(name, None)  # probed again, with a fresh breaker
        self.paused = paused
        if self.contexts:
            present = await self.rq.call(self.store.fingerprints, list(self.contexts))
            for name in [n for n in self.contexts if n not in present]:
                self._vanish(name)
            for name, fp in present.items():
                ctx = self.contexts.get(name)
                if ctx is not None and fp != ctx.fingerprint:
                    # `producer enqueue --update-settings`: jobs held now finish under the settings
                    # they started with (and record them); new ones take the new settings.
                    log.warning("run %s: settings changed (fingerprint %s -> %s); new jobs use them", name,
                                ctx.fingerprint, fp)
                    del self.contexts[name]
        usable = []
        for name in names:
            if name in paused:
                continue
            if name in self.contexts:
                usable.append(name)
                continue
            if name in self._skipped:
                continue
            try:
                info = await self.rq.call(self.store.get, name)
            except CorruptStateError as e:  # not genqueue's record: nothing of it can be served
                if self.only_run:
                    raise UserError(str(e)) from None
                if name not in self._refused or self._refused[name].reason != str(e):
                    log.error("not serving run %s: %s", name, e)
                self._refused[name] = _Refusal(str(e), ExitCode.PREFLIGHT, "unreadable", time.monotonic())
                continue
            if info is None:
                if self.only_run and not self._started and name not in self.vanished:
                    raise self.store.not_found(name)
                continue
            if self.vanished.pop(name, None) is not None:
                log.warning("run %s is back in Redis: serving it again", name)
            if not self.only_run:
                counts = await self.rq.call(job_counts, self.store.conn, name)
                if not (counts["queued"] or counts["started"] or counts["dequeuing"]):
                    continue  # done, or not fed yet: no probe until it has work (or leases to sweep)
            refusal = self._refused.get(name)
            if refusal is not None and refusal.fingerprint == _version(info) \
                    and time.monotonic() - refusal.at < PREFLIGHT_RETRY:
                continue
            misplaced = None if self.shared_fs else info.placement.refusal(
                name, info.settings.output, self.identity["host"])
            if misplaced is not None:
                if self.only_run:
                    raise UserError(misplaced)
                if refusal is None or refusal.reason != misplaced:
                    log.error("not serving run %s: %s", name, misplaced)
                self._refused[name] = _Refusal(misplaced, ExitCode.REFUSED, _version(info), time.monotonic())
                continue
            model = info.settings.model
            if model is None:
                model = self.models[0]
            elif model not in self.models:
                msg = (f"run {name!r} asks for model {model!r}, but {self.endpoint} serves "
                       f"{', '.join(self.models) or 'nothing'}")
                if self.only_run:
                    raise ModelNotServedError(msg)
                log.info("skipping %s", msg)
                self._skipped.add(name)
                continue
            ctx = RunContext(name, info.settings, model, self.identity, max_model_len=self.model_lens.get(model))
            failed = await self._preflight(ctx)
            if failed is not None:
                if refusal is None or refusal.reason != failed:
                    log.error("run %s: pre-flight failed, not serving it on this consumer: %s", name, failed)
                self._refused[name] = _Refusal(failed, ExitCode.PREFLIGHT, _version(info), time.monotonic())
                continue
            if self._refused.pop(name, None) is not None:
                log.info("run %s: pre-flight passes now; serving it", name)
            self.contexts[name] = ctx
            usable.append(name)
        self._started = True
        usable.sort(key=lambda n: -priorities.get(n, 0))  # stable: oldest first within a priority
        return usable

    async def new_runs(self) -> bool:
        """Whether runs were created or deleted since the last resolve (one O(1) call): a run
        enqueued behind a big one is served within a second, not at the next full resolve."""
        if self.only_run:
            return False
        return await self.rq.call(self.store.count) != self._count

    def _vanish(self, run: str) -> None:
        """RUN is gone from Redis (deleted, or Redis restarted empty or was flushed): said once,
        not served, nothing of it acked; its shards stay in the spool until it is back."""
        del self.contexts[run]
        self.vanished[run] = ("gone from Redis (deleted, or Redis lost its data); its results stay in the "
                              "spool; re-create it with the same `producer enqueue` to ship them")
        log.error("run %s is %s", run, self.vanished[run])

    async def _preflight(self, ctx: RunContext) -> str | None:
        """What the engine cannot answer for this run, checked before any of its jobs is taken;
        None when it passes. A run that fails is not served by this consumer (its items are
        not failed one by one), and is checked again when its settings change."""
        try:  # first: no engine time for results this consumer cannot ship
            await asyncio.to_thread(probe_output, ctx.settings.output, ctx.run)
        except OutputProbeError as e:
            return str(e)
        max_tokens = ctx.settings.sampling.max_tokens
        if ctx.max_model_len is not None and max_tokens >= ctx.max_model_len:
            return (f"max_tokens {max_tokens} does not fit the model's context of {ctx.max_model_len} tokens "
                    f"(served by {self.endpoint}); fix the run with `producer enqueue ... --run {ctx.run} "
                    f"--max-tokens N --update-settings`")
        if ctx.settings.logprobs is not None and (failed := await self._probe_logprobs(ctx)) is not None:
            return failed  # first: a K above the engine's --max-logprobs in its own line
        for variant in ctx.settings.variants or (None,):  # every request shape the run sends
            body = preflight_body(ctx, variant)
            shape = "this run's shape" if variant is None else f"this run's variant {variant.name}"
            try:
                await asyncio.wait_for(accepts(self.client, body), timeout=min(self.request_timeout, PROBE_TIMEOUT))
            except PermanentError as e:
                return f"the engine refuses a request of {shape}: {e}"
            except Exception as e:  # noqa: BLE001 - a transient failure says nothing about the run
                log.warning("run %s: pre-flight request failed (%s); not conclusive, serving it", ctx.run, e)
        failed = await self._probe(ctx)
        if failed is None and ctx.settings.capture is not None:
            failed = await self._probe_capture(ctx, ctx.settings.capture)
        return failed

    async def _probe_logprobs(self, ctx: RunContext) -> str | None:
        """A --logprobs run: one request of its shape (top_logprobs K), before any other: a K above
        the engine's --max-logprobs is refused in one line, and so are tables that do not fit the
        probe's answer (consumer/capture/tables.py: judge)."""
        k = ctx.settings.logprobs or 0
        timeout = min(self.request_timeout, PROBE_TIMEOUT)
        try:
            turn = await asyncio.wait_for(
                self.gen.request(ctx, tables.PROBE_MESSAGES, None, need_ids=False,
                                 max_tokens=min(tables.PROBE_TOKENS, ctx.settings.sampling.max_tokens)),
                timeout=timeout)
        except PermanentError as e:
            return tables.refused(k, self.endpoint, e)
        except Exception as e:  # noqa: BLE001 - past its attempts: every item would fail the same way
            return probe_failed(e, self.gen.policy.max_attempts, timeout)
        failed = await asyncio.to_thread(tables.judge, k, self.endpoint, turn.logprobs_content, turn.token_ids)
        if failed is None:  # the values are the mode the run stores
            try:
                failed = await asyncio.wait_for(tables.probe_mode(
                    lambda body: self.gen.retrying(lambda: self.client.chat(body)),
                    ctx.shape.body(ctx.model, tables.PROBE_MESSAGES), k, self.endpoint), timeout=timeout)
            except Exception as e:  # noqa: BLE001 - past its attempts: every item would fail the same way
                return probe_failed(e, self.gen.policy.max_attempts, timeout)
        if failed is None:
            log.info("run %s: the engine returns top-%d log-probability tables", ctx.run, k)
        return failed

    async def _probe(self, ctx: RunContext) -> str | None:
        """One short request, to learn and record how this server returns thinking; a run that
        expects thinking from a server that returns none is reported loudly."""
        messages = [{"role": "user", "content": "What is 2 + 2? Think it through briefly."}]
        try:
            turn = await asyncio.wait_for(
                self.gen.request(ctx, messages, None, max_tokens=min(64, ctx.settings.sampling.max_tokens),
                                 need_ids=False),
                timeout=min(self.request_timeout, PROBE_TIMEOUT))
        except PermanentError as e:
            return f"the engine refuses a request of this run's shape: {e}"
        except Exception as e:  # noqa: BLE001 - past its attempts: every item would fail the same way
            return probe_failed(e, self.gen.policy.max_attempts, min(self.request_timeout, PROBE_TIMEOUT))
        if ctx.settings.token_ids and turn.token_ids is None:
            return (f"the run keeps token ids (--token-ids), but {self.endpoint} returned none to "
                    "return_token_ids (no prompt_token_ids, no choices[0].token_ids): serve it with a vLLM "
                    "that returns them (0.10.2 or later)")
        ctx.reasoning_probe = turn.reasoning_form
        raw = turn.raw_content
        ctx.think_opened = turn.reasoning_form == ReasoningForm.INLINE and "</think>" in raw and "<think>" not in raw
        log.info("run %s: the server returns thinking as %s", ctx.run, turn.reasoning_form)
        await self._say_speculation(ctx, turn.spec)
        if turn.reasoning_form == ReasoningForm.NONE and ctx.settings.expect_reasoning:
            msg = (f"run {ctx.run} expects thinking, but {self.endpoint} returned none in the probe "
                   "(no message.reasoning, no reasoning_content, no <think> block): is the model a thinking "
                   "model, and is thinking enabled in its chat template?")
            log.error("%s", msg)
            await self.rq.call(self.store.add_warning, ctx.run, self.worker, msg)
        return None

    async def _probe_capture(self, ctx: RunContext, capture: CaptureSettings) -> str | None:
        """A --capture run: one request that asks for its hidden states, whose answer must name a
        file this consumer reads, of the run's layer count, over the probe's ids (its file is
        removed). An engine that does not capture is refused here, not on every item; a model it
        cannot capture (MLA, a layer past its last), found on this node, before the probe."""
        root = self.model_roots.get(ctx.model)
        if root is not None and (refused := await asyncio.to_thread(check_model, root, capture.layers)) is not None:
            return refused
        timeout = min(self.request_timeout, PROBE_TIMEOUT)
        try:
            turn = await asyncio.wait_for(
                self.gen.request(ctx, capture_probe.MESSAGES, None, need_ids=False, capture=True,
                                 max_tokens=min(capture_probe.MAX_TOKENS, ctx.settings.sampling.max_tokens)),
                timeout=timeout)
        except PermanentError as e:
            return f"the engine refuses a request that asks for hidden states: {e}"
        except Exception as e:  # noqa: BLE001 - past its attempts: every item would fail the same way
            return probe_failed(e, self.gen.policy.max_attempts, timeout)
        ids = turn.token_ids
        expected = None if ids is None else ids["prompt"] + ids["completion"][:-1]
        failed = await asyncio.to_thread(capture_probe.judge, capture, self.endpoint, turn.capture_path, expected)
        if turn.capture_path is not None and self.capture_owner is not None:  # now the engine's folder is known
            await asyncio.to_thread(self._sweep, self.capture_owner, Path(turn.capture_path).parent)
        if failed is None:  # consumers of one run make one capture: an engine that differs is refused here
            try:
                facts = await asyncio.to_thread(self.facts.of, ctx.model)
                failed = await asyncio.to_thread(other_capture, ctx.settings.output, ctx.run, capture, ctx.model, facts)
            except (GenqueueError, OSError) as e:
                failed = f"the capture's manifest could not be checked against the run's output: {e}"
        if failed is None:
            log.info("run %s: the engine captures the run's %d layers (probe of %d tokens)", ctx.run,
                     len(capture.layers), len(expected or ()))
        return failed

    @staticmethod
    def _sweep(owner: CaptureOwner, folder: Path) -> None:
        """The capture files an earlier consumer on this spool left in the engine's FOLDER go."""
        if removed := owner.sweep(folder):
            log.warning("removed %d capture files an earlier consumer on this spool left in %s (it stopped with "
                        "requests in flight)", removed, folder)

    async def _say_speculation(self, ctx: RunContext, probe: SpecFigures | None) -> None:
        """One line: whether the engine speculates, and whether its answers carry their figures."""
        view = engine_view(await self.client.metrics() if probe is None else None)
        warn, line = speculation_note(probe, view.get("metrics", False), view.get("spec_decode", False) is True,
                                      capturing=ctx.settings.capture is not None)
        (log.warning if warn else log.info)("run %s: %s", ctx.run, line)

    def unfinished(self) -> dict[str, tuple[ExitCode, str]]:
        """The runs this consumer could not serve to the end, with the exit code each makes for a
        --burst consumer and why: refused (placement), failed pre-flight, paused, gone from Redis."""
        out = {run: (r.code, r.reason) for run, r in self._refused.items()}
        out.update({run: (ExitCode.PAUSED, f"paused: {why}") for run, why in self.paused.items()})
        out.update({run: (ExitCode.VANISHED, why) for run, why in self.vanished.items()})
        return out

    def snapshot(self) -> ServedSnapshot:
        refused = {run: r.reason for run, r in self._refused.items()}
        refused.update({run: f"paused: {why}" for run, why in self.paused.items()})
        refused.update(self.vanished)
        return ServedSnapshot(list(self.models), dict(self.model_lens), dict(self.contexts), refused)


def preflight_body(ctx: RunContext, variant: Variant | None) -> dict[str, object]:
    """The pre-flight request of one shape CTX's run sends (VARIANT: one of its variants, None:
    its own): the run's request (common/requests.py) on a one-line prompt."""
    shape = ctx.shape if variant is None else RequestShape.of(ctx.settings, variant)
    return shape.body(ctx.model, [{"role": "user", "content": "Say ok."}])


def probe_failed(e: BaseException, attempts: int, timeout: float) -> str:
    """Why a run is not served when the probe request failed past its attempts (a 5xx, resets,
    no answer in time): its items would all end as errors, so none is sent."""
    what = f"no answer within {format_duration(timeout)}" if isinstance(e, TimeoutError) else \
        f"{str(e) or type(e).__name__}; {attempts} attempts"
    return (f"the engine failed the probe request ({what}): every item would end as an error, so none is "
            "sent; fix the engine (its log says why)")


async def accepts(client: EndpointClient, body: dict[str, Any]) -> None:
    """Whether the engine accepts BODY, at the cost of one token: the request is streamed and
    closed at its first chunk (vLLM checks max_tokens against the context, and every sampling
    field, before it streams anything, and aborts a request whose client went away). Raises
    PermanentError for a 4xx that retrying cannot fix, TransientError otherwise."""
    streamed = {**body, "stream": True}
    try:
        async with client.session.post(f"{client.base_url}/chat/completions", json=streamed) as resp:
            if resp.status == 200:
                await resp.content.readline()
                return
            text = (await resp.read())[:1000].decode("utf-8", "replace")
            cls = classify_status(resp.status)
            raise cls(f"HTTP {resp.status}: {text}", status=resp.status)
    except (aiohttp.ClientError, OSError) as e:
        raise TransientError(f"{type(e).__name__}: {e}") from e

