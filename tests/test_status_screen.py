"""`producer status` of a live scene: two runs (a big one and a tiny one), two consumers (one
serving every open run, one serving the big run only), real Redis, the stand-in over HTTP,
every process a subprocess but the samples of `producer status --json` (`sample`: the same
report, taken in this process, so that a loaded machine still takes many while the run goes).

What it proves: each run shows only its own figures (the consumer serving both appears under
the tiny run with the tiny run's share, never the big run's in flight or shipping); the
figures agree with each other at every sample; and the screen answers the five questions in
its first lines, with no line past 100 columns.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genqueue.producer.status import run_status
from tests.conftest import INLINE, Prompts, both_modes_reference_slow, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim

pytestmark = pytest.mark.integration

BIG, TINY = 400, 2


def _enqueue(tmp: Path, redis_url: str, run: str, records: list[Any], prompts: Prompts = INLINE) -> None:
    data = write_jsonl(tmp / f"{run}.jsonl", [*records, "not an object"])
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp / "out"), "--batch-size", "8",
        "--max-tokens", "256", "--temperature", "0.7", "--rejects", str(tmp / f"{run}.rej.jsonl"), *prompts.args,
        env={"REDIS_URL": redis_url})


def _consumer(tmp: Path, redis_url: str, sim: Sim, name: str, *extra: str) -> Proc:
    return Proc("consumer", ["run", "--endpoint", sim.url, "--spool", str(tmp / "spool" / name), "--burst",
                             "--shard-max-age", "1", "-c", "48", *extra], tmp / f"{name}.log",
                env={"REDIS_URL": redis_url})


def sample(conn: redis.Redis, runs: tuple[str, ...]) -> list[dict[str, Any]]:
    """`producer status --json` of RUNS, as the command makes it (run_status, through JSON), in
    this process: a sample takes milliseconds, not a Python start, so a loaded machine still
    takes many while the consumers work."""
    return [orjson.loads(orjson.dumps(run_status(conn, run))) for run in runs]


def check_identities(r: dict[str, Any]) -> None:
    """What must hold of one run's status (its --json) at any moment: every item in one place,
    done the sum of the outcomes, the tool-turn counts within done, rates blank until there is
    a rate, each consumer's share within the run's."""
    where = [r[f"items_{k}"] for k in ("queued", "in_flight", "shipping", "done", "failed", "elsewhere")]
    assert sum(where) == r["items"] and min(where) >= 0, r
    remaining = r["items"] - r["items_done"] - r["items_failed"]
    assert remaining >= 0 and r["items_in_flight"] + r["items_shipping"] <= remaining, r
    assert r["done"] == r["items_done"] == r["outcomes_counted"] == r["complete"] + r["partial"] + r["cut"], r
    assert sum(r["outcomes"].values()) == r["done"] and sum(r["cut_by_outcome"].values()) == r["cut"]
    assert r["failed"] == r["items_failed"] and sum(r["failed_by_class"].values()) >= r["failed"]
    assert (r["jobs"]["queued"] == 0) == (r["items_queued"] == 0), r
    tools = r["tool_turns_to_end"] + r["tool_call_diverged"] + r["stopped_at_tool_turn"]
    if r["settings"]["multi_turn"] == "regenerate":  # counted with the marks: a turn at least each
        assert r["turns_generated"] >= r["done"] and tools <= r["done"], r
    else:
        assert tools == 0, r
    assert all(c["in_flight"] + c["pending_items"] <= r["items_in_flight"] for c in r["consumers"]), r
    last, avg = r["speed"]["last_minute"], r["speed"]["run_average"]
    # the last minute's rates are all blank, with the reason why, or all rates
    assert all((v is None) == bool(r["speed"]["note"]) for v in last.values()), r["speed"]
    assert r["eta_assumes_completion_tokens_per_s"] == last["completion_tokens_per_s"], r
    if remaining and last["completion_tokens_per_s"] is None:  # no rate: no ETA either
        assert r["eta_s"] is None, r
    if r["done"] + r["failed"] == 0:  # nothing shipped: no rate, beside `done 0`
        assert last["completions_per_s"] is None and avg["completions_per_s"] is None and r["speed"]["note"]
        assert all(v is None for v in avg.values()), avg
    if r["items"] and r["done"] + r["failed"] == r["items"]:  # over: a word, not a `0.0`
        assert last["completions_per_s"] is None and r["speed"]["note"] == "run complete"
        assert r["eta_s"] == 0.0


@both_modes_reference_slow  # issue 34: the five questions hold by reference too
def test_two_runs_two_consumers_each_run_its_own_figures(tmp_path: Path, redis_url: str, conn: redis.Redis,
                                                         prompts_mode: Prompts) -> None:
    sim = Sim(tmp_path, "--slots", "64", "--step-time", "0.008", "--mean-tokens", "60")
    procs: list[Proc] = []
    try:
        _enqueue(tmp_path, redis_url, "big", [sharegpt(i, turns=1 + i % 3) for i in range(BIG)], prompts_mode)
        _enqueue(tmp_path, redis_url, "tiny", [sharegpt(i) for i in range(TINY)], prompts_mode)
        procs = [_consumer(tmp_path, redis_url, sim, "both"), _consumer(tmp_path, redis_url, sim, "bigonly",
                                                                      "--run", "big")]
        env = {"REDIS_URL": redis_url}
        samples, screen, tiny_screen, both_busy = 0, "", "", False
        deadline = time.monotonic() + 90
        while any(p.p.poll() is None for p in procs) and time.monotonic() < deadline:
            runs = {r["run"]: r for r in sample(conn, ("big", "tiny"))}
            for r in runs.values():
                check_identities(r)
            samples += runs["big"]["items_done"] + runs["big"]["items_failed"] < BIG  # one taken mid-run
            tiny, big = runs["tiny"], runs["big"]
            assert tiny["items_in_flight"] + tiny["items_shipping"] <= TINY
            for c in tiny["consumers"]:
                assert c["in_flight"] + c["pending_items"] <= TINY and c["held_jobs"] <= 1, c
            live = [c for c in big["consumers"] if c["live"]]
            shared = {c["worker"]: c for c in tiny["consumers"]}
            if len(live) == 2 and any(c["worker"] in shared and c["in_flight"] > TINY for c in live):
                both_busy = True  # the consumer of both runs is busy on the big one: the old bug's moment
                if not screen:
                    screen = cli("producer", "status", "--run", "big", env=env).stdout
                    tiny_screen = cli("producer", "status", "--run", "tiny", env=env).stdout
            time.sleep(0.2)
        for p in procs:
            assert p.wait(60) == 0, p.output()
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.kill()
        sim.stop()
    assert samples >= 5 and both_busy and screen, (samples, both_busy)
    final = {r["run"]: r for r in orjson.loads(cli("producer", "status", "--json", env=env).stdout)["runs"]}
    for r in final.values():
        check_identities(r)
    tiny = final["tiny"]
    assert (tiny["items"], tiny["items_done"], tiny["items_in_flight"]) == (TINY, TINY, 0)
    # tiny's shipping is its own shards, not the consumer's total over both runs
    shards = list((tmp_path / "out" / "tiny" / "shards").glob("*.jsonl"))
    assert tiny["shipping"]["shards"] == len(shards) and tiny["shipping"]["bytes"] == sum(s.stat().st_size for s in shards)
    assert final["big"]["shipping"]["shards"] > tiny["shipping"]["shards"]
    assert tiny["input"]["records"] == TINY + 1 and tiny["rejected_by_reason"] == {"not_object": 1}

    # the screens, as a person sees them at 100 columns
    for text in (screen, tiny_screen):
        assert all(len(line) <= 100 for line in text.splitlines()), text
    lines = screen.splitlines()
    head = "\n".join(lines[:14])
    assert f"big.jsonl: {BIG + 1} of {BIG + 1} records read (complete), rejected 1" in head  # 1. the input
    assert "not_object 1" in head
    multi = sum(1 for i in range(BIG) if i % 3)
    assert f"regenerate, truncation keep: {multi} of {BIG} records have more than one user turn" in head  # 2.
    assert "turns generated" in head or " generated; conversations complete" in head
    assert "temperature 0.7" in head and "max_tokens 256" in head  # 3. the sampling
    assert str(tmp_path / "out") in head and " shipped, " in head  # 4. output and shipping
    assert "progress" in head and (" ETA " in head or "ETA -" in head)  # 5. against the estimate
    assert "(of 2 runs)" in tiny_screen  # the consumer of both runs, under the tiny one
    wide = cli("producer", "status", "--run", "big", "--wide", env=env).stdout
    assert str(tmp_path / "big.jsonl") in wide and "  rejected: not_object" in wide
