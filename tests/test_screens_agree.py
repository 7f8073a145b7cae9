"""One truth on every screen (issue 46, its proof): a run driven, in both prompt modes, through
enqueue, generate, ship and ack by a real consumer against the stand-in vLLM, that consumer
stopped, more enqueued, a --burst consumer's end, a consumer SIGTERMed while its ack is on the
wire (the stop's give-back queued behind it in the rq thread), rq's TTLs passing (the finished jobs' hashes
gone as rq's expiry leaves them, then `rq info`'s cleanup) and a Redis restart. After every step
every screen that shows a figure is read: `producer status --run R` (its --json and its text),
`producer runs --json`, `producer export --json`'s summary once the run is done, and the live
consumer's /metrics. Every figure two screens show must be the same; a finished healthy run is
never called malformed or failed and its rate does not move between two looks; a consumer that
has gone has one past-tense line and no verdict.

Real redis-server (the test's own, appendonly, so it can restart), the stand-in and the consumers
as subprocesses, rq's own `rq info`; the producer's commands through their click entry point in
this process (the same commands, without an interpreter's start at each of some thirty reads).
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner
from rq.job import Job
from rq.results import Result

from genqueue.common.keepers.rqaccess import JobPlace, place_key
from genqueue.common.keepers.runstate import RunState
from genqueue.producer.cli import main as producer_main
from genqueue.producer.status.core import run_status
from tests.conftest import (
    Prompts,
    RedisServer,
    both_modes_reference_slow,
    cli,
    free_port,
    http_text,
    sharegpt,
    wait_for,
    write_jsonl,
)
from tests.consumer.e2e import Proc, Sim
from tests.netproxy import accept_pairs

pytestmark = pytest.mark.integration

RUN = "agree"
FIRST, MORE = 12, 8  # items of the first enqueue, then of the second
BATCH = 4
LAST = BATCH  # one job: the one whose ack a SIGTERM meets
#: How long the ack is held after the SIGTERM: past the drain's wait for shipping (its floor, 5 s,
#: with --drain-timeout 0), so the give-back is queued behind the ack, and within the give-back's
#: own wait (STOP_GRACE less that, less its reserve: ~3 s more).
HOLD_AFTER_SIGTERM = 6.5
#: Words a consumer that has gone may not be given: its engine's verdict or a present figure.
PRESENT = ("live", "in flight", "held", "engine", "binds", "so far", "tok/s")


@dataclass(frozen=True)
class Look:
    """What every screen says of the run at one moment."""

    step: str
    status: dict[str, Any]
    text: str  # `producer status --run R`, as a user reads it
    runs: dict[str, Any]  # this run's row of `producer runs --json`
    export: dict[str, Any] | None  # `producer export --json`'s summary (once the run is done)
    metrics: dict[str, float] | None  # the live consumer's /metrics

    def line(self, label: str) -> str:
        """The status text's line LABEL (its first word; --wide wraps no line)."""
        found = [ln for ln in self.text.splitlines() if ln.split(" ", 1)[0] == label]
        assert len(found) == 1, (self.step, label, self.text)
        return found[0]


class AckHold:
    """A TCP proxy to Redis that holds a consumer's first ack of RUN (the transaction that adds
    the job to rq's finished registry) on its way there until released; all else passes."""

    def __init__(self, redis_port: int, run: str) -> None:
        key = place_key(run, JobPlace.FINISHED).encode()
        self.needle = b"ZADD\r\n$%d\r\n%s\r\n" % (len(key), key)
        self.holding, self._released, self._matched = threading.Event(), threading.Event(), threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=accept_pairs, args=(self._listener, ("127.0.0.1", redis_port), self._relay),
                         daemon=True, name="ackhold").start()

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._released.set()
        self._listener.close()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, asks: bool) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if asks and self.needle in tail + data and self._matched.acquire(blocking=False):
                    self.holding.set()
                    self._released.wait(60)
                tail = data[-len(self.needle):]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _metrics(port: int) -> dict[str, float]:
    text = http_text(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert text is not None, "the live consumer's /metrics did not answer"
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines()
                                     if ln.startswith("genqueue_"))}


def _producer(*args: str, url: str) -> str:
    """What `producer ARGS` prints (the command run in this process: a look at seven steps in
    subprocesses costs the suite seconds of interpreter start-up)."""
    res = CliRunner().invoke(producer_main, list(args), env={"REDIS_URL": url}, catch_exceptions=False)
    assert res.exit_code == 0, (args, res.output, res.stderr)
    return res.stdout


def _look(step: str, tmp: Path, url: str, *, export: bool, metrics_port: int | None = None) -> Look:
    """Every screen, one after the other (the run stands still between steps)."""
    out = tmp / "exports" / f"{step.replace(' ', '-')}.jsonl"
    out.parent.mkdir(exist_ok=True)
    status = orjson.loads(_producer("status", "--run", RUN, "--json", url=url))
    text = _producer("status", "--run", RUN, "--wide", url=url)
    rows = [orjson.loads(ln) for ln in _producer("runs", "--json", url=url).splitlines()]
    (row,) = [r for r in rows if r["run"] == RUN]
    summary = None
    if export:
        printed = _producer("export", "--run", RUN, "--output", str(out), "--json", "--no-card", url=url)
        summary = orjson.loads(printed.strip().splitlines()[-1])
    return Look(step=step, status=status, text=text, runs=row, export=summary,
                metrics=_metrics(metrics_port) if metrics_port is not None else None)


def _agree(look: Look, *, items: int, done: int) -> None:
    """Every figure two screens show is the same, and it is what the step made."""
    st, row, step = look.status, look.runs, look.step
    assert (st["items"], st["items_done"], st["items_failed"]) == (items, done, 0), step
    assert (row["items"], row["done"], row["failed"]) == (st["items"], st["items_done"], st["items_failed"]), \
        (step, row, {k: st[k] for k in ("items", "items_done", "items_failed")})
    assert row["state"] == st["state"], (step, row["state"], st["state"])
    assert (row["paused"], row["failed_by_class"], row["next_steps"]) == \
        ((st["paused"] or {}).get("reason"), st["failed_by_class"], st["next_steps"]), (step, row)
    # the text: `runs` says done iff status says complete; its counts are the JSON's
    progress, counts = look.line("progress"), look.line("items")
    assert (row["state"] == RunState.DONE) == ("run complete" in progress), (step, row["state"], progress)
    assert f": {done + st['items_failed']:,} of {items:,} items;" in progress, (step, progress)
    assert counts.startswith(f"items       {items:,}: ") and f"done {done:,}, failed {st['items_failed']:,}" \
        in counts, (step, counts)
    # outcomes sum to done, on status, in its text, and in export's summary
    assert st["complete"] + st["partial"] + st["cut"] == st["items_done"], (step, st["outcomes"])
    if done:
        assert f"done {done:,} = complete {st['complete']:,} " in look.line("outcomes"), step
    if look.export is not None:
        ex = look.export
        assert (ex["enqueued"], ex["failed"], ex["missing"]) == (items, st["items_failed"], 0), (step, ex)
        assert (ex["complete"], ex["partial"], ex["cut"]) == (st["complete"], st["partial"], st["cut"]), \
            (step, ex, st["outcomes"])
        assert ex["cut_by_outcome"] == st["cut_by_outcome"], step
        assert (ex["failed_by_class"], ex["failed_jobs"]) == (st["failed_by_class"], st["jobs"]["failed"]), step
        assert ex["malformed_jobs"] == st["malformed_jobs"] == [], step
    if look.metrics is not None:  # the one consumer that did all the work so far
        m = look.metrics
        by_outcome = {k: int(m.get(f'genqueue_completions_total{{outcome="{k}",run="{RUN}"}}', 0))
                      for k in st["outcomes"]}
        assert by_outcome == st["outcomes"], (step, by_outcome, st["outcomes"])
        assert int(m[f'genqueue_tokens_total{{kind="completion",run="{RUN}"}}']) == st["completion_tokens"], step
        assert int(m[f'genqueue_tokens_total{{kind="prompt",run="{RUN}"}}']) == st["prompt_tokens"], step
        assert int(m['genqueue_jobs{ending="acked"}']) == st["jobs"]["finished"], (step, st["jobs"])
        assert int(m["genqueue_shards_shipped"]) == st["shipping"]["shards"], (step, st["shipping"])
        assert int(m[f'genqueue_queue_depth{{run="{RUN}"}}']) == st["jobs"]["queued"], (step, st["jobs"])
        (me,) = [c for c in st["consumers"] if c["live"]]
        assert int(m["genqueue_in_flight"]) == me["in_flight"], step


def _healthy_and_finished(look: Look) -> None:
    """A finished healthy run: complete and done everywhere, nothing malformed nor failed."""
    st, step = look.status, look.step
    assert st["state"] == RunState.DONE and look.runs["state"] == RunState.DONE, step
    assert st["malformed_jobs"] == [], (step, st["malformed_jobs"])
    assert st["jobs"]["failed"] == 0 and st["eta_s"] == 0, step
    assert look.runs["stalled"] == "" and look.runs["failed_jobs"]["jobs"] == 0, (step, look.runs)
    for word in ("malformed", "JOBS ", "NOT complete", "STOPPED REPORTING", "STALLED"):
        assert word not in look.text, (step, word, look.text)


def _gone_are_past_tense(look: Look, *, gone: int) -> None:
    """GONE consumers have gone, none is left, and each is one line of what it did: no present
    figure, no verdict."""
    assert [c["live"] for c in look.status["consumers"]] == [False] * gone, (look.step, look.status["consumers"])
    assert all((c["state"], c["gone"], c["exited"], c["engine"]) == ("exited", True, True, None)
               for c in look.status["consumers"]), (look.step, look.status["consumers"])
    assert "no live consumer serves or refuses this run" in look.line("hosts"), look.step
    lines = look.text.splitlines()
    for c in look.status["consumers"]:
        if c["live"]:
            continue
        (i,) = [n for n, ln in enumerate(lines) if ln.startswith(f"  {c['worker']} ")]
        shown = lines[i]
        assert " exited " in shown and (shown.endswith(" ago") or " ago (of " in shown), (look.step, shown)
        assert not any(w in shown for w in PRESENT), (look.step, shown)
        under = lines[i + 1] if i + 1 < len(lines) else ""
        assert not under.startswith("      "), (look.step, "a verdict under a gone consumer", under)


def _rate_stands(before: Look, after: Look) -> None:
    """A finished run's rate is what it did: the same at two looks seconds apart, and shown."""
    a, b = before.status["speed"], after.status["speed"]
    # was `speed  run over; its rate - (when it ended is not recorded)` for a run under a second long:
    # its end was stamped to the second below, before its start
    assert a["run_seconds"] and a["run_average"]["completions_per_s"], (before.step, a, before.line("speed"))
    assert a["run_average"] == b["run_average"] and a["run_seconds"] == b["run_seconds"], \
        (before.step, after.step, a, b)
    assert before.line("speed") == after.line("speed"), (before.step, after.step)


def _enqueue(tmp: Path, url: str, name: str, first: int, n: int, prompts: Prompts) -> None:
    data = write_jsonl(tmp / f"{name}.jsonl", [sharegpt(i) for i in range(first, first + n)])
    cli("producer", "enqueue", str(data), "--run", RUN, "--output", str(tmp / "out"), "--batch-size", str(BATCH),
        "--max-tokens", "16", "--rejects", str(tmp / f"{name}.rej"), *prompts.args, env={"REDIS_URL": url})


def _settled(conn: redis.Redis, items: int, jobs: int) -> None:
    """Wait till every item is done and every job acked, and then for each live consumer's next
    report (its figures and its /metrics are set at each report: one from before the end is stale)."""
    ended: list[float] = []

    def over() -> bool:
        st = run_status(conn, RUN)
        if st["items_done"] == items and st["jobs"]["finished"] == jobs and st["jobs"]["started"] == 0:
            ended.append(st["now"])
        return bool(ended)

    def reported() -> bool:
        st = run_status(conn, RUN)
        return all(st["now"] - c["age_s"] > ended[0] for c in st["consumers"] if c["live"])

    wait_for(over, 60, f"{items} items done and {jobs} jobs acked")
    wait_for(reported, 30, "each live consumer's report after the end")


@both_modes_reference_slow
def test_every_screen_shows_the_same_figures_through_a_runs_life(tmp_path: Path, prompts_mode: Prompts) -> None:
    """was (before issue 46's fixes): `producer runs` `queued` beside status `run complete`; a
    finished run's speed falling at each look (59.2 items/s, then 0.2); an exited consumer with
    `genqueue binds: the consumer is out of work` under it; `JOBS 10 malformed job(s) …` once rq's
    TTLs passed; a job whose ack a SIGTERM met, finished and queued again by the stop's give-back. now: at every step the same items, done, failed, state and outcomes on status
    (JSON and text), runs, export and the consumer's /metrics; a finished run complete and done
    with one rate; a gone consumer one line `exited … ago`."""
    server = RedisServer(tmp_path, appendonly=True)
    server.start()
    url, env = server.url, {"REDIS_URL": server.url}
    conn = redis.Redis.from_url(url)
    sim = Sim(tmp_path, "--step-time", "0.002", "--mean-tokens", "8")
    consumers: list[Proc] = []
    try:
        _enqueue(tmp_path, url, "first", 0, FIRST, prompts_mode)
        look = _look("enqueued", tmp_path, url, export=False)
        _agree(look, items=FIRST, done=0)
        assert look.runs["state"] == RunState.QUEUED, look.runs

        # generate, ship and ack: a consumer that stays (so its /metrics can be read when it idles)
        port = free_port()
        first = Proc("consumer", ["run", "--run", RUN, "--endpoint", sim.url, "-c", "8", "--shard-max-age", "0.3",
                                  "--spool", str(tmp_path / "spool1"), "--metrics-port", str(port),
                                  "--metrics-host", "127.0.0.1"], tmp_path / "c1.log", env=env)
        consumers.append(first)
        jobs = FIRST // BATCH
        _settled(conn, FIRST, jobs)
        done1 = _look("generated, shipped and acked", tmp_path, url, export=True, metrics_port=port)
        _agree(done1, items=FIRST, done=FIRST)
        _healthy_and_finished(done1)

        first.signal(signal.SIGTERM)  # the consumer is stopped (SIGTERM): it drains and exits
        assert first.wait(60) == 0, first.output()
        time.sleep(max(0.0, 2.5 - (time.time() - done1.status["now"])))
        gone = _look("first consumer stopped", tmp_path, url, export=True)
        _agree(gone, items=FIRST, done=FIRST)
        _healthy_and_finished(gone)
        _gone_are_past_tense(gone, gone=1)
        _rate_stands(done1, gone)

        _enqueue(tmp_path, url, "more", FIRST, MORE, prompts_mode)
        more = _look("more enqueued", tmp_path, url, export=False)
        _agree(more, items=FIRST + MORE, done=FIRST)
        assert more.runs["state"] == RunState.QUEUED, more.runs
        _gone_are_past_tense(more, gone=1)

        # a --burst consumer: it takes the rest and ends by itself
        burst = Proc("consumer", ["run", "--run", RUN, "--endpoint", sim.url, "--burst", "-c", "8",
                                  "--shard-max-age", "0.3", "--spool", str(tmp_path / "spool2")],
                     tmp_path / "c2.log", env=env)
        consumers.append(burst)
        assert burst.wait(120) == 0, burst.output()
        total, jobs = FIRST + MORE, FIRST // BATCH + MORE // BATCH
        ended = _look("burst consumer ended", tmp_path, url, export=True)
        _agree(ended, items=total, done=total)
        _healthy_and_finished(ended)
        _gone_are_past_tense(ended, gone=2)
        assert ended.status["jobs"]["finished"] == jobs, ended.status["jobs"]

        # SIGTERM mid-ack: the next job's ack held on its way to Redis when the signal comes; the
        # drain's wait for shipping gives up and the give-back is queued behind the ack in the rq
        # thread, the job still in the consumer's book; then the ack lands. The give-back must
        # leave the acked job as it is (it used to queue it again: finished and queued at once)
        _enqueue(tmp_path, url, "last", total, LAST, prompts_mode)
        hold = AckHold(server.port, RUN)
        try:
            held = Proc("consumer", ["run", "--run", RUN, "--endpoint", sim.url, "-c", "8", "--shard-max-age", "0.3",
                                     "--lease", "60", "--drain-timeout", "0", "--spool", str(tmp_path / "spool3")],
                        tmp_path / "c3.log",
                        env={"REDIS_URL": url.replace(f":{server.port}/", f":{hold.port}/") + "?socket_timeout=15"})
            consumers.append(held)
            assert hold.holding.wait(60), held.output()
            assert conn.zcard(place_key(RUN, JobPlace.FINISHED)) == jobs  # its ack not in yet
            held.signal(signal.SIGTERM)
            time.sleep(HOLD_AFTER_SIGTERM)
            assert held.p.poll() is None, held.output()  # still stopping: its ack and give-back wait
            hold.release()
            assert held.wait(30) == 0, held.output()
        finally:
            hold.close()
        log = held.output()
        assert re.search(r"job \S+: no longer ours \(acked or swept meanwhile\); not given back", log), log
        (worker,) = re.findall(r"consumer (\S+) started:", log)
        total, jobs = total + LAST, jobs + 1
        acked = _look("SIGTERM mid-ack", tmp_path, url, export=True)
        _agree(acked, items=total, done=total)
        _healthy_and_finished(acked)
        _gone_are_past_tense(acked, gone=3)
        st = acked.status
        assert (st["jobs"]["finished"], st["jobs"]["queued"], st["jobs"]["started"]) == (jobs, 0, 0), st["jobs"]
        (me,) = [c for c in st["consumers"] if c["worker"] == worker]
        assert (me["state"], me["gone"], me["held_jobs"], me["in_flight"]) == ("exited", True, 0, 0), me
        (row_line,) = [ln for ln in acked.text.splitlines() if ln.startswith(f"  {worker} ")]
        assert " exited " in row_line, row_line
        runs_text = _producer("runs", url=url).splitlines()  # the table as a user reads it: one line, done
        assert len(runs_text) == 2 and runs_text[1].split()[0] == RUN, runs_text
        assert " done " in runs_text[1] and f" {total:,} of {total:,} " in runs_text[1], runs_text

        # rq's TTLs pass: each finished job's hash and result go as rq's expiry leaves them (ids stay)
        finished = [m.decode() for m in conn.zrange(place_key(RUN, JobPlace.FINISHED), 0, -1)]
        assert len(finished) == jobs
        conn.delete(*[k for j in finished for k in (Job.key_for(j), Result.get_key(j))])
        conn.zadd(place_key(RUN, JobPlace.FINISHED), dict.fromkeys(finished, time.time() - 1))
        time.sleep(max(0.0, 2.5 - (time.time() - acked.status["now"])))
        expired = _look("rq's TTLs passed", tmp_path, url, export=True)
        _agree(expired, items=total, done=total)
        _healthy_and_finished(expired)
        _gone_are_past_tense(expired, gone=3)
        _rate_stands(acked, expired)

        info = cli("rq", "info", "-u", url, f"genqueue.{RUN}")  # rq's own cleanup of the registries
        assert "Traceback" not in info.stderr
        assert conn.zcard(place_key(RUN, JobPlace.FINISHED)) == 0
        cleaned = _look("rq info cleaned the registries", tmp_path, url, export=True)
        _agree(cleaned, items=total, done=total)
        _healthy_and_finished(cleaned)
        _gone_are_past_tense(cleaned, gone=3)
        _rate_stands(acked, cleaned)

        server.stop()  # a Redis restart: appendonly, so everything comes back
        server.start()
        back = _look("Redis restarted", tmp_path, url, export=True)
        _agree(back, items=total, done=total)
        _healthy_and_finished(back)
        _gone_are_past_tense(back, gone=3)
        _rate_stands(acked, back)
    finally:
        for c in consumers:
            if c.p.poll() is None:
                c.kill()
        sim.stop()
        server.stop()
