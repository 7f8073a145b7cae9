"""A misbehaving HTTP endpoint for the client's tests: a real server on 127.0.0.1 written on
asyncio streams, so that it can do what a well-behaved framework will not (close before the
headers, cut a body short, trickle a response a byte at a time, garble JSON).

Each route is a handler `async (request, writer) -> None` that writes the whole response
itself; every response says `Connection: close`, so one connection carries one request and
the counts below are the requests the client really sent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Self

import orjson

CHAT = "/v1/chat/completions"
HEALTH = "/health"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: bytes
    n: int  # 1-based: the how-many-th request to this path


Handler = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]

REASONS = {200: "OK", 404: "Not Found", 500: "Internal Server Error", 503: "Service Unavailable"}


def head(status: int, length: int, content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()


def completion(content: str = "ok", finish: str = "stop") -> dict[str, Any]:
    """A well-formed vLLM chat completion."""
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "reasoning": None},
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


def send(status: int, body: bytes, *, content_length: int | None = None) -> Handler:
    """Answer STATUS with BODY; content_length: announce another length than BODY's."""

    async def handler(req: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head(status, len(body) if content_length is None else content_length) + body)
        await writer.drain()

    return handler


def send_json(obj: Any, status: int = 200) -> Handler:
    return send(status, orjson.dumps(obj))


async def drop(req: Request, writer: asyncio.StreamWriter) -> None:
    """Close the connection before sending any header."""


def trickle(raw: bytes, interval: float) -> Handler:
    """Send RAW (status line, headers and body) one byte every INTERVAL seconds."""

    async def handler(req: Request, writer: asyncio.StreamWriter) -> None:
        for i in range(len(raw)):
            if writer.is_closing():
                return
            writer.write(raw[i:i + 1])
            await writer.drain()
            await asyncio.sleep(interval)

    return handler


def sequence(*handlers: Handler) -> Handler:
    """The n-th request gets the n-th handler; the last one answers every later request."""

    async def handler(req: Request, writer: asyncio.StreamWriter) -> None:
        await handlers[min(req.n, len(handlers)) - 1](req, writer)

    return handler


def when(flag: Callable[[], bool], then: Handler, otherwise: Handler) -> Handler:
    """THEN while FLAG() is true, OTHERWISE after."""

    async def handler(req: Request, writer: asyncio.StreamWriter) -> None:
        await (then if flag() else otherwise)(req, writer)

    return handler


def delayed(seconds: float, inner: Handler) -> Handler:
    async def handler(req: Request, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(seconds)
        await inner(req, writer)

    return handler


OK_HEALTH = send(200, b"")
NOT_FOUND = send(404, b'{"error": {"message": "no such route"}}')


class HostileServer:
    """Routes CHAT and HEALTH to the given handlers; counts requests per path. `refuse()` stops
    listening (connections refused, as a dead vLLM), `listen()` starts again on the same port."""

    def __init__(self, chat: Handler, health: Handler = OK_HEALTH) -> None:
        self.routes: dict[str, Handler] = {CHAT: chat, HEALTH: health}
        self.counts: collections.Counter[str] = collections.Counter()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def refuse(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Self:
        await self.listen()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._conns):
            task.cancel()
        await self.refuse()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.counts[path] += 1
            await self.routes.get(path, NOT_FOUND)(Request(method, path, body, self.counts[path]), writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()
