"""The HTTP client for a vLLM OpenAI-compatible endpoint, on the hot path, and the gate that
pauses requests while the endpoint is down (I/O only: which status or exception is which
fault, and what to do about it, is faults.py's to say).

Raw aiohttp + orjson, not the `openai` package, which costs several times the CPU a completion
(docs/consumer.md, "Why raw aiohttp, not the openai client, on the hot path"); the tests still
use `openai` to act as a user's client of the stand-in.

Every request has a deadline (`request_timeout`) for the whole exchange (connect, send,
headers, body): a per-read timeout would accept a server trickling one byte a second forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Self

import aiohttp
import orjson

from genqueue.common import defaults
from genqueue.consumer.answer.completion import decode_body, snippet
from genqueue.consumer.answer.faults import (
    BadResponseError,
    DeadlineExceeded,
    EndpointDown,
    EndpointRefused,
    TransientError,
    classify_status,
)

log = logging.getLogger(__name__)


def _error_message(body: bytes) -> str:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:300].decode("utf-8", "replace")
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:1000]
        if "message" in data:
            return str(data["message"])[:1000]
    return body[:300].decode("utf-8", "replace")


#: Seconds an idle connection is kept: under vLLM's and uvicorn's keep-alive (5 s), so none is reused as it closes.
KEEPALIVE_SECONDS = 4.0


class EndpointClient:
    """One aiohttp session per process, with no connection cap below the concurrency."""

    def __init__(self, base_url: str, *, request_timeout: float = defaults.REQUEST_TIMEOUT, connect_timeout: float = 10.0,
                 api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.root = self.base_url[: -len("/v1")]
        self.request_timeout = request_timeout
        # No sock_read: the deadline in chat() bounds the whole request instead.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=None)
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        # limit=0: aiohttp's default of 100 connections would silently cap the concurrency.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True,
                                         keepalive_timeout=KEEPALIVE_SECONDS)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                              json_serialize=lambda o: orjson.dumps(o).decode())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EndpointClient used outside 'async with'")
        return self._session

    async def chat(self, body: dict[str, object]) -> dict[str, object]:
        """POST /v1/chat/completions with BODY (the request's JSON, model, messages and
        sampling fields); the body of a 200 as a JSON object (its fields are checked by
        completion.parse_completion). Raises PermanentError, EndpointDown, DeadlineExceeded,
        BadResponseError or TransientError (faults.py)."""
        return await self._post("chat/completions", body)

    async def completions(self, body: dict[str, object]) -> dict[str, object]:
        """POST /v1/completions with BODY (a capture pass's prefill: a prompt of token ids); as chat."""
        return await self._post("completions", body)

    async def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        try:
            async with asyncio.timeout(self.request_timeout):
                async with self.session.post(f"{self.base_url}/{path}", data=orjson.dumps(body),
                                             headers=self._headers) as resp:
                    status = resp.status
                    raw = await resp.read()
        except aiohttp.ClientPayloadError as e:  # the body was cut off at the transport level
            raise TransientError(f"response body cut off: {e}") from e
        except aiohttp.ClientConnectorError as e:  # the connect itself failed: refused, no route
            raise EndpointRefused(f"{type(e).__name__}: {e}".rstrip(": ")) from e
        except aiohttp.ClientConnectionError as e:  # reset, closed early, connect timeout
            raise EndpointDown(f"{type(e).__name__}: {e}".rstrip(": ")) from e
        except TimeoutError as e:  # before OSError, its base class: this is the deadline
            raise DeadlineExceeded(f"no complete response within {self.request_timeout:g} s") from e
        except OSError as e:
            raise EndpointDown(f"{type(e).__name__}: {e}".rstrip(": ")) from e
        except aiohttp.ClientError as e:
            raise TransientError(f"{type(e).__name__}: {e}".rstrip(": ")) from e
        if status != 200:
            raise classify_status(status)(f"HTTP {status}: {_error_message(raw)}", status=status)
        return decode_body(raw)

    async def _get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        async with self.session.get(f"{self.root}{path}", timeout=aiohttp.ClientTimeout(total=timeout),
                                    headers=self._headers) as resp:
            return resp.status, await resp.read()

    async def healthy(self) -> bool:
        """Whether /health answers 200 now."""
        try:
            status, _ = await self._get("/health")
            return status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def models(self) -> list[dict[str, Any]]:
        """The models the endpoint serves (/v1/models), with max_model_len where vLLM gives it.
        Raises EndpointDown when unreachable, TransientError/PermanentError for a non-200 and
        BadResponseError for a body that is not a model list."""
        try:
            status, body = await self._get("/v1/models", timeout=10.0)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise EndpointDown(f"cannot reach {self.base_url}/models: {type(e).__name__}: {e}") from e
        if status != 200:
            raise classify_status(status)(f"{self.base_url}/models answered HTTP {status}", status=status)
        data = decode_body(body).get("data", [])
        if not isinstance(data, list):
            raise BadResponseError(f"{self.base_url}/models: data is not a list", snippet=snippet(body))
        return [m for m in data if isinstance(m, dict)]

    async def metrics(self) -> str | None:
        """vLLM's Prometheus text from /metrics, or None when it has none."""
        try:
            status, body = await self._get("/metrics")
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        return body.decode("utf-8", "replace") if status == 200 else None


class RepeatedLog:
    """Logs a warning the first time, then folds its repeats within `window` seconds into one
    line ("… (repeated 57 times in the last 10 s)"), so a failing endpoint costs a few log
    lines per window instead of one per request."""

    def __init__(self, logger: logging.Logger, *, window: float = 10.0) -> None:
        self.logger = logger
        self.window = window
        self._since: dict[str, float] = {}
        self._repeats: dict[str, tuple[int, str, tuple[object, ...]]] = {}

    def warning(self, key: str, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """Log MSG % ARGS now, or count it if KEY was logged less than `window` seconds ago.
        exc_info: a traceback for the first line only."""
        now = time.monotonic()
        since = self._since.get(key)
        if since is None or now - since >= self.window:
            self.flush(key)
            self._since[key] = now
            self.logger.warning(msg, *args, exc_info=exc_info)
            return
        count = self._repeats.get(key, (0, msg, args))[0] + 1
        self._repeats[key] = (count, msg, args)
        if count == 1:  # report the repeats when the window ends, even if none follow
            try:
                asyncio.get_running_loop().call_later(since + self.window - now, self.flush, key)
            except RuntimeError:  # no loop: the next call after the window reports them
                pass

    def flush(self, key: str) -> None:
        """Log the repeats of KEY counted so far, if any."""
        entry = self._repeats.pop(key, None)
        if entry is None:
            return
        count, msg, args = entry
        self.logger.warning(msg + " (repeated %d times in the last %g s)", *args, count, self.window)


class Gate:
    """Open while the endpoint is up; requests wait on `up` while it is closed.

    Failed requests do not close it by themselves (a server that drops connections while
    /health answers 200 would otherwise flap it open and shut without spending attempts):
    they ask `check()`, and one shared /health check answers every request failing at the
    same time. Only a failed /health closes the gate; it then polls /health every
    probe_interval seconds and opens again when it answers.
    """

    def __init__(self, client: EndpointClient, *, probe_interval: float = 1.0) -> None:
        self.client = client
        self.up = asyncio.Event()
        self.up.set()
        self.probe_interval = probe_interval
        self.down_since: float | None = None
        self.outages = 0
        self.checks = 0  # /health requests sent
        self._checked_at = float("-inf")
        self._check: asyncio.Task[bool] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._log = RepeatedLog(log)

    @property
    def paused(self) -> bool:
        return not self.up.is_set()

    async def check(self, reason: str, *, fresh: bool = False) -> bool:
        """Is the endpoint up, after a request failed for REASON? False once the gate is closed.
        A healthy answer is trusted for probe_interval seconds, unless FRESH (the connection was
        refused: an endpoint that died since the last check must close the gate before the
        requests failing on it spend their attempts); a check in progress is shared."""
        if not self.up.is_set():
            return False
        if self._check is None:
            if not fresh and time.monotonic() - self._checked_at < self.probe_interval:
                return True
            self._check = asyncio.create_task(self._run_check(reason))
        # shield: one cancelled request must not cancel the check the others wait on
        return await asyncio.shield(self._check)

    async def _run_check(self, reason: str) -> bool:
        try:
            ok = await self._healthy()
        finally:
            self._check = None
        if not ok:
            self.mark_down(reason)
        return ok

    async def _healthy(self) -> bool:
        self.checks += 1
        try:
            ok = await self.client.healthy()
        except Exception as e:  # noqa: BLE001 - a broken check must not kill the gate's task
            self._log.warning("health", "/health check of %s failed: %s: %s", self.client.base_url,
                              type(e).__name__, e)
            ok = False
        self._checked_at = time.monotonic()
        return ok

    def mark_down(self, reason: str) -> None:
        """Close the gate now and poll /health until it answers."""
        if not self.up.is_set():
            return
        self.up.clear()
        self.down_since = time.monotonic()
        self.outages += 1
        self._log.warning("down", "endpoint %s is down (%s): pausing admission, leases kept alive",
                          self.client.base_url, reason)
        self._monitor = asyncio.create_task(self._wait_until_up())

    async def _wait_until_up(self) -> None:
        while not await self._healthy():
            await asyncio.sleep(self.probe_interval)
        down_for = time.monotonic() - (self.down_since or time.monotonic())
        self._log.warning("back", "endpoint %s is back after %.1f s: resuming", self.client.base_url, down_for)
        self.down_since = None
        self.up.set()

    async def aclose(self) -> None:
        """Stop the health polling (at shutdown)."""
        for task in (self._check, self._monitor):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
