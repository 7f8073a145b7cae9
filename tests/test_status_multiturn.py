"""`producer status` against `producer export` of a regenerate run through tool turns, on the
stand-in (`consumer simulate --tool-calls recorded|diverge`), real Redis, every process a
subprocess.

What it proves: status answers "how were multi-turn conversations handled" with export's words
and export's counts (conversations complete, partial, cut; tool turns regenerated to the end,
stopped at a divergence, stopped at a tool turn), on its screen at 100 columns and in --json;
and status's identities (tests/test_status_screen.check_identities) hold at every sample taken
while the run goes.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim
from tests.consumer.test_tool_regen import TOOLS, agentic, call
from tests.test_status_screen import check_identities, sample

pytestmark = pytest.mark.integration

AGENTIC, PLAIN, UNANSWERED = 40, 12, 3
#: What export and status both count, under the same --json keys.
SHARED = ("complete", "partial", "cut", "failed", "tool_turns_to_end", "tool_call_diverged", "stopped_at_tool_turn")


def unanswered(i: int) -> dict[str, Any]:
    """A recorded tool call whose results were never recorded: the producer cuts it there."""
    return {"id": f"u{i}", "tools": TOOLS, "messages": [
        {"role": "user", "content": f"one {i}"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "two [call=clock:{}]"},
        {"role": "assistant", "content": "", "tool_calls": [call("clock", "{}", "o")]}]}


@pytest.mark.parametrize("mode", ["diverge", pytest.param("recorded", marks=pytest.mark.slow)])  # 13 s, 20 s
def test_status_says_what_export_says_of_tool_turns_and_holds_its_identities_meanwhile(
        tmp_path: Path, redis_url: str, conn: redis.Redis, mode: str) -> None:
    env = {"REDIS_URL": redis_url}
    run = f"mt-{mode}"
    records: list[object] = ([agentic(i) for i in range(AGENTIC)] + [sharegpt(i, turns=2) for i in range(PLAIN)]
               + [unanswered(i) for i in range(UNANSWERED)])
    data = write_jsonl(tmp_path / f"{run}.jsonl", records)
    cli("producer", "enqueue", str(data), "--run", run, "--output", str(tmp_path / "out"), "--batch-size", "4",
        "--max-tokens", "512", "--rejects", str(tmp_path / "rej.jsonl"), env=env)
    # answers of ~0.3 s, five of them one after the other in an agentic conversation: the run
    # lasts seconds, however fast the machine
    sim = Sim(tmp_path, "--mean-tokens", "30", "--step-time", "0.01", "--tool-calls", mode)
    try:
        c = Proc("consumer", ["run", "--run", run, "--endpoint", sim.url, "--burst", "-c", "8",
                              "--spool", str(tmp_path / "spool"), "--shard-max-age", "1"], tmp_path / "c.log", env=env)
        samples = mid_run = 0
        deadline = time.monotonic() + 120
        while c.p.poll() is None and time.monotonic() < deadline:
            [r] = sample(conn, (run,))
            check_identities(r)
            samples += 1
            mid_run += r["items_done"] + r["items_failed"] < r["items"]
            time.sleep(0.1)
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    assert mid_run >= 5, (samples, mid_run)  # the identities were checked while the run went

    status = orjson.loads(cli("producer", "status", "--run", run, "--json", env=env).stdout)
    check_identities(status)
    exported = orjson.loads(cli("producer", "export", "--run", run, "-o", str(tmp_path / "a.jsonl"), "--json",
                                env=env).stdout)
    assert {k: status[k] for k in SHARED} == {k: exported[k] for k in SHARED}, (status, exported)
    assert status["done"] == exported["enqueued"] == AGENTIC + PLAIN + UNANSWERED
    to_end, diverged, stopped = status["tool_turns_to_end"], status["tool_call_diverged"], status["stopped_at_tool_turn"]
    if mode == "recorded":  # to the end, unless an answer after tool results was cut (a step stopped)
        assert diverged == 0 and to_end + stopped == AGENTIC + UNANSWERED and to_end >= AGENTIC // 2, status
    else:  # each agentic conversation's first call diverges
        assert (to_end, diverged, stopped) == (0, AGENTIC, UNANSWERED), status
    assert status["input"]["multi_turn_records"] == AGENTIC + PLAIN + UNANSWERED

    # the same words and counts on both screens; status's at 100 columns
    screen = cli("producer", "status", "--run", run, env=env).stdout
    human = cli("producer", "export", "--run", run, "-o", str(tmp_path / "b.jsonl"), env=env).stdout
    assert all(len(line) <= 100 for line in screen.splitlines()), screen
    tools = (to_end, diverged, stopped)
    assert "{} regenerated to the end, {} stopped at a divergence, {} stopped at a tool turn".format(*tools) in screen
    whole = ("{} regenerated to the end, {} stopped at a divergence (tool_call_diverged), {} stopped at a tool "
             "turn for another reason").format(*tools)
    assert whole in human, human
    assert whole in cli("producer", "status", "--run", run, "--wide", env=env).stdout  # export's phrase, whole
    for word in ("complete", "partial", "cut"):
        assert f"{word} {status[word]}" in screen, (word, screen)
        assert re.search(rf"^ +{word} +{status[word]} ", human, re.MULTILINE), (word, human)
    head = "\n".join(screen.splitlines()[:8])
    assert f"{AGENTIC + PLAIN + UNANSWERED} of {AGENTIC + PLAIN + UNANSWERED} records have more than one user turn" \
        in head and " generated; conversations complete " in head and " stopped at a divergence, " in head
