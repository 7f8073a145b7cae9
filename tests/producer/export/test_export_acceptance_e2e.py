"""Export's selection by acceptance end to end (issue 33): a real Redis, `producer enqueue`, the
stand-in speculating over real HTTP with one source planted at half the acceptance of the
other, a real `consumer run --burst`, then `producer export` as a user runs it. The weak source
is named by the card and the summary at the planted rate, --keep-lowest-acceptance picks its
rows, --weight-by-acceptance weighs them higher; a run without speculation exports as before
and refuses both options. `pytest -s` prints the figures measured."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from genqueue.consumer.sim.kv import spec_yield
from genqueue.producer.export.stage import WEIGHT_COLUMN
from tests.conftest import cli, sharegpt, write_jsonl
from tests.consumer.e2e import Proc, Sim

pytestmark = pytest.mark.integration

K, STRONG, WEAK = 3, 0.8, 0.4
PER_SOURCE = 100
SHARE = 0.5


def _enqueue(tmp: Path, env: dict[str, str], run: str, path: Path) -> None:
    cli("producer", "enqueue", str(path), "--run", run, "--output", str(tmp / "out"), "--batch-size", "10",
        "--max-tokens", "400", "--rejects", str(tmp / f"{run}.rejects.jsonl"), env=env)


def _generate(tmp: Path, env: dict[str, str], run: str, *sim_args: str) -> None:
    sim = Sim(tmp, "--mean-tokens", "120", *sim_args)
    try:
        c = Proc("consumer", ["run", "--run", run, "--endpoint", sim.url, "--burst", "-c", "16",
                              "--spool", str(tmp / f"spool-{run}"), "--shard-max-age", "1"],
                 tmp / f"consumer-{run}.log", env=env)
        assert c.wait(180) == 0, c.output()
    finally:
        sim.stop()


def _export(env: dict[str, str], run: str, out: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # every outcome: an answer cut by max_tokens is a measurement of the drafter too
    return cli("producer", "export", "--run", run, "-o", str(out), "--include-outcomes", "all", *args, env=env,
               check=check)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def test_a_planted_weak_source_is_what_export_selects_and_weighs(tmp_path: Path, redis_url: str) -> None:
    env = {"REDIS_URL": redis_url}
    good = write_jsonl(tmp_path / "good.jsonl", [sharegpt(i) for i in range(PER_SOURCE)])
    weak = write_jsonl(tmp_path / "weak.jsonl", [{"id": f"w{i}", "conversations": [
        {"from": "human", "value": f"[weak] question {i}"}, {"from": "gpt", "value": "old"}]}
        for i in range(PER_SOURCE)])
    _enqueue(tmp_path, env, "spec", good)
    _enqueue(tmp_path, env, "spec", weak)
    _generate(tmp_path, env, "spec", "--spec-tokens", str(K), "--spec-acceptance", str(STRONG),
              "--spec-acceptance-for", f"text=[weak]:{WEAK}", "--per-request-spec-decode-metrics", "summary")
    planted = {str(good): spec_yield(K, STRONG) / K, str(weak): spec_yield(K, WEAK) / K}

    # every row carries its own answer's figures; the summary and the card table them by source
    full = tmp_path / "ds" / "all.jsonl"
    full.parent.mkdir()
    s = orjson.loads(_export(env, "spec", full, "--json").stdout)
    rows = _rows(full)
    assert len(rows) == 2 * PER_SOURCE and all(r["acceptance"]["drafted"] > 0 for r in rows)
    acc = s["acceptance"]
    assert acc["answers"] == 2 * PER_SOURCE
    by = {c["category"]: c for c in acc["by"]["source"]}
    measured = {src: by[src]["rate"] for src in planted}
    for src, rate in planted.items():
        assert measured[src] == pytest.approx(rate, rel=0.05), (src, measured, planted)
        assert by[src]["answers"] == PER_SOURCE
    assert acc["weakest"].startswith(f"drafter weakest on source {weak}: ")
    card = (full.parent / "README.md").read_text()
    for src in planted:
        assert f"| {src} | {PER_SOURCE} | {by[src]['rate']:.1%} | {by[src]['mean_length']:.2f} |" in card
    assert f"Weakest category: {acc['weakest']}." in card

    # the lowest-acceptance half is (nearly) all the weak source's rows
    low = tmp_path / "low" / "low.jsonl"
    low.parent.mkdir()
    s = orjson.loads(_export(env, "spec", low, "--keep-lowest-acceptance", str(SHARE), "--json").stdout)
    sel = s["selection"]
    kept = _rows(low)
    assert len(kept) == sel["rows_kept"] == int(SHARE * 2 * PER_SOURCE) and s["missing"] == 0
    assert sel["rows_left_out"] == 2 * PER_SOURCE - len(kept) and s["rows"] == len(kept)
    from_weak = sum(r["source"] == str(weak) for r in kept)
    assert from_weak >= 0.9 * len(kept), sel["by_source"]
    assert sel["by_source"][str(weak)]["kept"] == from_weak
    assert sel["rate_max"] == max(r["acceptance"]["rate"] for r in kept)
    text = _export(env, "spec", tmp_path / "low" / "again.jsonl", "--keep-lowest-acceptance", str(SHARE),
                   "--no-card").stdout
    assert f"{weak}: {from_weak:,} of {PER_SOURCE:,} rows kept" in text

    # weights: the weak source's rows weigh more
    weighted = tmp_path / "w" / "w.jsonl"
    weighted.parent.mkdir()
    _export(env, "spec", weighted, "--weight-by-acceptance", "--json", "--no-card")
    w = _rows(weighted)
    mean = {src: sum(r[WEIGHT_COLUMN] for r in w if r["source"] == src) / PER_SOURCE for src in planted}
    assert mean[str(weak)] > 1.5 * mean[str(good)], mean
    assert sum(r[WEIGHT_COLUMN] for r in w) / len(w) == pytest.approx(1.0, abs=1e-3)
    print("\n" + "\n".join(line for line in text.splitlines() if line.startswith(("acceptance", "selection", "  "))))
    print(f"\nplanted rate by source: {planted}\nmeasured by export: {measured}\n"
          f"--keep-lowest-acceptance {SHARE}: kept by source {sel['by_source']}, rates "
          f"{sel['rate_min']}-{sel['rate_max']}\n--weight-by-acceptance mean weight by source: {mean}")


def test_a_run_without_speculation_exports_as_before_and_refuses_selection(tmp_path: Path, redis_url: str) -> None:
    env = {"REDIS_URL": redis_url}
    _enqueue(tmp_path, env, "plain", write_jsonl(tmp_path / "plain.jsonl", [sharegpt(i) for i in range(20)]))
    _generate(tmp_path, env, "plain")
    out = tmp_path / "ds" / "plain.jsonl"
    out.parent.mkdir()
    s = orjson.loads(_export(env, "plain", out, "--json").stdout)
    rows = _rows(out)
    assert len(rows) == 20 and not any("acceptance" in r or WEIGHT_COLUMN in r for r in rows)
    assert s["acceptance"] == {} and s["selection"] == {}
    assert "Speculative decoding" not in (out.parent / "README.md").read_text()
    for opt in (["--keep-lowest-acceptance", "0.5"], ["--weight-by-acceptance"]):
        proc = _export(env, "plain", tmp_path / "ds" / "sel.jsonl", *opt, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "carries speculative-decoding figures" in proc.stderr
        assert not (tmp_path / "ds" / "sel.jsonl").exists()


def test_after_selection_the_summary_and_the_card_count_what_was_exported(tmp_path: Path, redis_url: str) -> None:
    """--keep-lowest-acceptance leaves rows out: the summary's rows, items and traces kept, the
    card's table and its pictures' count are those of the rows in the file, one count of them."""
    env = {"REDIS_URL": redis_url}
    _enqueue(tmp_path, env, "sel", write_jsonl(tmp_path / "sel.jsonl", [sharegpt(i, turns=1 + i % 3)
                                                                       for i in range(60)]))
    _generate(tmp_path, env, "sel", "--reasoning", "field", "--spec-tokens", str(K), "--per-request-spec-decode-metrics",
              "summary")
    out = tmp_path / "ds" / "sel.jsonl"
    out.parent.mkdir()
    s = orjson.loads(_export(env, "sel", out, "--keep-lowest-acceptance", "0.3", "--json").stdout)
    rows = _rows(out)
    items = {r["key"] for r in rows}
    traces = sum(1 for r in rows if (r["messages"][-1].get("reasoning_content") or "").strip())
    assert s["selection"]["rows_left_out"] > 0 and len(items) < 60  # the selection left whole items out
    assert s["rows"] == s["generation_rows"] == s["selection"]["rows_kept"] == len(rows)
    assert s["exported"] == len(items)
    assert s["traces_kept_generation"] == traces < s["traces"]
    assert s["card"]["rows"] == len(rows) and s["card"]["conversations"] == len(items)
    card = (out.parent / "README.md").read_text()
    assert f"| conversations (items exported) | {len(items):,} |" in card
    assert f"| exported | {len(items):,} |" in card
    assert f"| rows (the export's count) | {len(rows):,} |" in card
    assert f"| traces kept by rows per generation | {traces:,} |" in card
    text = _export(env, "sel", tmp_path / "ds" / "again.jsonl", "--keep-lowest-acceptance", "0.3", "--no-card").stdout
    assert (f"{len(rows):,} generation rows from {len(items):,} items (--rows conversation before selection: "
            f"{s['conversation_rows']:,}); generated thinking traces kept: {traces:,} of {s['traces']:,} in "
            "generation rows,") in text, text
