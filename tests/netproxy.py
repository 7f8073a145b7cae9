"""A TCP proxy the tests control, to put a network fault between a client and a server.

Modes: `forward` (bytes pass); `blackhole` (a partition: connections stay open, nothing
passes either way, new connections are accepted and hang); after a blackhole, `forward`
again with `cut=True` resets the connections that lived through it (what a client sees when
the network heals after its peer gave up), or with `cut=False` leaves them open and silent
for ever (half-open connections: only the client's own timeouts can notice).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable


def _listener() -> socket.socket:
    """A listening socket on a free port of 127.0.0.1."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def accept_pairs(listener: socket.socket, target: tuple[str, int],
                 relay: Callable[[socket.socket, socket.socket], None]) -> None:
    """Accept on LISTENER until it is closed: each client is connected to TARGET and the pair
    handed to RELAY (which starts the threads that move its bytes)."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        relay(client, socket.create_connection(target))


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = _listener()
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket | None]] = []
        self._stale: set[int] = set()  # ids of pairs that lived through a blackhole and stay silent
        self._blackhole = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tcpproxy")
        self._thread.start()

    @property
    def url_host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    def blackhole(self) -> None:
        with self._lock:
            self._blackhole = True

    def forward(self, *, cut: bool = True) -> None:
        """Let bytes pass again. cut: reset every connection that lived through the blackhole;
        otherwise those stay open and silent (half-open)."""
        with self._lock:
            self._blackhole = False
            for pair in list(self._pairs):
                if cut:
                    self._close(pair)
                else:
                    self._stale.add(id(pair[0]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for pair in list(self._pairs):
                self._close(pair)
        self._listener.close()

    def _close(self, pair: tuple[socket.socket, socket.socket | None]) -> None:
        for s in pair:
            if s is not None:
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                except OSError:
                    pass
                s.close()
        if pair in self._pairs:
            self._pairs.remove(pair)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                live = {id(p[0]) for p in self._pairs}
                self._stale &= live
                passing = [] if self._blackhole else [p for p in self._pairs if id(p[0]) not in self._stale]
                socks: list[socket.socket] = [self._listener]
                for c, u in passing:
                    socks.append(c)
                    if u is not None:
                        socks.append(u)
            readable, _, _ = select.select(socks, [], [], 0.05)
            for s in readable:
                if s is self._listener:
                    client, _ = self._listener.accept()
                    upstream: socket.socket | None = None
                    with self._lock:
                        if not self._blackhole:
                            upstream = socket.create_connection(self.target)
                        self._pairs.append((client, upstream))
                    continue
                with self._lock:
                    pair = next((p for p in self._pairs if s in p), None)
                    if pair is None or self._blackhole:
                        continue
                    client, upstream = pair
                    if upstream is None:  # accepted during a blackhole: connect now
                        upstream = socket.create_connection(self.target)
                        idx = self._pairs.index(pair)
                        self._pairs[idx] = pair = (client, upstream)
                    other = upstream if s is client else client
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    if not data:
                        self._close(pair)
                        continue
                    try:
                        other.sendall(data)
                    except OSError:
                        self._close(pair)


class LatencyProxy:
    """A TCP proxy that holds back each reply by DELAY seconds: the first bytes the server sends
    after the client sent some wait that long (a request's round trip to a store far away; the
    benchmarks' slow S3). A thread a direction a connection, so connections wait side by side,
    as they would on a real network."""

    def __init__(self, target_port: int, delay: float, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.delay = delay
        self._listener = _listener()
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=accept_pairs, args=(self._listener, self.target, self._relay), daemon=True,
                         name="latencyproxy").start()

    @property
    def url_host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._listener.close()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        asked = threading.Event()
        threading.Thread(target=self._pump, args=(client, upstream, asked, False), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, asked, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, asked: threading.Event, reply: bool) -> None:
        try:
            while data := src.recv(65536):
                if not reply:
                    asked.set()
                elif asked.is_set():
                    asked.clear()
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
