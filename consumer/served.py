"""Which runs a consumer serves: the endpoint's models, the runs in Redis whose model it
serves, and one probe request per run that learns how the server returns thinking."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from genqueue.common.contracts import ConsumerInfo, ReasoningForm
from genqueue.common.errors import ModelNotServedError, UserError
from genqueue.common.runs import RunStore, run_key
from genqueue.consumer.client import EndpointClient, EndpointDown
from genqueue.consumer.generate import Generator, RunContext
from genqueue.consumer.rqthread import RqThread

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServedSnapshot:
    models: list[str]
    max_model_len: dict[str, int | None]
    runs: dict[str, RunContext]


class ServedRuns:
    """Finds and prepares the runs this consumer may serve."""

    def __init__(self, rq: RqThread, store: RunStore, client: EndpointClient, gen: Generator, *,
                 endpoint: str, only_run: str | None, identity: ConsumerInfo, worker: str,
                 request_timeout: float, endpoint_wait: float) -> None:
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
        self.models: list[str] = []
        self.model_lens: dict[str, int | None] = {}
        self.contexts: dict[str, RunContext] = {}
        self._skipped: set[str] = set()

    def names(self) -> list[str]:
        """The runs prepared so far (the sweeper's list)."""
        return list(self.contexts)

    async def wait_for_models(self, stopping: asyncio.Event) -> None:
        """Read /v1/models, waiting up to endpoint_wait for the endpoint to answer: vLLM takes
        minutes to load a large model, and a restarted node may start its consumer first."""
        deadline = time.monotonic() + self.endpoint_wait
        last_log = 0.0
        while True:
            try:
                models = await self.client.models()
                break
            except EndpointDown as e:
                now = time.monotonic()
                if now >= deadline or stopping.is_set():
                    raise UserError(f"endpoint {self.endpoint} is not reachable: {e}") from None
                if now - last_log >= 10.0:
                    log.warning("waiting for endpoint %s (%s)", self.endpoint, e)
                    last_log = now
                await asyncio.sleep(1.0)
        self.models = [m["id"] for m in models if isinstance(m.get("id"), str)]
        self.model_lens = {m["id"]: m.get("max_model_len") for m in models if isinstance(m.get("id"), str)}
        if not self.models:
            raise UserError(f"endpoint {self.endpoint} serves no model (/v1/models is empty)")
        log.info("endpoint %s serves %s", self.endpoint, ", ".join(self.models))

    async def resolve(self) -> list[str]:
        """The runs this consumer may serve now, oldest first, with contexts ready."""
        names = [self.only_run] if self.only_run else await self.rq.call(self.store.names)
        usable = []
        for name in names:
            if name in self.contexts:
                usable.append(name)
                continue
            if name in self._skipped:
                continue
            info = await self.rq.call(self.store.get, name)
            if info is None:
                if self.only_run:
                    raise UserError(f"no run named {name!r} in Redis")
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
            await self._probe(ctx)
            self.contexts[name] = ctx
            usable.append(name)
        return usable

    async def _probe(self, ctx: RunContext) -> None:
        """One request at start, to learn and record how this server returns thinking; a run
        that expects thinking from a server that returns none is reported loudly."""
        messages = [{"role": "user", "content": "What is 2 + 2? Think it through briefly."}]
        try:
            turn = await asyncio.wait_for(
                self.gen.request(ctx, messages, None, max_tokens=min(64, ctx.settings.sampling.max_tokens)),
                timeout=min(self.request_timeout, 120.0))
        except Exception as e:  # noqa: BLE001 - the probe never stops a consumer
            log.warning("run %s: probe request failed (%s); thinking form unknown", ctx.run, e)
            return
        ctx.reasoning_probe = turn.reasoning_form
        raw = turn.raw_content
        ctx.think_opened = turn.reasoning_form == ReasoningForm.INLINE and "</think>" in raw and "<think>" not in raw
        log.info("run %s: the server returns thinking as %s", ctx.run, turn.reasoning_form)
        if turn.reasoning_form == ReasoningForm.NONE and ctx.settings.expect_reasoning:
            msg = (f"run {ctx.run} expects thinking, but {self.endpoint} returned none in the probe "
                   "(no message.reasoning, no reasoning_content, no <think> block): is the model a thinking "
                   "model, and is thinking enabled in its chat template?")
            log.error("%s", msg)
            await self.rq.call(self.store.conn.hset, run_key(ctx.run, "warnings"), self.worker, msg)

    def snapshot(self) -> ServedSnapshot:
        return ServedSnapshot(list(self.models), dict(self.model_lens), dict(self.contexts))
