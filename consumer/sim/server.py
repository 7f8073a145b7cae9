"""A stand-in for vLLM's OpenAI-compatible chat server, for tests, demos and benchmarks.

It models continuous batching (``slots`` requests run at once, the rest wait FIFO; a running
request finishes after n_tokens * step_time seconds), returns vLLM-shaped responses
(``message.reasoning``, ``finish_reason``, ``usage``, OpenAI error JSON), exposes the
``/metrics`` gauges a client steers by, and injects failures (500s, hangs, 503s, refused
connections). The real target stays vLLM; this only keeps the client honest and measurable.
"""

from __future__ import annotations

import asyncio
import errno
import signal
import sys
from dataclasses import asdict
from typing import Any, Self

import click
from aiohttp import web

from genqueue.consumer.sim.app import build_app
from genqueue.consumer.sim.capture import parse_layers
from genqueue.consumer.sim.engine import REASONING_MODES, SIM_ENGINE, SimConfig, SimEngine
from genqueue.consumer.sim.spec import SpecMetrics, SpecRule, parse_rule
from genqueue.consumer.sim.text import TOOL_CALL_MODES, make_output, prompt_tokens, sample_length  # noqa: F401 (public API)

__all__ = ["SimConfig", "SimEngine", "SimServer", "build_app", "sample_length", "simulate_command"]


class SimServer:
    """Runs the stand-in on host:port inside the current asyncio loop (port 0: a free one)."""

    def __init__(self, config: SimConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.config = config if config is not None else SimConfig()
        self.host = host
        self.port = port
        self.app = build_app(self.config)
        self.engine = self.app[SIM_ENGINE]
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._up_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """Base URL for OpenAI clients, e.g. http://127.0.0.1:8000/v1"""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def stats(self) -> dict[str, Any]:
        """A snapshot: requests, completed, errors, rejected, unavailable, hung, cancelled,
        tokens, prompt_tokens, max_running, max_waiting, busy_slot_seconds, running, waiting."""
        return self.engine.snapshot()

    async def start(self) -> None:
        # handler_cancellation: a client that gives up cancels its handler (frees its slot,
        # ends a hang), as vLLM aborts a request whose connection drops.
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        await self._listen()
        if self._listener is None:
            raise RuntimeError("the stand-in's listener did not start")
        self.port = self._listener.sockets[0].getsockname()[1]

    async def _listen(self) -> None:
        assert self._runner is not None and self._runner.server is not None
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            self._runner.server, self.host, self.port, reuse_address=True, backlog=4096)

    def _drop_connections(self) -> None:
        if self._runner is not None and self._runner.server is not None:
            for conn in self._runner.server.connections:
                conn.force_close()

    async def go_down(self, seconds: float | None, refuse: bool = True) -> asyncio.Task[None]:
        """Go down now; come back up after `seconds` (None: only on come_up()).

        refuse=True acts like a crashed server: the listening socket closes (connections are
        refused) and open connections drop, in-flight requests included. refuse=False answers
        503 meanwhile. Returns once down; the returned task ends when the server is back up.
        """
        if self._up_task is not None and not self._up_task.done():
            self._up_task.cancel()
        if refuse:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            self._drop_connections()
        else:
            self.config.down = True
        self._up_task = asyncio.get_running_loop().create_task(self._come_up_after(seconds))
        # let the closes reach clients (those in this loop then see refusals, not stale sockets)
        await asyncio.sleep(0.01 if refuse else 0)
        return self._up_task

    async def _come_up_after(self, seconds: float | None) -> None:
        if seconds is None:
            await asyncio.get_running_loop().create_future()
            return
        await asyncio.sleep(seconds)
        await self._restore()

    async def _restore(self) -> None:
        self.config.down = False
        if self._listener is None and self._runner is not None:
            await self._listen()

    async def come_up(self) -> None:
        """End an outage started by go_down now."""
        if self._up_task is not None and not self._up_task.done():
            self._up_task.cancel()
        await self._restore()

    async def stop(self) -> None:
        if self._up_task is not None and not self._up_task.done():
            self._up_task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._drop_connections()
        if self._runner is not None:
            await asyncio.sleep(0)
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class SpecRuleParam(click.ParamType[SpecRule]):
    """A --spec-acceptance-for rule (sim/spec.py), refused in one line when malformed."""

    name = "rule"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> SpecRule:
        if isinstance(value, SpecRule):
            return value
        try:
            return parse_rule(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


class CannotListenError(Exception):
    """The stand-in cannot listen where it was asked: the command says so in one line, exit 2."""


def listen_refusal(e: OSError, host: str, port: int) -> str:
    """Why HOST:PORT cannot be listened on, and what to give instead, in one line."""
    if e.errno == errno.EADDRINUSE:
        return f"cannot listen on {host}:{port}: the port is taken by another process; give another --port"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}:{port}: {host} is not an address of this host; give another --host"
    return f"cannot listen on {host}:{port}: {e.strerror or e}"


async def _serve_forever(config: SimConfig, host: str, port: int) -> None:
    server = SimServer(config, host=host, port=port)
    try:
        await server.start()
    except OSError as e:
        await server.stop()
        raise CannotListenError(listen_refusal(e, host, port)) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    settings = " ".join(f"{k}={v}" for k, v in asdict(config).items() if k != "down")
    click.echo(f"simulate: stand-in vLLM (not vLLM) listening on http://{host}:{server.port}/v1 "
               f"{settings}", err=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


@click.command("simulate", help=(
    "Serve a stand-in for vLLM for tests, demos and benchmarks; the real target stays vLLM. "
    "Speaks the OpenAI chat API (non-streaming), models continuous batching "
    "(--slots running at once, the rest wait FIFO; a request takes tokens x --step-time), "
    "exposes vLLM's /metrics gauges and counters, optionally models a KV cache, a prefix cache and "
    "speculative decoding, and can inject failures. Runs until SIGINT/SIGTERM."))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--model", default=SimConfig.model, show_default=True, help="Served model name.")
@click.option("--slots", default=SimConfig.slots, show_default=True, type=click.IntRange(1),
              help="Requests running at once (vLLM's max_num_seqs).")
@click.option("--step-time", default=SimConfig.step_time, show_default=True,
              type=click.FloatRange(0), help="Seconds per decode step.")
@click.option("--mean-tokens", default=SimConfig.mean_tokens, show_default=True,
              type=click.IntRange(1), help="Mean output length (lognormal, heavy-tailed).")
@click.option("--max-model-len", default=SimConfig.max_model_len, show_default=True,
              type=click.IntRange(16))
@click.option("--seed", default=SimConfig.seed, show_default=True, type=int)
@click.option("--reasoning", default=SimConfig.reasoning, show_default=True,
              type=click.Choice(REASONING_MODES),
              help="Where thinking goes: message.reasoning, inline <think> in content, nowhere, "
                   "or message.reasoning_content (older vLLM).")
@click.option("--think-fraction", default=SimConfig.think_fraction, show_default=True,
              type=click.FloatRange(0, 1), help="Fraction of output tokens that are thinking.")
@click.option("--error-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Fraction of requests answered with --error-status.")
@click.option("--error-status", default=SimConfig.error_status, show_default=True, type=click.IntRange(400, 599),
              help="The HTTP status of an injected failure (500, 502, 503, ...).")
@click.option("--error-after", default=SimConfig.error_after, show_default=True, type=click.IntRange(0),
              help="Answer the first N chat requests normally, then inject failures (an engine that breaks mid-run).")
@click.option("--hang-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Fraction of requests never answered.")
@click.option("--length-hints", is_flag=True,
              help='A "[len=N]" in the last user message sets that request\'s mean output length (benchmarks).')
@click.option("--tool-calls", default=SimConfig.tool_calls, show_default=True, type=click.Choice(TOOL_CALL_MODES),
              help='When a request has tools, answer with the calls a "[call=NAME:JSON]" in the last user '
                   "message names (recorded), the same names with other arguments (diverge), or text (none).")
@click.option("--record-requests", default="", metavar="FILE",
              help="Append each chat request's body to FILE, one JSON line each (for tests).")
@click.option("--max-num-seqs", "max_num_seqs", type=click.IntRange(1), default=None,
              help="vLLM's name for --slots (either sets it).")
@click.option("--kv-cache-tokens", default=SimConfig.kv_cache_tokens, show_default=True, type=click.IntRange(0),
              help="KV cache size in tokens (0: none); running requests' context fills it, past it they are preempted.")
@click.option("--block-size", default=SimConfig.block_size, show_default=True, type=click.IntRange(1),
              help="Tokens per KV block (and per prefix-cache block).")
@click.option("--prefix-cache-blocks", default=SimConfig.prefix_cache_blocks, show_default=True,
              type=click.IntRange(0), help="Prefix cache: an LRU of this many prompt blocks (0: off).")
@click.option("--prefill-time", default=SimConfig.prefill_time, show_default=True, type=click.FloatRange(0),
              help="Seconds per prompt token not found in the prefix cache, before the first output token.")
@click.option("--spec-tokens", default=SimConfig.spec_tokens, show_default=True, type=click.IntRange(0),
              help="Speculative decoding: draft tokens per step (0: off).")
@click.option("--spec-acceptance", default=SimConfig.spec_acceptance, show_default=True,
              type=click.FloatRange(0, 1),
              help="Probability a draft token is accepted (given the ones before it were), drawn per request.")
@click.option("--spec-acceptance-for", "spec_acceptance_for", multiple=True, type=SpecRuleParam(),
              metavar="text=SUBSTR:P|tokens>=N:P",
              help="Requests whose messages contain SUBSTR, or answers of at least N tokens, accept drafts with "
                   "probability P instead (a planted weak category). Repeatable; the first that matches applies.")
@click.option("--compute-knee", default=SimConfig.compute_knee, show_default=True, type=click.IntRange(0),
              metavar="TOKENS",
              help="Tokens a decode step computes past which it turns compute-bound (0: never): a step of B "
                   "requests with K drafts each computes B x (1 + K) tokens and takes --step-time x that / TOKENS "
                   "past it, so speculation at a high batch costs what it yields.")
@click.option("--draft-cost", default=SimConfig.draft_cost, show_default=True, type=click.FloatRange(0),
              help="Each draft token's cost, as a fraction of --step-time (a drafter's own forward passes).")
@click.option("--per-request-spec-decode-metrics", "per_request_spec_decode_metrics",
              default=SimConfig.per_request_spec_decode_metrics.value, show_default=True,
              type=click.Choice([m.value for m in SpecMetrics]),
              help="As vLLM's flag: answers carry metrics.speculative_decoding (summary; detailed adds the "
                   "per-step arrays); none: only /metrics counts speculation.")
@click.option("--token-ids/--no-token-ids", default=SimConfig.token_ids, show_default=True,
              help="Honour return_token_ids (prompt_token_ids, choices[].token_ids), as vLLM 0.10.2+ does; "
                   "--no-token-ids ignores it, as older engines do.")
@click.option("--capture-dir", default=SimConfig.capture_dir, metavar="DIR",
              help="Capture hidden states as vLLM's extract_hidden_states does: a request with kv_transfer_params "
                   "gets a safetensors file in DIR (hidden_states bf16 [tokens, layers, hidden], token_ids), named "
                   "in the response's kv_transfer_params.hidden_states_path. Off when not given.")
@click.option("--capture-layers", default=",".join(map(str, SimConfig.capture_layers)), show_default=True,
              metavar="IDS", help="The layer ids captured (vLLM's eagle_aux_hidden_state_layer_ids), e.g. 2,4.")
@click.option("--hidden-size", default=SimConfig.hidden_size, show_default=True, type=click.IntRange(1),
              help="The width of a captured layer.")
@click.option("--capture-wrong-ids", default=SimConfig.capture_wrong_ids, show_default=True,
              type=click.FloatRange(0, 1),
              help="The share of captures saved with one token id wrong (a misaligned capture, for tests).")
@click.option("--max-logprobs", default=SimConfig.max_logprobs, show_default=True, type=click.IntRange(0),
              help="The most top_logprobs a request may ask for (vLLM's --max-logprobs); more is a 400.")
@click.option("--logprobs-garbled", default=SimConfig.logprobs_garbled, show_default=True,
              type=click.FloatRange(0, 1),
              help="The share of answers whose log-probability tables name a generated token by another id (a "
                   "broken engine, for tests).")
@click.option("--logprobs-processed", is_flag=True,
              help="Answer log-probabilities as vLLM's --logprobs-mode processed_logprobs does (over the "
                   "request's temperature), not as its default raw_logprobs.")
def simulate_command(host: str, port: int, max_num_seqs: int | None, **settings: Any) -> None:
    try:
        settings["capture_layers"] = parse_layers(settings["capture_layers"])
    except ValueError as e:
        click.echo(f"error: --capture-layers: {e}", err=True)
        sys.exit(2)
    if max_num_seqs is not None:
        settings["slots"] = max_num_seqs
    settings["spec_acceptance_for"] = tuple(settings["spec_acceptance_for"])
    settings["per_request_spec_decode_metrics"] = SpecMetrics(settings["per_request_spec_decode_metrics"])
    config = SimConfig(**settings)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        run = asyncio.run
    else:
        run = uvloop.run
    try:
        run(_serve_forever(config, host, port))
    except CannotListenError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
