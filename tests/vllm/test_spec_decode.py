"""Speculative decoding against real vLLM (issue 33): the tiny model served with n-gram
speculation (no draft model) and `--per-request-spec-decode-metrics summary`. Every record (every
regenerated turn) carries the engine's own figures, and their accepted draft tokens add up to the
growth of vLLM's own `vllm:spec_decode_num_accepted_tokens` counter over the run; a run against an
engine without speculation records none and runs as before."""

from __future__ import annotations

import re

import orjson

from genqueue.common.keepers.spectally import SpecTallies
from genqueue.common.records import spec_mean_length, spec_rate, sum_spec
from genqueue.consumer.engine.readings import parse_prometheus
from tests.conftest import cli, sharegpt
from tests.vllm.conftest import VllmPool, VllmServer
from tests.vllm.pipeline import assert_all_done, consume, enqueue, results

SPEC = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3,"prompt_lookup_min":1}'
# temperature 0: the same answers each run, and the second turns repeat enough of the history for
# the n-gram drafter to have drafts accepted (at the default temperature the tiny model's few
# drafts were all rejected, and an equality of zeros proves little)
SYSTEM = "Repeat the question back. " * 4
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")
GENERATED = "vllm:generation_tokens_total"
#: the pre-flight probe is answered by the engine too: its figures are in the consumer's log
PROBE = re.compile(r"the probe's answer: (\d+) of (\d+) draft tokens accepted in (\d+) steps")


def _counters(vllm: VllmServer) -> dict[str, float]:
    m = parse_prometheus(vllm.get_text("/metrics"))
    return {name: m[name] for name in (*COUNTERS, GENERATED)}


def test_every_record_carries_the_engines_figures_and_they_add_up_to_its_counter(tmp_path, redis_url, conn,
                                                                                   vllm_pool: VllmPool):
    vllm = vllm_pool.get("--speculative-config", SPEC, "--per-request-spec-decode-metrics", "summary")
    records = [sharegpt(i, turns=2, system=SYSTEM) for i in range(4)]
    enqueue(tmp_path, redis_url, "spec", records, "--max-tokens", "48", "--temperature", "0")
    before = _counters(vllm)
    c = consume(tmp_path, redis_url, vllm.url, "spec", "-c", "4")
    after = _counters(vllm)
    recs = results(tmp_path, "spec")
    assert_all_done(conn, "spec", recs, jobs=1)
    log = c.output()
    probe = PROBE.search(log)
    assert probe is not None, log
    assert "the engine speculates, 3 draft tokens per step" in log
    print("\nitem turn | tokens | steps drafted accepted | mean length | rate | hist")
    for r in sorted(recs, key=lambda r: r["index"]):
        assert len(r["turns"]) == 2
        for t in r["turns"]:
            s = t["spec"]  # every regenerated turn carries the engine's own figures
            assert s["k"] == 3 and len(s["hist"]) == 4 and sum(s["hist"]) == s["steps"]
            length, rate = spec_mean_length(s), spec_rate(s)
            print(f"{r['index']:>4} {t['turn']:>4} | {t['usage']['completion_tokens']:>6} | {s['steps']:>5} {s['drafted']:>7} {s['accepted']:>8} | "
                  f"{'-' if length is None else f'{length:.2f}':>11} | {'-' if rate is None else f'{rate:.2f}':>4} | "
                  f"{s['hist']}")
        assert r["spec"] == sum_spec([t["spec"] for t in r["turns"]])
    total = sum_spec([r["spec"] for r in recs])
    assert total is not None
    assert total["accepted"] > 0, "no draft accepted: the counter check below would compare zeros"
    accepted, drafted, steps = (int(g) for g in probe.groups())
    growth = {name: after[name] - before[name] for name in COUNTERS}
    print(f"records: {total['accepted']} of {total['drafted']} draft tokens accepted in {total['steps']} steps; "
          f"pre-flight probe: {accepted} of {drafted} in {steps}; vLLM's counters grew by {growth}")
    # the records and the probe are everything the engine answered in the run
    assert growth["vllm:spec_decode_num_accepted_tokens_total"] == total["accepted"] + accepted
    assert growth["vllm:spec_decode_num_draft_tokens_total"] == total["drafted"] + drafted
    assert growth["vllm:spec_decode_num_drafts_total"] == total["steps"] + steps
    # the run's tallies (counted as shards ship, once per item) and `producer status` say the same
    shipped = SpecTallies(conn).table("spec").overall
    assert (shipped.answers, shipped.drafted, shipped.accepted, shipped.steps) == (
        8, total["drafted"], total["accepted"], total["steps"])
    view = orjson.loads(cli("producer", "status", "--run", "spec", "--json", env={"REDIS_URL": redis_url}).stdout)
    assert view["speculation"]["drafted"] == total["drafted"] and view["speculation"]["accepted"] == total["accepted"]
    assert {row["category"] for row in view["speculation"]["by"]["turn"]} == {"1", "2"}
    # the doctor reads k from the same counters: draft tokens / drafts is num_speculative_tokens
    from genqueue.consumer.engine.doctor import DoctorSettings
    from genqueue.consumer.engine.speculation import judge_spec

    drafts, accepted = growth["vllm:spec_decode_num_drafts_total"], growth["vllm:spec_decode_num_accepted_tokens_total"]
    k = round(growth["vllm:spec_decode_num_draft_tokens_total"] / drafts)
    generated = after[GENERATED] - before[GENERATED]
    share = drafts / (generated - accepted)  # n-gram drafts only where the text repeats: few steps
    j = judge_spec(k, accepted / drafts, 4, DoctorSettings(), share)
    print(f"{generated:.0f} tokens generated; the doctor's judgement at a batch of 4: {j.advice}")
    assert k == 3 and j.k == 3 and 0.0 <= j.acceptance <= 1.0 and 0.0 < share <= 1.0


def test_a_run_without_speculation_records_none(tmp_path, redis_url, conn, vllm):
    enqueue(tmp_path, redis_url, "nospec", [sharegpt(i, turns=2, system=SYSTEM) for i in range(3)],
            "--max-tokens", "32")
    c = consume(tmp_path, redis_url, vllm.url, "nospec", "-c", "4")
    recs = results(tmp_path, "nospec")
    assert_all_done(conn, "nospec", recs, jobs=1)
    assert all("spec" not in r and all("spec" not in t for t in r["turns"]) for r in recs)
    assert not conn.exists(SpecTallies.key("nospec"))  # nothing tallied: status shows no section
    assert all(r["outcome"] in ("finished", "cut_in_answer", "cut_in_thinking") for r in recs)
    assert "the engine does not speculate (no spec_decode counters on its /metrics)" in c.output()


def _questions(prefix: str, n: int, repeating: bool) -> list[dict[str, object]]:
    """N three-turn conversations: REPEATING ones ask for a line to be repeated (the n-gram
    drafter's home ground), the others are word salad."""
    import random

    rng = random.Random(prefix)
    words = ["the", "of", "and", "to", "in", "is", "you", "that", "it", "was", "for", "on", "are", "as", "with", "his", "they", "at", "be", "this", "have", "from"]
    out: list[dict[str, object]] = []
    for i in range(n):
        conv: list[dict[str, str]] = []
        for _ in range(3):
            if repeating:
                line = " ".join(rng.choice(words[:6]) for _ in range(6))
                q = f"Repeat this line four times: {line} {line} {line}"
            else:
                q = " ".join(rng.choice(words) for _ in range(30)) + "?"
            conv += [{"from": "human", "value": q}, {"from": "gpt", "value": "old"}]
        out.append({"id": f"{prefix}{i}", "conversations": conv})
    return out


def test_acceptance_by_source_and_turn_agrees_in_status_export_and_the_drafter_report(
        tmp_path, redis_url, conn, vllm_pool: VllmPool):
    """Two sources of three-turn conversations regenerated with n-gram speculation: the table by
    source and turn is the same whether status (the tallies), export (its card's figures) or the
    drafter report (the records alone) builds it, and adds up to vLLM's own counter; export's
    --keep-lowest-acceptance keeps the rows of lowest rate. `pytest -s` prints the table and the
    rows kept."""
    from tests.conftest import write_jsonl

    vllm = vllm_pool.get("--speculative-config", SPEC, "--per-request-spec-decode-metrics", "summary")
    env = {"REDIS_URL": redis_url}
    sampling = ("--max-tokens", "96", "--temperature", "0", "--sampling-json", '{"min_tokens": 64}')
    enqueue(tmp_path, redis_url, "acc", _questions("rep", 8, True), *sampling)
    varied = write_jsonl(tmp_path / "varied.jsonl", _questions("var", 8, False))
    cli("producer", "enqueue", str(varied), "--run", "acc", "--output", str(tmp_path / "out"), "--batch-size", "8",
        *sampling, env=env)
    before = _counters(vllm)
    consume(tmp_path, redis_url, vllm.url, "acc", "-c", "8")
    after = _counters(vllm)
    recs = results(tmp_path, "acc")
    assert_all_done(conn, "acc", recs, jobs=2)
    total = sum_spec([r["spec"] for r in recs])
    assert total is not None and total["accepted"] > 0
    growth = after["vllm:spec_decode_num_accepted_tokens_total"] - before["vllm:spec_decode_num_accepted_tokens_total"]
    assert total["accepted"] <= growth  # the rest is the pre-flight probe's

    status = orjson.loads(cli("producer", "status", "--run", "acc", "--json", env=env).stdout)["speculation"]
    report = orjson.loads(cli("producer", "drafter-report", str(tmp_path / "out" / "acc"), "--json").stdout)
    out = tmp_path / "ds" / "acc.jsonl"
    out.parent.mkdir()
    card = orjson.loads(cli("producer", "export", "--run", "acc", "-o", str(out), "--include-outcomes", "all",
                            "--json", env=env).stdout.splitlines()[-1])["acceptance"]

    def table(by: dict[str, list[dict[str, object]]], facet: str) -> dict[str, tuple[object, ...]]:
        return {str(c["category"]): (c["answers"], c["drafted"], c["accepted"]) for c in by[facet]}

    print("\nfacet   category       answers  drafted accepted   rate  mean len")
    for facet in ("source", "turn"):
        st = table(status["by"], facet)
        assert st == table(card["by"], facet)
        assert st == {str(r["category"]): (r["candidate"]["answers"], r["candidate"]["drafted"],
                                           r["candidate"]["accepted"])
                      for r in report["by"][facet] if r["candidate"]}
        for c in status["by"][facet]:
            name = str(c["category"]).rsplit("/", 1)[-1]
            print(f"{facet:<7} {name:<14} {c['answers']:>7} {c['drafted']:>8} {c['accepted']:>8} "
                  f"{c['rate'] or 0:>6.1%} {c['mean_length'] or 0:>9.2f}")

    lowest = tmp_path / "ds" / "lowest.jsonl"
    sel = orjson.loads(cli("producer", "export", "--run", "acc", "-o", str(lowest), "--include-outcomes", "all",
                           "--keep-lowest-acceptance", "0.25", "--json", env=env).stdout.splitlines()[-1])
    kept = [orjson.loads(line) for line in lowest.read_bytes().splitlines()]
    rates = sorted(r["acceptance"]["rate"] for r in (orjson.loads(x) for x in out.read_bytes().splitlines()))
    assert len(kept) == sel["selection"]["rows_kept"] == -(-len(rates) // 4)
    assert max(r["acceptance"]["rate"] for r in kept) <= rates[len(kept) - 1]
    print(f"--keep-lowest-acceptance 0.25 kept {len(kept)} of {len(rates)} rows:")
    for r in kept:
        print(f"  {r['id']:<6} {r['source'].rsplit('/', 1)[-1]:<14} rate {r['acceptance']['rate']:.3f} "
              f"mean len {r['acceptance']['mean_length']:.2f}")
