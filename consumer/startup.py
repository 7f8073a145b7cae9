"""Starting a consumer's work on a run: the endpoint's models, the runs it may serve, and one
probe request per run that learns how the server returns thinking. A mixin of Consumer."""

from __future__ import annotations

import asyncio
import logging
import time
from genqueue.common.errors import ModelNotServedError, UserError
from genqueue.common.runs import run_key
from genqueue.consumer.client import EndpointClient, EndpointDown
from genqueue.consumer.generate import RunContext

log = logging.getLogger("genqueue.consumer.worker")


class StartupMixin:
    """Consumer's start-up steps (self is a Consumer)."""

    async def _resolve_runs(self) -> list[str]:
        """The runs this consumer may serve now, oldest first, with contexts ready."""
        names = [self.cfg.run] if self.cfg.run else await self._rq(self.store.names)
        usable = []
        for name in names:
            if name in self.contexts:
                usable.append(name)
                continue
            info = await self._rq(self.store.get, name)
            if info is None:
                if self.cfg.run:
                    raise UserError(f"no run named {name!r} in Redis")
                continue
            model = info.settings.model
            if model is None:
                model = self.served_models[0]
            elif model not in self.served_models:
                msg = (f"run {name!r} asks for model {model!r}, but {self.cfg.endpoint} serves "
                       f"{', '.join(self.served_models) or 'nothing'}")
                if self.cfg.run:
                    raise ModelNotServedError(msg)
                log.info("skipping %s", msg)
                continue
            ctx = RunContext(name, info.settings, model, self._consumer_info(), max_model_len=self.model_lens.get(model))
            await self._probe(ctx)
            self.contexts[name] = ctx
            usable.append(name)
        return usable

    async def _probe_models(self, client: EndpointClient) -> None:
        # vLLM takes minutes to load a large model, and a restarted node may start its
        # consumer first: wait for the endpoint (up to --endpoint-wait) instead of failing.
        deadline = time.monotonic() + self.cfg.endpoint_wait
        last_log = 0.0
        while True:
            try:
                models = await client.models()
                break
            except EndpointDown as e:
                now = time.monotonic()
                if now >= deadline or self.stopping:
                    raise UserError(f"endpoint {self.cfg.endpoint} is not reachable: {e}") from None
                if now - last_log >= 10.0:
                    log.warning("waiting for endpoint %s (%s)", self.cfg.endpoint, e)
                    last_log = now
                await asyncio.sleep(1.0)
        self.served_models = [m["id"] for m in models if "id" in m]
        self.model_lens = {m["id"]: m.get("max_model_len") for m in models if "id" in m}
        if not self.served_models:
            raise UserError(f"endpoint {self.cfg.endpoint} serves no model (/v1/models is empty)")
        log.info("endpoint %s serves %s", self.cfg.endpoint, ", ".join(self.served_models))

    async def _probe(self, ctx: RunContext) -> None:
        """One request at start, to learn and record how this server returns thinking; a run
        that expects thinking from a server that returns none is reported loudly."""
        assert self._gen is not None
        messages = [{"role": "user", "content": "What is 2 + 2? Think it through briefly."}]
        try:
            turn = await asyncio.wait_for(
                self._gen.request(ctx, messages, None, max_tokens=min(64, ctx.settings.sampling.max_tokens)),
                timeout=min(self.cfg.request_timeout, 120.0))
        except Exception as e:  # noqa: BLE001 - the probe never stops a consumer
            log.warning("run %s: probe request failed (%s); thinking form unknown", ctx.run, e)
            return
        ctx.reasoning_probe = turn.reasoning_form
        raw = turn.raw_content
        ctx.think_opened = turn.reasoning_form == "inline" and "</think>" in raw and "<think>" not in raw
        log.info("run %s: the server returns thinking as %s", ctx.run, turn.reasoning_form)
        if turn.reasoning_form == "none" and ctx.settings.expect_reasoning:
            msg = (f"run {ctx.run} expects thinking, but {self.cfg.endpoint} returned none in the probe "
                   "(no message.reasoning, no reasoning_content, no <think> block): is the model a thinking "
                   "model, and is thinking enabled in its chat template?")
            log.error("%s", msg)
            await self._rq(self.conn.hset, run_key(ctx.run, "warnings"), self.worker.name, msg)
