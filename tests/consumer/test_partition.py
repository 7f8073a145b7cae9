"""Redis unreachable for twice the lease (a partition, not a restart), then back: the run
completes without anyone's help. Real redis-server, real consumer processes, a TCP proxy the
test controls between one consumer and Redis; another consumer talks to Redis directly and
sweeps the cut-off one's leases meanwhile. In both prompt modes (issue 34): by reference the
consumers read the jobs' items from the run's packs in its output, through the pack cache."""

from __future__ import annotations

import re
import signal
import time
from urllib.parse import urlparse

import pytest

from tests.conftest import Prompts, both_modes_reference_slow, cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results, run_keys
from tests.netproxy import TcpProxy

pytestmark = pytest.mark.integration

LEASE = 3


def _consumer(tmp_path, url, sim, name, *extra):
    return Proc("consumer", ["-v", "run", "--run", "part", "--endpoint", sim.url, "--burst", "--lease", str(LEASE),
                             "--shard-max-age", "1", "--spool", str(tmp_path / f"spool-{name}"), *extra],
                tmp_path / f"{name}.log", env={"REDIS_URL": url})


@pytest.mark.parametrize("cut", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["connections-reset", "half-open"])
@both_modes_reference_slow
def test_a_partition_longer_than_the_lease_heals_by_itself(tmp_path, redis_url, conn, cut, prompts_mode: Prompts):
    data = write_jsonl(tmp_path / "part.jsonl", [sharegpt(i) for i in range(120)])
    cli("producer", "enqueue", str(data), "--run", "part", "--output", str(tmp_path / "out"), "--batch-size", "4",
        "--max-tokens", "64", "--rejects", str(tmp_path / "rej.jsonl"), *prompts_mode.args,
        env={"REDIS_URL": redis_url})
    port = urlparse(redis_url).port
    assert port is not None
    proxy = TcpProxy(port)
    sim = Sim(tmp_path, "--slots", "8", "--step-time", "0.01", "--mean-tokens", "40")
    try:
        cut_off = _consumer(tmp_path, f"redis://{proxy.url_host_port}/0", sim, "cutoff", "-c", "8")
        time.sleep(3)
        proxy.blackhole()
        direct = _consumer(tmp_path, redis_url, sim, "direct", "-c", "8")
        time.sleep(2 * LEASE)
        proxy.forward(cut=cut)
        codes = (cut_off.wait(120), direct.wait(120))
    finally:
        for p in ("cut_off", "direct"):
            proc = locals().get(p)
            if proc is not None and proc.p.poll() is None:
                proc.signal(signal.SIGKILL)
        sim.stop()
        proxy.close()
    assert codes == (0, 0), cut_off.output()[-3000:] + direct.output()[-3000:]
    recs = read_results(tmp_path / "out", "part")
    assert run_keys(conn, "part") <= {r["key"] for r in recs}, "every item has a record"
    assert not [r for r in recs if "error" in r]
    q = "genqueue.part"
    assert conn.llen(f"rq:queue:{q}") == 0 and conn.zcard(f"rq:wip:{q}") == 0
    assert conn.llen(f"rq:queue:{q}:intermediate") == 0
    assert conn.zcard(f"rq:failed:{q}") == 0
    log = cut_off.output()
    assert "Redis unreachable" in log and "Redis answers again" in log, log[-3000:]
    lost = sum(int(n) for n in re.findall(r"(\d+) lease\(s\) lost", log))  # consumer/work/leases.py's line
    print(f"{prompts_mode}: records {len(recs)} for {len(run_keys(conn, 'part'))} items; "
          f"lost leases noticed: {lost}")
