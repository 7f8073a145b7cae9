"""Claims and the enqueue transaction against a real Redis, including faults between the two."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.retry import Retry

from genqueue.common.contracts import Item
from genqueue.common.keepers.claims import Claims, claim_key
from genqueue.common.keepers.items import ItemTable
from genqueue.common.keepers.keeper import run_key
from genqueue.common.keepers.redisconn import connect
from genqueue.common.keepers.rqaccess import queue_for
from genqueue.common.keepers.runs import key_digest
from genqueue.producer.enqueue.jobwriter import JobWriter
from tests.conftest import ROOT, RedisServer
from tests.netproxy import accept_pairs

pytestmark = pytest.mark.integration

RUN = "jw"


def items(n: int, start: int = 0) -> list[Item]:
    return [{"key": f"{i:032x}", "index": i, "turn": None, "messages": [{"role": "user", "content": f"q{i}"}]}
            for i in range(start, start + n)]


def queued_keys(conn: redis.Redis) -> list[str]:
    q = queue_for(RUN, conn)
    return [it["key"] for job in q.jobs for it in job.args[0]]


def test_a_claim_sent_twice_gets_the_same_answer(conn: redis.Redis) -> None:
    store = Claims(conn)
    digests = [key_digest(it["key"]) for it in items(5)]
    assert store.claim(RUN, "a", digests[:3]) == [True] * 3
    # redis-py re-sends a script whose reply it lost: the items stay this claim's.
    assert store.claim(RUN, "a", digests) == [True] * 5
    assert store.claim(RUN, "b", digests) == [False] * 5
    assert 0 < conn.ttl(claim_key(RUN, "a")) <= 7 * 24 * 3600
    assert store.release(RUN, "a") == 5
    assert ItemTable(conn, RUN).counts().in_run == 0 and not conn.exists(claim_key(RUN, "a"))
    assert store.claim(RUN, "b", digests) == [True] * 5


def test_write_enqueues_only_what_it_won(conn: redis.Redis) -> None:
    Claims(conn).claim(RUN, "other", [key_digest(it["key"]) for it in items(3, start=2)])
    w = JobWriter(RUN, conn, batch_size=2)
    won, jobs = w.write(items(8))
    assert won == [True, True, False, False, False, True, True, True] and jobs == 3
    assert sorted(queued_keys(conn)) == sorted(it["key"] for it, ok in zip(items(8), won, strict=True) if ok)
    assert conn.keys(run_key(RUN, "claim:*")) == [run_key(RUN, "claim:other").encode()]


def fail_once(monkeypatch: pytest.MonkeyPatch, *, after_sending: bool) -> list[int]:
    """Make the next transaction raise a connection error, before or after Redis applied it."""
    real = Pipeline.execute
    calls: list[int] = []

    def execute(self: Pipeline, raise_on_error: bool = True) -> Any:
        calls.append(1)
        if len(calls) == 1 and self.explicit_transaction:
            if after_sending:
                real(self, raise_on_error)
            self.reset()
            raise redis.exceptions.ConnectionError("reply lost")
        return real(self, raise_on_error)

    monkeypatch.setattr(Pipeline, "execute", execute)
    return calls


@pytest.mark.parametrize("after_sending", [True, False])
def test_a_lost_transaction_reply_queues_each_job_once(conn: redis.Redis, monkeypatch: pytest.MonkeyPatch,
                                                       after_sending: bool) -> None:
    w = JobWriter(RUN, conn, batch_size=3)
    fail_once(monkeypatch, after_sending=after_sending)
    won, jobs = w.write(items(7))
    assert all(won) and jobs == 3
    q = queue_for(RUN, conn)
    assert q.count == 3 and len(set(q.job_ids)) == 3
    assert sorted(queued_keys(conn)) == [it["key"] for it in items(7)]
    assert conn.keys(run_key(RUN, "claim:*")) == []


def test_an_interrupt_between_claim_and_enqueue_gives_the_claim_back(conn: redis.Redis,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    w = JobWriter(RUN, conn, batch_size=2)

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(w, "_commit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        w.write(items(4))
    assert ItemTable(conn, RUN).counts().in_run == 0 and conn.keys(run_key(RUN, "claim:*")) == []
    monkeypatch.undo()
    assert JobWriter(RUN, conn, batch_size=2).write(items(4)) == ([True] * 4, 2)  # a new run of it queues them


def test_a_producer_killed_between_claim_and_enqueue_leaves_its_claim_named(redis_url: str,
                                                                           conn: redis.Redis) -> None:
    # The one window left: SIGKILL after the claim. The items are in the keys set and in no job,
    # and the claim set names exactly them for a reconcile.
    script = f"""
import os
from genqueue.common.keepers.redisconn import connect
from genqueue.producer.enqueue.jobwriter import JobWriter
from tests.producer.test_jobwriter import items
w = JobWriter({RUN!r}, connect({redis_url!r}), batch_size=2)
w._commit = lambda *a, **k: os._exit(9)
w.write(items(5))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False,
                          cwd=ROOT)
    assert proc.returncode == 9, proc.stderr
    [ckey] = conn.keys(run_key(RUN, "claim:*"))
    held = conn.smembers(ckey)
    assert held == {key_digest(it["key"]) for it in items(5)} == ItemTable(conn, RUN).digests()
    assert queue_for(RUN, conn).count == 0


class ReplyDroppingProxy:
    """A TCP relay to Redis that, when armed, lets the next EXEC through and then cuts the
    connection before its reply: the server applied the transaction, the client never heard."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.armed = threading.Event()
        self.cut = threading.Event()
        threading.Thread(target=accept_pairs, args=(self.server, ("127.0.0.1", upstream_port), self._relay),
                         daemon=True).start()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        mute = threading.Event()
        threading.Thread(target=self._up, args=(client, upstream, mute), daemon=True).start()
        threading.Thread(target=self._down, args=(upstream, client, mute), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, mute: threading.Event) -> None:
        tail = b""
        while data := _recv(client):
            seen, tail = tail + data, data[-16:]
            if self.armed.is_set() and b"EXEC\r\n" in seen:
                self.armed.clear()
                mute.set()
                upstream.sendall(data)
                time.sleep(0.3)  # Redis applies it; the reply is swallowed
                self.cut.set()
                for s in (client, upstream):
                    s.shutdown(socket.SHUT_RDWR)
                return
            upstream.sendall(data)

    @staticmethod
    def _down(upstream: socket.socket, client: socket.socket, mute: threading.Event) -> None:
        while data := _recv(upstream):
            if not mute.is_set():
                client.sendall(data)

    def close(self) -> None:
        self.server.close()


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(65536)
    except OSError:
        return b""


def test_redis_py_does_not_resend_a_transaction_whose_reply_it_lost(redis_server: RedisServer,
                                                                      conn: redis.Redis) -> None:
    # Through a real socket cut, with the client set to retry as redis-py can be: it re-sends a
    # transaction on a fresh connection after a connection error, even one the server applied.
    # Under WATCH it raises instead, and the writer sees its claim set gone: each job is
    # queued once.
    proxy = ReplyDroppingProxy(redis_server.port)
    try:
        client = connect(f"redis://127.0.0.1:{proxy.port}/0")
        client.set_retry(Retry(NoBackoff(), 3))
        w = JobWriter(RUN, client, batch_size=2)
        proxy.armed.set()
        won, jobs = w.write(items(6))
        assert proxy.cut.is_set() and all(won) and jobs == 3
        q = queue_for(RUN, conn)
        assert q.count == 3 and len(set(q.job_ids)) == 3
        assert conn.keys(run_key(RUN, "claim:*")) == []
    finally:
        proxy.close()


def test_a_claim_counts_a_repeated_digest_once_and_takes_big_slices(conn: redis.Redis) -> None:
    store = Claims(conn)
    d = [key_digest(it["key"]) for it in items(3)]
    assert store.claim(RUN, "a", [d[0], d[1], d[0], d[2]]) == [True, True, False, True]
    assert store.claim(RUN, "a", [d[0], d[1], d[0], d[2]]) == [True, True, False, True]  # sent again
    many = [key_digest(f"{i:032x}") for i in range(10, 20_010)]  # past Lua's unpack limit
    assert store.claim(RUN, "b", many) == [True] * 20_000 and ItemTable(conn, RUN).counts().in_run == 20_003
