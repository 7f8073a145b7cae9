"""The end of a run on a fleet: no engine sits idle while another consumer holds items it has
not sent (README, `consumer run`, "The end of a run"). Real redis-server, two stand-ins over
HTTP (one four times slower), one consumer process each.

Both engines' own counters are sampled while the run ends: the moment the fast engine last had
every slot busy (after it, it had a slot free for good) and the moment the slow engine last
received a request. Without giving back, the slow consumer still holds about half its slots'
worth of items then and sends them one by one as its slow slots free up, for about half a slow
request's time; with it, those jobs go to the fast consumer.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from genqueue.consumer.work.book import Book
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results
from tests.doubles import job

ITEMS = 240
SLOTS = 32
#: Seconds the slow engine may go on receiving requests after the fast one has a slot free for
#: good: a look for a call for work (every 0.5 s), the idle one's next ask (0.2 s), and the rest of
#: the job the slow one had started (jobs of 2: at most 1 item, a slow slot freeing every
#: ~0.25 s), with room for a loaded machine. Without giving back it is about 4 s (it holds 16-18
#: items unsent).
BOUND = 2.0


def test_only_jobs_with_nothing_sent_can_be_given_back() -> None:
    book: Book[object] = Book()
    a, b, c = job("a", 2, run="r"), job("b", 2, run="r"), job("c", 2, run="other")
    for js in (a, b, c):
        book.hold(js)
    assert book.unsent("r") == [a, b]
    taken = book.take()
    assert taken is not None and taken[0] is a  # one item of a is on its way: a stays here
    assert book.unsent("r") == [b]
    book.abandon(b)  # given back
    assert book.unsent("r") == [] and book.pending_of("r") == 1


def stats(sim: Sim) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{sim.port}/sim/stats", timeout=2) as r:
        return json.loads(r.read())


@pytest.mark.slow
@pytest.mark.integration
def test_fast_consumer_is_not_idle_while_the_slow_one_holds_unsent_items(tmp_path, redis_url):
    fast = Sim(tmp_path, "--slots", str(SLOTS), "--step-time", "0.02", "--mean-tokens", "100", "--seed", "1")
    (tmp_path / "slow").mkdir()
    slow = Sim(tmp_path / "slow", "--slots", str(SLOTS), "--step-time", "0.08", "--mean-tokens", "100",
               "--seed", "2")
    env = {"REDIS_URL": redis_url}
    data = write_jsonl(tmp_path / "d.jsonl", [sharegpt(i) for i in range(ITEMS)])
    cli("producer", "enqueue", str(data), "--run", "t", "--output", str(tmp_path / "out"), "--batch-size", "2",
        "--max-tokens", "250", "--rejects", str(tmp_path / "rej.jsonl"), env=env)
    samples: list[tuple[float, dict, dict]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.monotonic(), stats(fast), stats(slow)))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    procs = []
    try:
        sampler.start()
        for name, sim in (("fast", fast), ("slow", slow)):
            procs.append(Proc("consumer", ["-v", "run", "--run", "t", "--endpoint", sim.url, "--burst",
                                           "--spool", str(tmp_path / f"spool-{name}"), "--shard-max-age", "1",
                                           "-c", str(SLOTS)], tmp_path / f"{name}.log", env=env))
        for p in procs:
            assert p.wait(120) == 0, p.output()[-3000:]
    finally:
        done.set()
        sampler.join(5)
        for p in procs:
            p.signal(15)
        fast.stop()
        slow.stop()
    assert len({r["key"] for r in read_results(tmp_path / "out", "t")}) == ITEMS
    full = [t for t, f, _ in samples if f["running"] >= SLOTS]
    assert full, "the fast engine never had all its slots busy"
    fast_free = full[-1]
    last_req = max(s["requests"] for _, _, s in samples)
    slow_last = min(t for t, _, s in samples if s["requests"] == last_req)
    gave_back = "here given back" in procs[1].output()
    print(f"fast engine has a slot free for good at {fast_free - samples[0][0]:.2f} s; the slow one receives its "
          f"last request at {slow_last - samples[0][0]:.2f} s ({slow_last - fast_free:+.2f} s); slow consumer "
          f"gave jobs back: {gave_back}")
    assert slow_last - fast_free <= BOUND
