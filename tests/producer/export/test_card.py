"""The dataset card beside every export (producer/export/card.py): `datasets.load_dataset` on the
exported folder reads exactly the dataset's rows, the card's counts are the summary's, the
pictures are real PNGs, and no README.md of anyone else is ever overwritten."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner

from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.runs import RunStore
from genqueue.common.settings import RunSettings
from genqueue.consumer.answer.records import sum_usage
from genqueue.producer.export import cardplots
from genqueue.producer.export.card import MARK, row_stats
from genqueue.producer.export.command import export_command

pytestmark = pytest.mark.integration

RUN = "cardrun"
PNG = b"\x89PNG\r\n\x1a\n"


def _key(i: int) -> str:
    return hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest()


def _record(i: int) -> dict[str, Any]:
    """Item I: a regenerate conversation of 1 + i % 3 user turns, each answer with its usage
    (reasoning_tokens reported on even items only); item 7 is cut, item 8 an error."""
    n = 1 + i % 3
    messages: list[dict[str, Any]] = []
    turns = []
    for t in range(n):
        messages += [{"role": "user", "content": f"q{i}.{t}"}, {"role": "assistant", "content": f"a{i}.{t}"}]
        usage = {"prompt_tokens": 20 + 30 * t + i, "completion_tokens": 100 + 7 * i + t}
        if i % 2 == 0:
            usage["reasoning_tokens"] = 60 + i
        turns.append({"turn": t, "content": f"a{i}.{t}", "reasoning": f"think {i}.{t}", "reasoning_form": "field",
                      "finish_reason": "stop", "outcome": "finished", "usage": usage, "model": "m"})
    outcome = "cut_in_answer" if i == 7 else "finished"
    turns[-1]["outcome"] = outcome
    rec: dict[str, Any] = {
        "key": _key(i), "index": i, "turn": None, "run": RUN, "id": f"c{i}", "source": "in.jsonl", "source_seq": 0,
        "messages": messages, "content": turns[-1]["content"], "reasoning": turns[-1]["reasoning"],
        "reasoning_form": "field", "tool_calls": [], "finish_reason": "stop", "outcome": outcome,
        "usage": sum_usage(t["usage"] for t in turns),  # as the consumer writes it
        "model": "m", "fingerprint": "fp1", "version": "0.1.0", "sampling": {}, "attempt": 1, "turns": turns,
        "history_reasoning": "drop", "turns_total": n, "timings": {"finished_at": 10.0 + i}}
    if i == 8:
        return {k: rec[k] for k in ("key", "index", "turn", "run", "id", "source", "source_seq", "messages",
                                    "sampling", "fingerprint", "version", "attempt")} | {
            "error": {"class": "http_4xx", "message": "bad", "status": 400}}
    return rec


N = 12


@pytest.fixture
def run(tmp_path: Path, conn: redis.Redis) -> Path:
    out = tmp_path / "out"
    RunStore(conn).create_or_check(RUN, RunSettings(output=str(out), model="tiny-model"))
    ItemTable(conn, RUN).change([bytes.fromhex(_key(i)) for i in range(N)], add=IN_RUN)
    d = out / RUN / "shards"
    d.mkdir(parents=True)
    data = b"".join(orjson.dumps(_record(i)) + b"\n" for i in range(N))
    (d / "w-000001.jsonl").write_bytes(data)
    (d / "w-000001.manifest.json").write_bytes(orjson.dumps(
        {"run": RUN, "shard": "w-000001.jsonl", "records": N, "bytes": len(data),
         "sha256": hashlib.sha256(data).hexdigest()}))
    return tmp_path


#: These tests count conversation rows (one line per item); where export writes rows per
#: generation by default (--rows), they ask for conversation rows, and one test reads both.
ROWS_OPTION = any(p.name == "rows" for p in export_command.params)
CONVERSATION_ROWS = ["--rows", "conversation"] if ROWS_OPTION else []


def export(redis_url: str, output: Path, *args: str, layout: list[str] | None = None) -> dict[str, Any]:
    output.parent.mkdir(exist_ok=True)
    rows = CONVERSATION_ROWS if layout is None else layout
    res = CliRunner().invoke(export_command, ["--run", RUN, "-o", str(output), "--json", "--allow-partial", *rows,
                                              *args],
                             env={"REDIS_URL": redis_url}, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return orjson.loads(res.stdout)  # type: ignore[no-any-return]


def load(folder: Path, name: str | None = None) -> Any:
    import datasets

    return datasets.load_dataset(str(folder), name, split="train", cache_dir=str(folder.parent / "hf-cache"))


def assert_png(path: Path) -> None:
    from PIL import Image

    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000, path
    with Image.open(path) as im:
        im.load()
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 10, path  # not blank: bars, axes, text


def card_value(card: str, label: str) -> str:
    m = re.search(rf"^\| {re.escape(label)} \| ([^|]+) \|$", card, re.MULTILINE)
    assert m, f"no {label!r} row in the card"
    return m.group(1).strip()


@pytest.mark.parametrize("name", ["data.jsonl", "data.jsonl.gz", "data.jsonl.zst", "data.parquet"])
def test_load_dataset_on_the_folder_reads_exactly_the_dataset(run: Path, redis_url: str, name: str) -> None:
    folder = run / "export"
    folder.mkdir()
    s = export(redis_url, folder / name)
    assert (s["exported"], s["truncated"], s["failed"]) == (10, 1, 1)  # side files hold rows too
    card = (folder / "README.md").read_text()
    assert MARK in card and card.startswith("---\nconfigs:\n")
    ds = load(folder)
    assert ds.num_rows == s["exported"] == 10
    assert sorted(ds["id"]) == sorted(f"c{i}" for i in range(N) if i not in (7, 8))
    # the card's counts are the summary's
    for label, key in (("conversations (items exported)", "exported"), ("enqueued items", "enqueued"),
                       ("failed for good", "failed"), ("truncated (to the truncated file)", "truncated"),
                       ("complete (every answer finished)", "complete"), ("missing", "missing")):
        assert card_value(card, label) == f"{s[key]:,}", label
    assert card_value(card, "rows (lines of the dataset file)") == f"{s['card']['rows']:,}" == f"{ds.num_rows:,}"
    if "rows" in s:  # rows per generation (--rows): the summary counts the rows too
        assert s["card"]["rows"] == s["rows"]
    gens = sum(1 + i % 3 for i in range(N) if i not in (7, 8))
    assert card_value(card, "generations (answers the target generated, in the rows)") == str(gens)
    assert s["card"]["path"] == str(folder / "README.md")
    pictures = {p: Path(p).read_bytes() for p in s["card"]["images"]}
    export(redis_url, folder / name)  # the same export, the same bytes (no clock in the card)
    assert (folder / "README.md").read_text() == card
    assert {p: Path(p).read_bytes() for p in s["card"]["images"]} == pictures
    for png in s["card"]["images"]:
        assert_png(Path(png))
        assert f"]({Path(png).name})" in card  # linked, relative: the Hub renders it


def test_lengths_are_per_generation_and_sums_are_never_split(run: Path, redis_url: str) -> None:
    folder = run / "e"
    s = export(redis_url, folder / "d.jsonl")
    card = (folder / "README.md").read_text()
    # conversation rows of several answers carry their sum: counted apart, not in the table
    multi = [i for i in range(N) if i not in (7, 8) and 1 + i % 3 > 1]
    assert f"{len(multi):,} rows hold several answers each" in card
    single = [i for i in range(N) if i not in (7, 8) and i % 3 == 0]
    prompt_row = next(line for line in card.splitlines() if line.startswith("| prompt |"))
    assert prompt_row.split("|")[2].strip() == str(len(single))
    assert prompt_row.split("|")[4].strip() == str(min(20 + i for i in single))  # p0 = the least prompt_tokens
    # thinking only where the server reported it (even items), the rest said to be unknown
    thinking = next(line for line in card.splitlines() if line.startswith("| thinking |"))
    assert thinking.split("|")[2].strip() == str(sum(1 for i in single if i % 2 == 0))
    assert "reported no `reasoning_tokens`" in card
    # --format tokens is not possible here (no ids); --format batch: one generation per row
    b = export(redis_url, run / "b" / "d.jsonl", "--format", "batch", layout=[])
    assert b["card"]["generations"] == b["exported"] == s["exported"]


@pytest.mark.skipif(not ROWS_OPTION, reason="export writes conversation rows only (no --rows)")
def test_rows_per_generation_are_one_generation_each(run: Path, redis_url: str) -> None:
    folder = run / "g"
    s = export(redis_url, folder / "g.jsonl", layout=["--rows", "generation"])
    card = (folder / "README.md").read_text()
    assert load(folder).num_rows == s["rows"] == s["card"]["rows"] == s["card"]["generations"]
    assert "rows hold several answers" not in card  # every row's usage is its one answer's
    prompt_row = next(line for line in card.splitlines() if line.startswith("| prompt |"))
    assert prompt_row.split("|")[2].strip() == f"{s['rows']:,}"
    assert card_value(card, "rows (the export's count)") == f"{s['rows']:,}"


def test_a_readme_that_is_not_a_card_is_never_overwritten(run: Path, redis_url: str) -> None:
    folder = run / "project"
    folder.mkdir()
    mine = b"# My project\n\nnot a card\n"
    (folder / "README.md").write_bytes(mine)
    s = export(redis_url, folder / "sample.regen.jsonl")
    assert (folder / "README.md").read_bytes() == mine
    assert s["card"]["path"] == str(folder / "sample.regen.card.md") and "not a genqueue card" in s["card"]["note"]
    again = export(redis_url, folder / "sample.regen.jsonl")  # its own .card.md it rewrites
    assert again["card"]["path"] == s["card"]["path"] and (folder / "README.md").read_bytes() == mine
    theirs = b"my notes\n"
    (folder / "sample.regen.card.md").write_bytes(theirs)
    third = export(redis_url, folder / "sample.regen.jsonl")
    assert third["card"]["path"] == "" and (folder / "sample.regen.card.md").read_bytes() == theirs
    assert (folder / "README.md").read_bytes() == mine
    # the table says where the card went
    res = CliRunner().invoke(export_command, ["--run", RUN, "-o", str(folder / "x.jsonl"), "--allow-partial",
                                              *CONVERSATION_ROWS],
                             env={"REDIS_URL": redis_url}, catch_exceptions=False)
    assert re.search(r"^card +.*x\.card\.md$", res.output, re.MULTILINE), res.output
    assert "not a genqueue card" in res.output and (folder / "README.md").read_bytes() == mine


def test_two_exports_into_one_folder_share_one_card(run: Path, redis_url: str) -> None:
    folder = run / "both"
    export(redis_url, folder / "a.jsonl")
    export(redis_url, folder / "b.jsonl.gz", "--format", "sharegpt")
    card = (folder / "README.md").read_text()
    assert card.count("<!-- genqueue:export ") == 2 and card.count("- config_name:") == 2
    assert re.search(r'config_name: "b"\n  data_files:\n  - split: train\n    path: "b.jsonl.gz"\n  default: true',
                     card)
    assert load(folder).num_rows == 10 and "conversations" in load(folder).column_names  # the latest: default
    assert "messages" in load(folder, "a").column_names
    export(redis_url, folder / "a.jsonl", "--include-outcomes", "all")  # the same stem: its section replaced
    card = (folder / "README.md").read_text()
    assert card.count("<!-- genqueue:export ") == 2 and load(folder, "a").num_rows == 11
    assert card.index('"config":"b"') < card.index('"config":"a"')
    (folder / "b.jsonl.gz").unlink()  # a section whose file is gone is dropped at the next export
    export(redis_url, folder / "a.jsonl")
    assert (folder / "README.md").read_text().count("<!-- genqueue:export ") == 1
    # Parquet beside JSON lines: datasets reads a folder's configs with one builder, so the card
    # lists the latest kind only, and says so
    s = export(redis_url, folder / "c.parquet")
    card = (folder / "README.md").read_text()
    assert card.count("<!-- genqueue:export ") == 1 and "no longer lists a.jsonl" in s["card"]["note"]
    assert load(folder).num_rows == 10


def test_without_matplotlib_the_tables_and_one_line(run: Path, redis_url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cardplots, "available", lambda: False)
    s = export(redis_url, run / "plain" / "d.jsonl")
    card = (run / "plain" / "README.md").read_text()
    assert s["card"]["images"] == [] and "pip install 'genqueue[card]'" in card and ".png" not in card
    assert "| prompt |" in card
    assert not list((run / "plain").glob("*.png"))


def test_no_card_and_pictures_elsewhere(run: Path, redis_url: str) -> None:
    s = export(redis_url, run / "n" / "d.jsonl", "--no-card")
    assert "card" not in s and not (run / "n" / "README.md").exists()
    s = export(redis_url, run / "p" / "d.jsonl", "--card-images", str(run / "p" / "images"))
    assert s["card"]["images"] and all(Path(p).parent == run / "p" / "images" for p in s["card"]["images"])
    assert "](images/d.lengths.png)" in (run / "p" / "README.md").read_text()


def test_row_stats_reads_each_shape() -> None:
    # a tokens row per generation: rows of one key are one conversation
    rows = [{"key": "k1", "loss_mask": [0, 1], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
            {"key": "k1", "loss_mask": [0, 1], "usage": {"prompt_tokens": 9, "completion_tokens": 3}},
            {"key": "k2", "target_turns": [1], "usage": {"prompt_tokens": 4, "completion_tokens": 1,
                                                           "reasoning_tokens": 1}},
            {"key": "k3", "samples": [{"key": "k3", "messages": [{"role": "assistant", "generated_by_target": True}],
                                       "usage": {}}]}]
    s = row_stats(rows)
    assert (s.rows, s.conversations, s.generations) == (4, 3, 4)
    assert dict(s.gens_per_conversation) == {2: 1, 1: 2}
    assert list(s.prompt) == [5, 9, 4] and list(s.thinking) == [1] and list(s.answer) == [0] and s.no_usage == 1
