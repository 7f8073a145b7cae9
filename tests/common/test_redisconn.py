"""Every Redis connection carries genqueue's timeouts, health checks and keepalive."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from genqueue.common import defaults
from genqueue.common.errors import RedisUnavailableError
from genqueue.common.keepers import redisconn
from genqueue.common.keepers.redisconn import async_check, async_connect, connect, keepalive_options


def expected_kwargs() -> dict[str, Any]:
    return {
        "socket_timeout": defaults.REDIS_SOCKET_TIMEOUT,
        "socket_connect_timeout": defaults.REDIS_CONNECT_TIMEOUT,
        "health_check_interval": defaults.REDIS_HEALTH_CHECK_INTERVAL,
        "socket_keepalive": True,
        "socket_keepalive_options": keepalive_options(),
    }


def test_sync_and_async_clients_get_the_same_options() -> None:
    for client in (connect("redis://127.0.0.1:1/0", check=False), async_connect("redis://127.0.0.1:1/0")):
        kw = client.connection_pool.connection_kwargs
        assert {k: kw.get(k) for k in expected_kwargs()} == expected_kwargs()
        assert kw["retry"].get_retries() == redisconn.RETRIES == 0
        made: Any = client.connection_pool.make_connection()
        assert made.retry.get_retries() == 0  # a command is sent once


def test_keepalive_is_set_on_linux() -> None:
    if not hasattr(socket, "TCP_KEEPIDLE"):
        pytest.skip("not a Linux socket API")
    assert keepalive_options() == {
        socket.TCP_KEEPIDLE: redisconn.KEEPALIVE_IDLE,
        socket.TCP_KEEPINTVL: redisconn.KEEPALIVE_INTERVAL,
        socket.TCP_KEEPCNT: redisconn.KEEPALIVE_COUNT,
    }


def test_url_options_win_for_one_deployment() -> None:
    kw = connect("redis://127.0.0.1:1/0?socket_timeout=30", check=False).connection_pool.connection_kwargs
    assert kw["socket_timeout"] == 30 and kw["socket_connect_timeout"] == defaults.REDIS_CONNECT_TIMEOUT


def test_invalid_url_is_a_user_error() -> None:
    with pytest.raises(RedisUnavailableError, match="invalid Redis URL"):
        connect("http://:pw@h/0")


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers: a hung or partitioned Redis."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    for s in held:
        s.close()
    srv.close()


@pytest.mark.integration
def test_a_server_that_never_answers_is_an_error_not_a_hang(silent_server: int) -> None:
    started = time.monotonic()
    with pytest.raises(RedisUnavailableError, match="cannot reach Redis"):
        connect(f"redis://:pw@127.0.0.1:{silent_server}/0?socket_timeout=0.2")
    # One read of 0.2 s (no client retries): without a socket timeout it would wait for ever.
    assert time.monotonic() - started < 5


@pytest.mark.integration
def test_async_client_talks_to_a_real_redis(redis_url: str) -> None:
    async def go() -> object:
        conn = async_connect(redis_url)
        try:
            await async_check(conn, redis_url)
            await conn.set("genqueue:test:async", b"ok")
            return await conn.get("genqueue:test:async")
        finally:
            await conn.aclose()

    assert asyncio.run(go()) == b"ok"


@pytest.mark.integration
def test_unix_socket_urls_work(tmp_path: Path) -> None:
    # TCP keepalive options on a unix socket made redis-py raise TypeError at the first command.
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    path = tmp_path / "redis.sock"
    proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", str(path), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if path.exists():
                break
            time.sleep(0.025)
        conn = connect(f"unix://{path}?db=0")
        assert conn.set("k", b"v") and conn.get("k") == b"v"
        assert "socket_keepalive" not in conn.connection_pool.connection_kwargs
    finally:
        proc.terminate()
        proc.wait(10)


def test_redis_errors_do_not_show_the_password(silent_server: int) -> None:
    with pytest.raises(RedisUnavailableError) as info:
        connect(f"redis://:hunter2@127.0.0.1:{silent_server}/0?socket_timeout=0.1")
    assert "hunter2" not in str(info.value) and "***@127.0.0.1" in str(info.value)
    with pytest.raises(redis.exceptions.RedisError):
        connect(f"redis://127.0.0.1:{silent_server}/0?socket_timeout=0.1", check=False).ping()


def test_waiting_for_redis_says_how_long_it_waited_and_will_wait():
    from genqueue.common.errors import RedisUnavailableError
    from genqueue.common.keepers.redisconn import wait_for
    from tests.conftest import free_port

    said: list[str] = []
    with pytest.raises(RedisUnavailableError):
        wait_for(f"redis://127.0.0.1:{free_port()}/0", 1.0, say=said.append)
    assert said and "waited 0m 00s, waiting 0m 01s more (--endpoint-wait 0m 01s)" in said[0], said


def test_the_wait_line_joins_the_error_without_a_doubled_stop():
    """redis-py's "Connection refused." ended the clause: the line read "refused.; waited"."""
    from genqueue.common.keepers.redisconn import wait_for
    from tests.conftest import free_port

    said: list[str] = []
    with pytest.raises(RedisUnavailableError):
        wait_for(f"redis://127.0.0.1:{free_port()}/0", 1.0, say=said.append)
    assert said and "Connection refused; waited 0m 00s" in said[0] and ".;" not in said[0], said
