"""A --logprobs run's figures on every screen (real redis-server, the stand-in answering logprobs as
vLLM does, a real consumer stopped mid-run, a local output): `producer status` (text and --json)
and the export's card show the same rows, tokens, bytes and projection for the run, from
common/keepers/captured.py's `logprobs_figures`, and those are the output's."""

from __future__ import annotations

import json
import signal

import pytest

from genqueue.common.capture import format_size
from genqueue.common.features import feature_store_for
from genqueue.common.keepers.items import ItemTable
from tests.conftest import cli, sharegpt, wait_for, write_jsonl
from tests.consumer.e2e import Proc, Sim, read_results

pytestmark = pytest.mark.integration

K = 4
RUN = "lpfig"


def test_status_json_text_and_the_card_show_the_same_table_figures_and_projection(tmp_path, redis_url, conn):
    env = {"REDIS_URL": redis_url}
    out = tmp_path / "out"
    data = write_jsonl(tmp_path / "in.jsonl", [sharegpt(i, turns=1 + i % 2) for i in range(80)])
    cli("producer", "enqueue", str(data), "--run", RUN, "--output", str(out), "--batch-size", "4", "--max-tokens", "64",
        "--token-ids", "--logprobs", str(K), env=env)
    sim = Sim(tmp_path, "--mean-tokens", "20", "--step-time", "0.02")
    try:
        c = Proc("consumer", ["-v", "run", "--run", RUN, "--endpoint", sim.url, "-c", "4", "--shard-max-age", "0.3",
                              "--spool", str(tmp_path / "spool")], tmp_path / "c.log", env=env)
        wait_for(lambda: ItemTable(conn, RUN).counts().done >= 24, 60, "24 items done")
        c.signal(signal.SIGTERM)  # stops mid-run: items left, a projection to show
        assert c.wait(60) == 0, c.output()
    finally:
        sim.stop()
    st = json.loads(cli("producer", "status", "--run", RUN, "--json", env=env).stdout)
    text = " ".join(cli("producer", "status", "--run", RUN, "--wide", env=env).stdout.split())  # lines wrap
    (tmp_path / "export").mkdir()
    cli("producer", "export", "--run", RUN, "-o", str(tmp_path / "export" / "lp.jsonl"), "--allow-partial", env=env)
    card = (tmp_path / "export" / "README.md").read_text()

    v = st["logprobs"]
    recs = [r for r in read_results(out, RUN) if "error" not in r]
    done = st["items_done"]
    assert 0 < done < 80 and v["items_left"] == 80 - done - st["items_failed"], (done, v)
    # the figures are the output's: every row stored, those the done items' results name, their tokens
    store = feature_store_for(str(out))
    entries = [e for s in store.list_shards(RUN) for e in store.get_index(RUN, s).entries]
    assert v["rows"] == len(entries) and v["tokens"] == sum(e.tokens for e in entries), v
    assert v["rows_distinct"] == sum(len(r.get("turns", [r])) for r in {r["key"]: r for r in recs}.values()), v
    # the projection: what shipped plus bytes (tokens) a row x rows an item x the items left
    to_come = v["rows_distinct"] / done * v["items_left"]
    assert v["projected_bytes"] == round(v["bytes"] + v["bytes"] / v["rows"] * to_come) > v["bytes"], v
    assert v["projected_tokens"] == round(v["tokens"] + v["tokens"] / v["rows"] * to_come) > v["tokens"], v
    # status text
    assert f"logprobs on: top {K}; {v['rows']:,} rows, {v['tokens']:,} tokens, {v['bytes'] / 1e6:,.1f} MB shipped" \
        in text, text
    assert (f"forecast {format_size(v['projected_bytes'])} for the run, {v['projected_tokens']:,} tokens "
            f"({format_size(v['bytes_per_row'])} a row x {v['rows_per_item']:.2f} rows an item x "
            f"{v['items_left']:,} items left") in text, text
    # the card
    assert "### Log-probability tables (for a distillation trainer)" in card, card
    for label, value in (("top log-probabilities a token", f"{K:,}"), ("rows shipped", f"{v['rows']:,}"),
                         ("rows the done items' results name", f"{v['rows_distinct']:,}"),
                         ("tokens with a table", f"{v['tokens']:,}"),
                         ("bytes shipped", f"{format_size(v['bytes'])} ({v['bytes']:,} bytes)"),
                         ("bytes a token", f"{v['bytes_per_token']:,.1f}"),
                         ("projected for the run", f"{format_size(v['projected_bytes'])} ({v['projected_bytes']:,} bytes)"),
                         ("tokens projected for the run", f"{v['projected_tokens']:,}")):
        assert f"| {label} | {value} |" in card, (label, value, card)
