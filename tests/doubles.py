"""The one set of test doubles for the consumer's unit tests: what a part under test talks to,
faked once. A unit test of a part takes the doubles it needs from here rather than writing its
own, so a change of an interface (the worker's ack, the outbox's append, a Redis pipeline) is
met in one place.

- `item`, `result`, `run_context`, `job`, `held_job`: typed values of the shapes the parts pass;
- `FakeConn` / `FakePipe`: a Redis connection whose pipeline records every command (name, args)
  and returns nothing: for parts that only write through a pipeline (the acker's run stats);
- `FakeWorker`: the rq side of the acker and the leases (finish, fail, give_back, renew), which
  records every call; `Held`: what it holds for one job;
- `FakeOutbox`: an outbox that keeps the records appended, never full;
- `FakeGate`: an open admission gate.

Integration tests use the real parts (redis-server, the stand-in engine); these are for the
in-process unit tests only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from genqueue.common.contracts import Item
from genqueue.common.records import ConsumerInfo, ResultRecord
from genqueue.common.settings import RunSettings
from genqueue.consumer.answer.generate import RunContext
from genqueue.consumer.work.book import Book, JobState

IDENT: ConsumerInfo = {"host": "h", "gpu": None, "worker": "w", "endpoint": "e"}


def run_context(run: str = "r", settings: RunSettings | None = None, model: str = "m") -> RunContext:
    return RunContext(run, settings or RunSettings(), model, IDENT)


CTX = run_context()


def item(i: int, text: str = "hi", *, run: str | None = None, job_id: str | None = None) -> Item:
    """Item I of a run; keys unique per (run, job_id, i) when those are given."""
    key = f"{i:032x}" if run is None else f"{hash((run, job_id, i)) & (2**128 - 1):032x}"
    return {"key": key, "index": i, "turn": None, "messages": [{"role": "user", "content": text}]}


def result(it: Item, ctx: RunContext = CTX) -> ResultRecord:
    """A finished single-turn result for IT (3 prompt tokens, 5 completion tokens)."""
    return {"key": it["key"], "index": it["index"], "turn": None, "run": ctx.run, "messages": it["messages"],
            "sampling": {}, "fingerprint": "f", "version": "v", "consumer": ctx.consumer, "attempt": 1,
            "content": "ok", "reasoning": None, "reasoning_form": "none", "tool_calls": [],
            "finish_reason": "stop", "outcome": "finished", "usage": {"prompt_tokens": 3, "completion_tokens": 5},
            "model": "m"}


def job(jid: str, n: int, start: int = 0, *, run: str | None = None) -> JobState[Any]:
    """A job of N items held with no rq job behind it: of run "r" with keys from the index, or of
    RUN with keys unique per (RUN, JID, index), so several jobs of one run never share a key."""
    if run is None:
        return JobState(jid, object(), CTX, [item(start + i) for i in range(n)], 1, None)
    return JobState(jid, object(), run_context(run), [item(start + i, run=run, job_id=jid) for i in range(n)], 1, None)


class Held:
    """What a FakeWorker holds for one job: its id, whether a sweep took it, an rq job stub."""

    def __init__(self, jid: str) -> None:
        self.id = jid
        self.swept = False

        class _Job:
            started_at = None

        self.job = _Job()


def held_job(jid: str, n: int) -> JobState[Any]:
    return JobState(jid, Held(jid), CTX, [item(i) for i in range(n)], 1, None)


def complete(book: Book[Any], js: JobState[Any], seq: int) -> None:
    """Hold JS in BOOK and answer and record every item of it into shard SEQ."""
    book.hold(js)
    while (t := book.take()) is not None:
        book.answered(t[0])
        book.recorded(t[0], result(t[1]), seq)


class FakeGate:
    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.up.set()
        self.paused = False


class FakeOutbox:
    spool_limit = 1 << 30
    spool_bytes = 0

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.places: list[Any] = []

    def full(self) -> bool:
        return False

    def append(self, run: str, rec: Any, *, place: Any = None) -> int:
        self.records.append(rec)
        self.places.append(place)
        return 1


class FakeWorker:
    name = "w"

    def __init__(self, ours: bool = True) -> None:
        self.ours = ours
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def finish(self, held: Any, manifest: dict[str, Any]) -> bool:
        self.calls.append(("finish", held, manifest))
        return self.ours

    def fail(self, held: Any, reason: str, *, retry: bool) -> None:
        self.calls.append(("fail", held, {"reason": reason, "retry": retry}))

    def give_back(self, held: Any) -> bool:
        self.calls.append(("give_back", held, {}))
        return True

    def renew(self, held: list[Any]) -> list[Any]:
        return [h for h in held if getattr(h, "swept", False)]


class FakePipe:
    def __init__(self) -> None:
        self.ops: list[tuple[Any, ...]] = []
        self.executed = 0  # round trips (a MULTI each when transactional)

    def __enter__(self) -> FakePipe:  # noqa: PYI034 - a fake
        return self

    def __exit__(self, *a: object) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kw: self.ops.append((name, *args))

    def execute(self) -> list[Any]:
        self.executed += 1
        return []


class FakeConn:
    def __init__(self) -> None:
        self.pipe = FakePipe()

    def pipeline(self, transaction: bool = True) -> FakePipe:
        return self.pipe
