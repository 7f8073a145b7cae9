"""The engine doctor end to end: the stand-in driven into each regime, a real consumer judging it,
its verdict read from the consumer's snapshot and from `producer status` (real redis-server, the
stand-in over HTTP, CLIs as subprocesses).

The regimes run side by side (one stand-in, run and consumer each), so the wait for a verdict
(the doctor judges a 10 s window; a fixed -c reads /metrics every 5 s) is paid once.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.common.keepers.runs import CONSUMERS, consumer_key
from tests.conftest import RedisServer, cli, free_port, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.slow]

SAFETY = 0.8  # consumer/engine/doctor.py DOCTOR_SAFETY

METRICS_PORT = free_port()

#: run -> (stand-in options, consumer options, records, enqueue options)
LONG = "[len=100000]"  # with --max-tokens 4000: 4000 steps


def _records(n: int, **kw: Any) -> list[dict[str, Any]]:
    return [sharegpt(i, **kw) for i in range(n)]


def _tail_records() -> list[dict[str, Any]]:
    # the short ones last ~3 s (600 steps), so the looks (every 0.5 s under --concurrency auto) see
    # the batch at its peak even on a loaded machine: at 150 steps they ended within one look in a
    # CI run, the peak seen stayed under 8 and the long pair read as "out of work", not as a tail
    short = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"short {i} [len=600]"},
                                              {"from": "gpt", "value": "a"}]} for i in range(60)]
    long = [{"id": f"l{i}", "conversations": [{"from": "human", "value": f"long {i} {LONG}"},
                                             {"from": "gpt", "value": "a"}]} for i in range(2)]
    return long + short


REGIMES: dict[str, tuple[list[str], list[str], list[dict[str, Any]], list[str]]] = {
    "cap": (["--max-num-seqs", "4", "--kv-cache-tokens", "20000", "--step-time", "0.01", "--mean-tokens", "300"],
            ["-c", "32", "--metrics-port", str(METRICS_PORT)], _records(200), []),
    "memory": (["--max-num-seqs", "256", "--kv-cache-tokens", "3000", "--step-time", "0.01", "--mean-tokens", "300"],
               ["-c", "64"], _records(300), []),
    "genq": (["--step-time", "0.01", "--mean-tokens", "300"], ["-c", "4"], _records(100), []),
    "tail": (["--step-time", "0.005", "--length-hints"], ["-c", "auto"], _tail_records(), ["--max-tokens", "4000"]),
    "spec": (["--step-time", "0.01", "--mean-tokens", "200", "--spec-tokens", "3", "--spec-acceptance", "0.8",
              "--prefix-cache-blocks", "4096", "--block-size", "16"],
             ["-c", "8"], _records(100, turns=3, system="You answer in one line. " * 20),
             ["--multi-turn", "each"]),
}


class Regimes:
    def __init__(self, tmp: Path, url: str) -> None:
        self.tmp, self.url = tmp, url
        self.conn = redis.Redis.from_url(url)
        self.sims: dict[str, Sim] = {}
        self.procs: dict[str, Proc] = {}

    def start(self) -> None:
        env = {"REDIS_URL": self.url}
        for run, (sim_args, c_args, records, enq_args) in REGIMES.items():
            d = self.tmp / run
            d.mkdir()
            self.sims[run] = Sim(d, *sim_args)
            data = write_jsonl(d / "in.jsonl", records)
            cli("producer", "enqueue", str(data), "--run", run, "--output", str(self.tmp / "out"), "--batch-size", "4",
                "--rejects", str(d / "rej.jsonl"), *(enq_args or ["--max-tokens", "512"]), env=env)
        for run, (_, c_args, _, _) in REGIMES.items():
            self.procs[run] = Proc("consumer", ["run", "--run", run, "--endpoint", self.sims[run].url,
                                                "--spool", str(self.tmp / run / "spool"), "--shard-max-age", "1",
                                                *c_args], self.tmp / run / "consumer.log", env=env)

    def stop(self) -> None:
        for p in self.procs.values():
            p.kill()
        for s in self.sims.values():
            s.stop()

    def engine(self, run: str) -> dict[str, Any]:
        """The engine view the consumer of RUN published last."""
        for worker in self.conn.zrange(CONSUMERS, 0, -1):
            raw = self.conn.get(consumer_key(worker.decode()))
            snap = orjson.loads(raw) if raw else {}
            if snap.get("endpoint") == self.sims[run].url:
                return dict(snap.get("engine") or {})
        return {}

    def wait_verdict(self, run: str, verdict: str, timeout: float = 60,
                     until: Callable[[dict[str, Any]], bool] = lambda e: True) -> dict[str, Any]:
        """The engine view once its verdict is VERDICT and UNTIL holds of it."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            e = self.engine(run)
            if e.get("verdict") == verdict and until(e):
                return e
            if e.get("advice") and (not seen or seen[-1] != e["advice"]):
                seen.append(e["advice"])
            time.sleep(0.3)
        raise AssertionError(f"{run}: no {verdict} verdict; saw {seen}\n" + self.procs[run].output()[-3000:])


@pytest.fixture(scope="module")
def regimes(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Regimes]:
    redis.Redis.from_url(redis_server.url).flushall()
    r = Regimes(tmp_path_factory.mktemp("regimes"), redis_server.url)
    try:
        r.start()
        yield r
    finally:
        r.stop()


def test_the_batch_cap_binds_and_a_larger_one_is_suggested(regimes: Regimes) -> None:
    e = regimes.wait_verdict("cap", "batch_cap")
    n = e["numbers"]
    assert n["max_num_seqs"] == 4 and n["waiting"] > 0
    # the KV cache has room for about running / usage requests; the doctor keeps a margin. The
    # usage is the window's highest: the last look's can be lower once new requests replaced
    # finished ones (the verdict, held 3 looks before it is said, is read later in the run).
    assert n["suggested_max_num_seqs"] == pytest.approx(4 * SAFETY / n["kv_cache_usage_max"], rel=0.3)
    assert n["suggested_max_num_seqs"] >= 16
    assert f"raise --max-num-seqs from 4 to about {n['suggested_max_num_seqs']}" in e["advice"]
    out = cli("producer", "status", "--run", "cap", env={"REDIS_URL": regimes.url}).stdout
    flat = " ".join(out.split())  # the advice wraps at 100 columns, never clipped
    assert "engine: the batch cap binds" in flat and "raise --max-num-seqs from 4 to about" in flat
    assert max(len(line) for line in out.splitlines()) <= 100
    js = orjson.loads(cli("producer", "status", "--run", "cap", "--json", env={"REDIS_URL": regimes.url}).stdout)
    assert js["consumers"][0]["engine"]["verdict"] in ("batch_cap", "engine")
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5) as resp:
        page = resp.read().decode()
    assert 'genqueue_engine_bound{reason="batch_cap"} 1.0' in page
    assert 'genqueue_engine_bound{reason="memory"} 0.0' in page


def test_memory_binds_when_the_kv_cache_is_small(regimes: Regimes) -> None:
    e = regimes.wait_verdict("memory", "memory")
    assert e["numbers"]["preemptions_per_min"] > 0 and e["preemptions"] > 0
    assert "more concurrency will not help" in e["advice"] and "--kv-cache-dtype fp8" in e["advice"]


def test_genqueue_binds_at_a_fixed_low_concurrency(regimes: Regimes) -> None:
    e = regimes.wait_verdict("genq", "genqueue")
    assert "at its own limit (4 in flight of 4)" in e["advice"] and "raise -c from 4" in e["advice"]
    assert e["numbers"]["waiting"] == 0


def test_the_tail_says_how_many_long_requests_run_alone(regimes: Regimes) -> None:
    # the last short requests end a look or two into the tail (4 running of a peak of 62 is a tail
    # too); the verdict then counts the long pair alone
    e = regimes.wait_verdict("tail", "tail", until=lambda e: e["numbers"]["tail_requests"] <= 2)
    n = e["numbers"]
    assert n["tail_requests"] in (1, 2) and n["queue_depth"] == 0
    assert n["peak_running"] >= 8 and n["tail_seconds"] >= 0


def test_spec_decode_and_prefix_cache_are_noted(regimes: Regimes) -> None:
    regimes.wait_verdict("spec", "genqueue")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        e = regimes.engine("spec")
        notes = e.get("notes") or []
        if len(notes) == 3 and "hit rate" in notes[1] and e.get("spec_verdict"):
            break
        time.sleep(0.3)
    n = e["numbers"]
    assert n["spec_mean_accepted_length"] == pytest.approx(2.95, abs=0.05)
    # a step (0.01 s) yields 2.95 tokens: well above the 100 tok/s a request gets without drafts
    assert n["tokens_per_s_per_request"] > 150
    spec, prefix, pays = notes
    # ~8 running x (1 + 3) = ~32 tokens a step: under the doctor's knee of 64, the drafts come free
    assert e["spec_verdict"] == "pays" and pays.startswith("speculation pays ~"), pays
    # the batch is the window's mean running (7.5 when a look fell between two requests), and the
    # product the advice shows multiplies out
    b = re.search(r"memory-bound: batch (\d+(?:\.\d)?) x \(1 \+ 3\) = (\d+) tokens a step", pays)
    assert b is not None and n["spec_k"] == 3, pays
    assert 6 <= float(b[1]) <= 8 and int(b[2]) == round(float(b[1]) * 4), pays
    # 0.8 + 0.64 + 0.512 = 1.952 of 3 drafts accepted per step: 65%, mean accepted length 2.95 (drawn
    # per request by the stand-in, so within a few points of it)
    m = re.match(r"speculative decoding on: (\d+)% of draft tokens accepted, mean accepted length 2\.9", spec)
    assert m is not None and 62 <= int(m[1]) <= 68, spec
    rate = int(prefix.split("hit rate ")[1].split("%")[0])
    assert rate > 30  # the shared system prompt, and each turn's history

