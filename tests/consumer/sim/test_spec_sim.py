"""The stand-in speculates (consumer/sim/spec.py): acceptance drawn per request from a rate that
can differ by category, the figures in each answer as vLLM returns them and in /metrics' counters."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import aiohttp
import pytest
from click.testing import CliRunner

from genqueue.common.records import SpecFigures, spec_mean_length, spec_rate, sum_spec
from genqueue.consumer.answer import records
from genqueue.consumer.answer.completion import parse_completion
from genqueue.consumer.sim.kv import spec_yield
from genqueue.consumer.sim.server import SimConfig, SimServer, simulate_command
from genqueue.consumer.sim.spec import SpecMetrics, SpecRule, parse_rule
from tests.consumer.sim.test_simulate import _metrics_of, post
from tests.consumer.test_records import CTX, ITEM

STRONG, WEAK = 0.8, 0.4  # a draft's acceptance given those before it; the weak source's is half


def test_a_planted_weak_source_shows_in_the_records_at_its_planted_rate_and_metrics_sum_them() -> None:
    cfg = SimConfig(mean_tokens=80, spec_tokens=3, spec_acceptance=STRONG,
                    spec_acceptance_for=(parse_rule(f"text=[src=weak]:{WEAK}"),),
                    per_request_spec_decode_metrics=SpecMetrics.SUMMARY)

    async def main() -> tuple[dict[str, list[SpecFigures]], dict[str, float | None]]:
        by_source: dict[str, list[SpecFigures]] = defaultdict(list)
        async with SimServer(cfg) as sim, aiohttp.ClientSession() as s:
            before = await _metrics_of(s, sim)
            for i in range(300):
                source = "weak" if i % 2 else "strong"
                status, body = await post(s, sim, {"max_tokens": 200, "messages": [
                    {"role": "user", "content": f"question {i} [src={source}]"}]})
                assert status == 200
                base = records.record_base(CTX, {**ITEM, "source": source}, 1, [])
                rec = records.result_record(base, parse_completion(body), "m")
                by_source[rec["source"]].append(rec["spec"])  # every record carries figures
            after = await _metrics_of(s, sim)
        growth = {k: (after[k] or 0) - (before[k] or 0)
                  for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")}
        return by_source, growth

    by_source, growth = asyncio.run(main())
    total = sum_spec(by_source["strong"] + by_source["weak"])
    assert total is not None
    # vLLM's /metrics counters grow by exactly what the answers say
    assert growth == {"spec_drafts": total["steps"], "spec_draft_tokens": total["drafted"],
                      "spec_accepted_tokens": total["accepted"]}
    for source, p in (("strong", STRONG), ("weak", WEAK)):
        figures = sum_spec(by_source[source])
        assert figures is not None and len(by_source[source]) == 150
        planted = spec_yield(3, p) / 3  # the expected draft acceptance rate of the chain
        assert spec_rate(figures) == pytest.approx(planted, rel=0.05), source
        assert spec_mean_length(figures) == pytest.approx(1 + spec_yield(3, p), rel=0.05), source
    weak, strong = sum_spec(by_source["weak"]), sum_spec(by_source["strong"])
    assert weak is not None and strong is not None
    assert (spec_rate(weak) or 0) < 0.4 * (spec_rate(strong) or 1)


def test_long_answers_can_be_the_weak_category_and_detailed_adds_the_steps() -> None:
    cfg = SimConfig(mean_tokens=60, spec_tokens=2, spec_acceptance=0.9,
                    spec_acceptance_for=(SpecRule(0.0, min_tokens=50),),
                    per_request_spec_decode_metrics=SpecMetrics.DETAILED)

    async def main() -> list[dict]:
        async with SimServer(cfg) as sim, aiohttp.ClientSession() as s:
            return [(await post(s, sim, {"max_tokens": 200, "messages": [
                {"role": "user", "content": f"q {i}"}]}))[1] for i in range(40)]

    bodies = asyncio.run(main())
    longs = shorts = 0
    for body in bodies:
        block, n = body["metrics"]["speculative_decoding"], body["usage"]["completion_tokens"]
        assert len(block["per_step_accepted"]) == block["num_spec_steps"] == len(block["per_step_drafted"])
        if n >= 50:
            longs += 1
            assert block["num_accepted_draft_tokens"] == 0 and block["num_spec_steps"] == n - 1
        else:
            shorts += 1
            assert block["num_accepted_draft_tokens"] > 0 or n <= 2
    assert longs and shorts


def test_a_malformed_rule_is_one_line_and_no_speculation_is_no_figures() -> None:
    result = CliRunner().invoke(simulate_command, ["--spec-acceptance-for", "source=a:0.5"])
    assert result.exit_code == 2 and "'source=a:0.5' is not text=SUBSTR:P or tokens>=N:P" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(ValueError):
        parse_rule("tokens>=10:1.5")

    async def main() -> tuple[dict, dict]:
        async with SimServer(SimConfig(mean_tokens=20, per_request_spec_decode_metrics=SpecMetrics.SUMMARY)) as sim, \
                aiohttp.ClientSession() as s:
            return (await post(s, sim, {"messages": [{"role": "user", "content": "q"}]}))[1], await _metrics_of(s, sim)

    body, metrics = asyncio.run(main())
    assert "metrics" not in body and parse_completion(body).spec is None and metrics["spec_decode"] is False
