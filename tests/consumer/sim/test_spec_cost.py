"""The stand-in's step cost (consumer/sim/kv.step_cost): past --compute-knee tokens a step, a
verify step of B requests with k drafts takes time in proportion to B x (1 + k), so speculation
at a high batch costs what it yields; the defaults keep a step at --step-time."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from click.testing import CliRunner

from genqueue.consumer.sim.kv import step_cost
from genqueue.consumer.sim.server import SimConfig, SimServer, simulate_command
from tests.consumer.sim.test_simulate import post


def test_step_cost() -> None:
    assert step_cost(256, 3, 0, 0.0) == 1.0  # no knee (the default): as before
    assert step_cost(8, 3, 64, 0.0) == 1.0  # 32 tokens a step: under the knee
    assert step_cost(64, 4, 64, 0.0) == 5.0  # 320 tokens: 5 knees
    assert step_cost(64, 0, 64, 0.0) == 1.0 and step_cost(128, 0, 64, 0.0) == 2.0
    assert step_cost(8, 3, 64, 0.05) == pytest.approx(1.15)  # each draft's own pass
    assert SimConfig().compute_knee == 0 and SimConfig().draft_cost == 0.0


def _wall(cfg: SimConfig, n: int) -> float:
    """Seconds the stand-in takes to answer N requests at once (each 200 tokens, no length draw)."""
    async def main() -> float:
        async with SimServer(cfg) as sim, aiohttp.ClientSession() as s:
            t = time.monotonic()
            body = {"max_tokens": 200, "messages": [{"role": "user", "content": "q"}]}
            got = await asyncio.gather(*(post(s, sim, body) for _ in range(n)))
            assert all(status == 200 for status, _ in got)
            return time.monotonic() - t
    return asyncio.run(main())


def test_speculation_at_a_high_batch_past_the_knee_is_slower_than_without() -> None:
    base = dict(slots=64, step_time=0.005, mean_tokens=100000, kv_cache_tokens=10_000_000, compute_knee=64)
    plain = _wall(SimConfig(**base), 64)  # type: ignore[arg-type]
    spec = _wall(SimConfig(**base, spec_tokens=4, spec_acceptance=0.3), 64)  # type: ignore[arg-type]
    # 200 steps at 1 knee against 200 / 1.425 steps at 5 knees: ~3.5 times as long
    assert spec > 2 * plain, (plain, spec)
    # under the knee the drafts come free: 4 requests x 4 tokens a step, 2.95 tokens a step
    low = dict(slots=64, step_time=0.01, mean_tokens=100000, kv_cache_tokens=10_000_000, compute_knee=64)
    plain4 = _wall(SimConfig(**low), 4)  # type: ignore[arg-type]
    spec4 = _wall(SimConfig(**low, spec_tokens=3, spec_acceptance=0.8), 4)  # type: ignore[arg-type]
    assert spec4 < 0.6 * plain4, (plain4, spec4)


def test_the_options_reach_the_config() -> None:
    seen: list[SimConfig] = []

    async def fake(config: SimConfig, host: str, port: int) -> None:
        seen.append(config)

    from genqueue.consumer.sim import server
    mp = pytest.MonkeyPatch()
    mp.setattr(server, "_serve_forever", fake)
    try:
        r = CliRunner().invoke(simulate_command, ["--compute-knee", "64", "--draft-cost", "0.05"])
        bad = CliRunner().invoke(simulate_command, ["--compute-knee", "-1"])
    finally:
        mp.undo()
    assert r.exit_code == 0, r.output
    assert seen[0].compute_knee == 64 and seen[0].draft_cost == 0.05
    assert bad.exit_code == 2 and "--compute-knee" in bad.output
