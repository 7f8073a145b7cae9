"""A job given back by a draining consumer and taken by another is its second attempt: its
records say attempt 2 (they said 1: a give-back spends no retry, and the attempt was counted
from retries alone). Real redis-server, the stand-in vLLM, consumer CLIs as subprocesses."""

from __future__ import annotations

import re

import pytest
from rq.job import Job

from genqueue.common.keepers.rqaccess import SERIALIZER
from genqueue.consumer.rqcompat import GIVEN_BACK_FIELD
from tests.consumer.e2e import Sim, read_results
from tests.consumer.test_sigterm import DRAIN, SLACK, busy, held, start, stop_within

pytestmark = pytest.mark.integration


@pytest.mark.slow  # 11 s: in the slow tier, which CI runs too
def test_records_of_a_job_given_back_and_taken_again_say_attempt_2(tmp_path, redis_url, conn):
    sim, a = busy(tmp_path, redis_url, conn, "again")
    try:
        code, _ = stop_within(a, DRAIN + SLACK + 10)
    finally:
        sim.stop()
    assert code == 0, a.output()
    assert held(conn, "again") == 0
    queued = [j.decode() for j in conn.lrange("rq:queue:genqueue.again", 0, -1)]
    back = {jid for jid in queued if int(conn.hget(f"rq:job:{jid}", GIVEN_BACK_FIELD) or 0) == 1}
    assert back, f"the drain gave no job back: nothing to test\n{a.output()}"
    keys_back = {it["key"] for jid in back for it in Job.fetch(jid, connection=conn, serializer=SERIALIZER).args[0]}
    (tmp_path / "fast").mkdir()
    fast = Sim(tmp_path / "fast", "--slots", "8", "--step-time", "0.002", "--mean-tokens", "20")
    try:
        b = start(tmp_path, redis_url, fast.url, "--run", "again", "--burst", "-c", "8", name="b")
        assert b.wait(120) == 0, b.output()
    finally:
        fast.stop()
    found = re.search(r"consumer (\S+) started", b.output())
    assert found, b.output()
    by_b = [r for r in read_results(tmp_path / "out", "again") if r["consumer"]["worker"] == found[1]]
    attempts = {r["attempt"] for r in by_b if r["key"] in keys_back}
    assert attempts == {2}, (attempts, b.output()[-2000:])
    # jobs never given back (still queued untouched after the drain) stay at attempt 1
    assert {r["attempt"] for r in by_b if r["key"] not in keys_back} <= {1}
