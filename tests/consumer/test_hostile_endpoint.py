"""The generation path against a real HTTP server that misbehaves (tests/consumer/hostile.py):
every item ends in a record of the right class (or a success), never an exception, and a
misbehaving server gets a bounded number of requests and the log a bounded number of lines."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from genqueue.common.contracts import ErrorClass, Item, Mode, Outcome
from genqueue.common.records import ErrorInfo, ErrorRecord, ResultRecord, is_error
from genqueue.common.settings import RunSettings, Sampling
from genqueue.consumer.answer.client import EndpointClient, Gate, RepeatedLog
from genqueue.consumer.answer.generate import Generator, RunContext
from tests.consumer.hostile import (
    CHAT,
    HEALTH,
    OK_HEALTH,
    Handler,
    HostileServer,
    completion,
    delayed,
    drop,
    head,
    send,
    send_json,
    sequence,
    trickle,
    when,
)

pytestmark = pytest.mark.timeout(60)

DEADLINE = 1.0


def ctx(mode: Mode = Mode.LAST) -> RunContext:
    return RunContext("r", RunSettings(sampling=Sampling(max_tokens=16), multi_turn=mode), "m", {"host": "t"})


def item(i: int) -> Item:
    return {"key": f"{i:032x}", "index": i, "turn": 0, "messages": [{"role": "user", "content": f"q{i}"}]}


@dataclass
class Outcomes:
    records: list[ResultRecord | ErrorRecord]
    gen: Generator
    gate: Gate
    elapsed: float


async def answer_all(server: HostileServer, n: int = 1, *, max_attempts: int = 3, probe_interval: float = 0.05,
                     mode: Mode = Mode.LAST, during: Any = None) -> Outcomes:
    """Answer N items concurrently through a Generator against SERVER (already listening)."""
    async with EndpointClient(server.url, request_timeout=DEADLINE) as client:
        gate = Gate(client, probe_interval=probe_interval)
        gen = Generator(client, gate, max_attempts=max_attempts, backoff_base=0.01)
        t0 = time.monotonic()
        tasks = [asyncio.create_task(gen.answer(ctx(mode), item(i))) for i in range(n)]
        if during is not None:
            await during
        records = [await t for t in tasks]
        elapsed = time.monotonic() - t0
        await gate.aclose()
    return Outcomes(records, gen, gate, elapsed)


def go(chat: Handler, n: int = 1, *, health: Handler = OK_HEALTH, **kw: Any) -> tuple[Outcomes, HostileServer]:
    async def main() -> tuple[Outcomes, HostileServer]:
        async with HostileServer(chat, health) as server:
            return await answer_all(server, n, **kw), server

    return asyncio.run(main())


def error_of(rec: ResultRecord | ErrorRecord) -> ErrorInfo:
    assert is_error(rec), rec
    return rec["error"]


GOOD = completion("fine")
CUT = orjson.dumps(GOOD)[:37]

BAD_200: list[tuple[str, Handler, str]] = [
    ("empty choices", send_json({"choices": []}), "choices is an empty list"),
    ("json list body", send_json([GOOD]), "body is a list, not an object"),
    ("null choices", send_json({**GOOD, "choices": None}), "choices is null"),
    ("numeric content", send_json(completion() | {"choices": [{"message": {"content": 123},
                                                               "finish_reason": "stop"}]}),
     "message.content is a number"),
    ("unknown finish_reason", send_json(completion(finish="eos_token")), "unknown finish_reason 'eos_token'"),
    ("non-JSON 200", send(200, b"<html><body>upstream hiccup</body></html>"), "body is not JSON"),
    ("body cut mid-JSON", send(200, CUT), "body is not JSON"),
    ("empty body", send(200, b""), "empty body"),
]


@pytest.mark.parametrize(("chat", "reason"), [(h, r) for _, h, r in BAD_200], ids=[n for n, _, _ in BAD_200])
def test_a_200_that_is_not_a_completion_is_retried_then_recorded_as_bad_response(chat: Handler, reason: str) -> None:
    out, server = go(chat, max_attempts=3)
    err = error_of(out.records[0])
    assert err["class"] == ErrorClass.BAD_RESPONSE and err["type"] == "BadResponseError"
    assert reason in err["message"] and err["status"] == 200
    assert server.counts[CHAT] == 3  # the attempt budget, no more
    assert out.gen.failures == {"BadResponseError": 3}
    assert out.gate.outages == 0


def test_the_record_of_a_bad_response_carries_a_short_snippet() -> None:
    out, _ = go(send(200, b"<html>" + b"x" * 5000 + b"</html>"), max_attempts=1)
    msg = error_of(out.records[0])["message"]
    assert "<html>xxx" in msg and len(msg) < 300


def test_a_bad_response_in_regenerate_is_recorded_too() -> None:
    out, server = go(send_json({"choices": []}), mode=Mode.REGENERATE, max_attempts=2)
    assert error_of(out.records[0])["class"] == ErrorClass.BAD_RESPONSE and server.counts[CHAT] == 2


def test_a_bad_response_in_a_later_turn_stops_the_conversation_there() -> None:
    async def main() -> ResultRecord | ErrorRecord:
        async with HostileServer(sequence(send_json(GOOD), send_json({"choices": []}))) as server, \
                EndpointClient(server.url, request_timeout=DEADLINE) as client:
            gen = Generator(client, Gate(client), max_attempts=2, backoff_base=0.01)
            two: Item = {**item(0), "turn": None,
                         "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
            return await gen.answer(ctx(Mode.REGENERATE), two)

    rec = asyncio.run(main())
    assert "error" not in rec
    assert len(rec["turns"]) == 1 and rec["content"] == "fine"
    assert rec["stopped"]["reason"] == "error" and rec["stopped"]["error"]["class"] == ErrorClass.BAD_RESPONSE
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]


def test_one_bad_response_then_a_good_one_is_a_success() -> None:
    out, server = go(sequence(send_json([]), send_json(GOOD)), max_attempts=3)
    rec = out.records[0]
    assert "error" not in rec and rec["content"] == "fine" and rec["outcome"] == Outcome.FINISHED
    assert server.counts[CHAT] == 2


def test_a_body_cut_by_the_connection_is_transient() -> None:
    # Content-Length promises more than is sent, then the server closes: a transport fault.
    out, server = go(send(200, CUT, content_length=len(CUT) + 100), max_attempts=2)
    err = error_of(out.records[0])
    assert err["class"] == ErrorClass.TRANSIENT_EXHAUSTED and "cut off" in err["message"]
    assert server.counts[CHAT] == 2


def test_a_trickling_response_is_cut_at_the_deadline() -> None:
    raw = orjson.dumps(GOOD)
    response = head(200, len(raw)) + raw  # ~300 bytes at 20 per second: 15 s, if allowed
    out, server = go(trickle(response, 0.05), max_attempts=2)
    err = error_of(out.records[0])
    assert err["class"] == ErrorClass.TRANSIENT_EXHAUSTED and err["type"] == "DeadlineExceeded"
    assert server.counts[CHAT] == 2
    # Two attempts of DEADLINE each (plus a backoff of at most 10 ms), not two of 15 s.
    assert 2 * DEADLINE <= out.elapsed < 2 * DEADLINE + 2.0, out.elapsed


def test_an_aborted_completion_is_not_an_answer() -> None:
    out, server = go(send_json(completion("half", finish="abort")), max_attempts=2)
    err = error_of(out.records[0])
    assert err["class"] == ErrorClass.TRANSIENT_EXHAUSTED and "abort" in err["message"]
    assert server.counts[CHAT] == 2


def test_closing_before_headers_while_health_is_fine_cannot_hammer(caplog: pytest.LogCaptureFixture) -> None:
    # The old client took this for "endpoint down", /health said up, and it retried without
    # spending attempts: ~100,000 requests for 5 items in 75 s. Now each failure spends an
    # attempt, and the five items failing at once share one slow /health check.
    caplog.set_level(logging.WARNING, logger="genqueue")
    out, server = go(drop, n=5, health=delayed(0.3, OK_HEALTH), max_attempts=3, probe_interval=5.0)
    assert server.counts[CHAT] == 5 * 3
    assert server.counts[HEALTH] == 1 == out.gate.checks
    for rec in out.records:
        err = error_of(rec)
        assert err["class"] == ErrorClass.TRANSIENT_EXHAUSTED and err["type"] == "EndpointDown"
    assert out.gate.outages == 0 and not out.gate.paused
    lines = [r for r in caplog.records if r.name.startswith("genqueue")]
    # one "retrying" line and one "giving up" line; their repeats are folded into a count
    assert len(lines) == 2, [r.getMessage() for r in lines]


def test_503s_then_success_after_backoff() -> None:
    unavailable = send_json({"error": {"message": "busy"}}, status=503)
    out, server = go(sequence(unavailable, unavailable, send_json(GOOD)), max_attempts=3)
    rec = out.records[0]
    assert "error" not in rec and rec["content"] == "fine"
    assert server.counts[CHAT] == 3 and out.gen.failures == {"TransientError": 2}
    assert out.gate.outages == 0


def test_503s_past_the_budget_are_transient_exhausted() -> None:
    out, server = go(send_json({"error": {"message": "busy"}}, status=503), n=2, max_attempts=4)
    for rec in out.records:
        err = error_of(rec)
        assert err["class"] == ErrorClass.TRANSIENT_EXHAUSTED and err["status"] == 503 and "busy" in err["message"]
    assert server.counts[CHAT] == 8


def test_health_failing_closes_the_gate_and_requests_wait_without_spending_attempts() -> None:
    down = {"now": True}
    unavailable = send_json({"error": {"message": "loading"}}, status=503)

    async def main() -> tuple[Outcomes, HostileServer]:
        async with HostileServer(when(lambda: down["now"], unavailable, send_json(GOOD)),
                                 when(lambda: down["now"], send(503, b""), OK_HEALTH)) as server:
            async def recover() -> None:
                await asyncio.sleep(1.0)
                down["now"] = False

            return await answer_all(server, 3, max_attempts=2, during=recover()), server

    out, server = asyncio.run(main())
    # Each item failed once (one attempt of two spent), then waited on the closed gate for a
    # second (a budget of 2 with 10 ms backoffs would be gone in milliseconds otherwise).
    assert all("error" not in r and r["content"] == "fine" for r in out.records), out.records
    assert server.counts[CHAT] == 3 + 3
    assert out.gate.outages == 1 and not out.gate.paused and out.gate.down_since is None
    assert server.counts[HEALTH] >= 3  # the failed check and the polls until it answered
    assert out.elapsed >= 1.0


def test_refused_connections_close_the_gate_until_the_endpoint_is_back(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="genqueue")

    async def main() -> tuple[Outcomes, HostileServer]:
        async with HostileServer(send_json(GOOD)) as server:
            await server.refuse()  # a dead vLLM: nothing listens

            async def restart() -> None:
                await asyncio.sleep(1.0)
                await server.listen()

            return await answer_all(server, 4, max_attempts=2, during=restart()), server

    out, server = asyncio.run(main())
    assert all("error" not in r for r in out.records)
    assert out.gen.failures == {"EndpointDown": 4} and server.counts[CHAT] == 4
    assert out.gate.outages == 1 and out.elapsed >= 1.0
    text = caplog.text
    assert text.count("is down") == 1 and text.count("is back") == 1


def test_an_unexpected_exception_becomes_an_internal_record() -> None:
    async def main() -> ResultRecord | ErrorRecord:
        async with HostileServer(send_json(GOOD)) as server, EndpointClient(server.url) as client:
            gen = Generator(client, Gate(client))
            broken: Any = {"key": "f" * 32, "index": 7, "turn": 0, "messages": [{"content": "no role"}]}
            return await gen.answer(ctx(Mode.REGENERATE), broken, attempt=2)

    rec = asyncio.run(main())
    err = error_of(rec)
    assert err["class"] == ErrorClass.INTERNAL and err["message"] == "KeyError: 'role'"
    assert rec["key"] == "f" * 32 and rec["index"] == 7 and rec["attempt"] == 2 and "timings" in rec


def test_cancellation_still_propagates() -> None:
    async def main() -> None:
        async with HostileServer(delayed(30, send_json(GOOD))) as server, EndpointClient(server.url) as client:
            gen = Generator(client, Gate(client))
            task = asyncio.create_task(gen.answer(ctx(), item(0)))
            while not server.counts[CHAT]:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


def test_repeated_warnings_are_folded_into_one_line_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="t.repeat")
    logger = logging.getLogger("t.repeat")

    async def main() -> None:
        rl = RepeatedLog(logger, window=0.3)
        for i in range(58):
            rl.warning("k", "request failed: %s", f"reset {i}")
        rl.warning("other", "a different warning")
        await asyncio.sleep(0.5)  # the window ends: its repeats are reported without a new call
        rl.warning("k", "request failed: %s", "again")

    asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "request failed: reset 0",
        "a different warning",
        "request failed: reset 57 (repeated 57 times in the last 0.3 s)",
        "request failed: again",
    ]
