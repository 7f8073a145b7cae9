"""`producer status` figures that contradicted each other, each as a test (real Redis, real
marking script): a finished run's rate, a gone consumer's verdicts, one ETA, acceptance named."""

from __future__ import annotations

import redis

from genqueue.producer.status import format_status, run_status
from tests.producer.status.conftest import RUN, make_run, ship, snapshot


def test_a_finished_runs_rate_is_what_it_did_not_one_that_decays(conn: redis.Redis) -> None:
    # was: "run 59.2 items/s", then "run 0.2 items/s" eighteen minutes later (items over the time
    # since the first job, until now); now: "run over in 1m 00s: 10.0 items/s ..." at every look
    now = conn.time()[0]
    keys = make_run(conn, 600, started_at=now - 60)
    ship(conn, keys)
    first = run_status(conn, RUN)
    later = run_status(conn, RUN, now=first["now"] + 18 * 60)
    for r in (first, later):
        avg = r["speed"]["run_average"]
        assert avg["completions_per_s"] is not None and 9.0 <= avg["completions_per_s"] <= 11.0, avg
        assert 55 <= (r["speed"]["run_seconds"] or 0) <= 66, r["speed"]
    assert later["speed"]["run_average"] == first["speed"]["run_average"]
    line = next(x for x in format_status(later, color=False).splitlines() if x.startswith("speed"))
    assert line.startswith("speed       run over in 1m ") and "items/s" in line and "last minute" not in line, line


def test_a_consumer_that_has_gone_keeps_no_present_tense_verdict(conn: redis.Redis) -> None:
    # was: "exited 5m 00s ago  2.0/s  606 tok/s" and under it "engine: genqueue binds: the consumer
    # is out of work" (after a Ctrl-C), or "... 1 long request(s) run alone ..., for 26 s so far";
    # now: "exited 5m 00s ago", nothing of what it no longer does
    now = conn.time()[0]
    keys = make_run(conn, 10, started_at=now - 600)
    ship(conn, keys[:5])
    runs = {RUN: {"completions_per_s": 2.0, "completion_tokens_per_s": 606.0, "in_flight": 3}}
    engine = {"metrics": True, "running": 1.0, "waiting": 0.0, "spec_decode": False,
              "advice": "genqueue binds: the consumer is out of work (queue empty; 3 in flight)",
              "notes": ["the run's tail: 1 long request(s) run alone (batch was 16), for 26 s so far"]}
    snapshot(conn, "gone", now - 300, exited=True, runs=runs, engine=engine)
    snapshot(conn, "here", now - 1, runs=runs, engine=engine)
    text = format_status(run_status(conn, RUN, now=now), color=False, width=None)
    gone = [x for x in text.splitlines() if "gone" in x]
    assert gone == ["  gone  gpu 0  exited 5m 00s ago"], gone
    assert text.count("genqueue binds") == 1 and text.count("so far") == 1  # the live one's alone
    assert "here  gpu 0  live  2.0/s  606 tok/s" in text


def test_one_eta_and_one_acceptance_figure_per_scope_each_named(conn: redis.Redis) -> None:
    # was: "ETA 3m 38s at ..." beside "estimate ...; at 606 tok/s: 5m 37s"; and `spec 0.52`,
    # "engines c1 44%" and "speculation 48% of draft tokens accepted" with no scope; now one ETA,
    # "acceptance (run, all consumers) 48%", "acceptance (each consumer, this run) c1 44%", `spec on`
    now = conn.time()[0]
    keys = make_run(conn, 100, started_at=now - 100)
    conn.hset(f"genqueue:run:{RUN}:sources", "in.jsonl", b'{"records": 100, "complete": true, '
              b'"estimated_output_tokens": 20000, "source_seq": 0}')
    tally = _tally(steps=10, drafted=25, accepted=12)  # 48% over 40 answers
    ship(conn, keys[:40], spec=tally)
    runs = {RUN: {"completions_per_s": 1.0, "completion_tokens_per_s": 100.0, "prompt_tokens_per_s": 50.0,
                  "completions": 40, "completion_tokens": 4000,
                  "spec": {"answers": 40, "steps": 400, "drafted": 1000, "accepted": 440}}}  # 44%
    engine = {"metrics": True, "running": 4.0, "waiting": 0.0, "spec_decode": True, "spec_acceptance": 0.52}
    snapshot(conn, "c1", now - 1, runs=runs, engine=engine)
    r = run_status(conn, RUN)
    text = format_status(r, color=False)
    assert text.count("ETA") == 1 and "tok/s:" not in text, text
    assert "acceptance (run, all consumers) 48%" in text, text
    assert "acceptance (each consumer, this run)  c1 44%" in text, text
    assert "0.52" not in text and "52%" not in text and "spec on" in text, text
    # every acceptance figure on the screen says whose it is
    for line in text.splitlines():
        if "%" in line and ("acceptance" in line or "spec" in line):
            assert "acceptance (" in line or "drafter weakest" in line or line.lstrip().startswith(
                ("by ", "source", "variant", "turn", "length")) or line.startswith("    "), line


def _tally(*, steps: int, drafted: int, accepted: int) -> str:
    """The acceptance tallies argument of an item whose one answer has these figures."""
    from genqueue.common.keepers.spectally import SpecTallies

    rec = {"key": "0" * 32, "source": "in.jsonl", "turn": 0, "messages": [{"role": "user", "content": "q"}],
           "usage": {"completion_tokens": 100},
           "spec": {"k": 3, "steps": steps, "drafted": drafted, "accepted": accepted, "hist": [0, 0, 0, 0]}}
    return SpecTallies.argument(rec)
