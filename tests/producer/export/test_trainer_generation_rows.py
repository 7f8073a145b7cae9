"""Generation rows (the default `--rows generation`) read by the trainers' own code, on the
stand-in run of test_trainer_loaders.py (regenerate: 1-3 user turns, system prompts, tools,
agentic conversations regenerated through their recorded tool results, thinking on nearly
every answer).

Generations in: every answer the run generated whose own outcome and whose history's were
`finished` (read from the run's shards, not from the export). Each test asserts generations
in = rows out = rows accepted, a row being accepted when the tool renders its answer's
thinking and trains exactly that answer:

| format | tool | setting | its code |
| --- | --- | --- | --- |
| openai, parquet | transformers | | `apply_chat_template` with the Qwen3-style template |
| specforge | SpecForge | `train_only_last_turn` | `build_eagle3_dataset`, template `qwen3.5` |
| sharegpt | LLaMA-Factory | `mask_history` | `align_dataset` + processor/supervised.py's rule |
| specforge | speculators | (reads conversation rows) | `build_speculator_training_dataset` |

speculators fans each row out itself, one training row per assistant turn with the history
re-rendered by the template (data_generation/preprocessing.py `_render_boundary_rows`): it
reads conversation rows (`--rows conversation`) as one row per generation, and would train
the history answers of generation rows again (asserted below).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

from tests.producer.export import loaders, trainer_code
from tests.producer.export import test_trainer_loaders as table
from tests.producer.export.test_chat_template import meant_to_render
from tests.producer.export.test_export_datasets import _prune, lines
from tests.producer.export.test_trainer_loaders import RUN, THINK, Exports, _Args, render, tokenizer

pytestmark = pytest.mark.integration

#: The table's fixtures, under names of their own here: the run and the render endpoint.
run = table.exports
endpoint = table.render_endpoint


def generations_in(ex: Exports) -> dict[str, dict[str, Any]]:
    """`<line id>-a<k>` -> the k-th generation's turn entry, for every generation of the run
    that finished with a history of finished answers, read from the shards."""
    recs: dict[str, dict[str, Any]] = {}
    for path in sorted((ex.folder / "out" / RUN / "shards").glob("*.jsonl")):
        for raw in path.read_bytes().splitlines():
            rec = orjson.loads(raw)
            if "error" not in rec and (rec["key"] not in recs or recs[rec["key"]].get("copy")):
                recs[rec["key"]] = rec
    out = {}
    for rec in recs.values():
        for k, turn in enumerate(rec["turns"]):
            if any(t["outcome"] != "finished" for t in rec["turns"][: k + 1]):
                break
            out[f"{rec.get('id') or rec['key']}-a{k}"] = turn
    return out


def trace(turn: dict[str, Any]) -> str | None:
    reasoning = turn.get("reasoning")
    return reasoning.strip() if isinstance(reasoning, str) and reasoning.strip() else None


def conversation_of(rid: str) -> str:
    return rid.rsplit("-a", 1)[0]


#: SpecForge's qwen3.5 template's assistant header (specforge/data/template.py).
QWEN35_HEADER = "<|im_start|>assistant\n<think>\n"


def answer_text(row: dict[str, Any]) -> tuple[str, str]:
    """(the row's whole render, the row's answer in it: its turn after its history, from the
    assistant header up to and including the end of turn) with the Qwen3-style template."""
    full = render(row["messages"], row.get("tools"))
    history = render(row["messages"][:-1], row.get("tools"))
    assert full.startswith(history)
    return full, full[len(history):]


def openai_rows(ex: Exports, fmt: str) -> list[dict[str, Any]]:
    if fmt == "openai":
        return lines(ex.gen["openai"])
    return [_prune(r) for r in pq.read_table(ex.gen["parquet"]).to_pylist()]


@pytest.mark.parametrize("fmt", ["openai", "parquet"])
def test_every_generated_trace_renders_in_exactly_one_row(fmt: str, run: Exports) -> None:
    want = generations_in(run)
    rows = openai_rows(run, fmt)
    assert set(want) == {r["id"] for r in rows} and len(rows) == len(want)  # generations in = rows out
    texts = {r["id"]: render(r["messages"], r.get("tools")) for r in rows}
    accepted = 0
    for row in rows:
        turn, answer = want[row["id"]], row["messages"][-1]
        assert answer["role"] == "assistant" and answer["weight"] == 1 and row["generation"] == int(
            row["id"].rsplit("-a", 1)[1])
        assert all(m.get("weight") == 0 for m in row["messages"][:-1] if m["role"] == "assistant")
        assert all("reasoning_content" not in m for m in row["messages"][:-1])  # history as sent: drop
        t = trace(turn)
        same = [rid for rid in texts if conversation_of(rid) == conversation_of(row["id"])]
        in_rows = [rid for rid in same if t is not None and THINK.format(t) in texts[rid]]
        accepted += (t is None or in_rows == [row["id"]]) and (turn["content"] in texts[row["id"]])
    assert accepted == len(rows) == len(want)
    traces = sum(trace(t) is not None for t in want.values())
    s = run.gen_summary[fmt]
    assert s["rows_layout"] == "generation" and s["rows"] == len(rows) and s["traces"] >= traces
    assert s["traces_kept_generation"] == traces
    # the conversation rows of the same run keep only the traces after their last user message
    conv = run.conversation_summary
    kept = sum(len(meant_to_render(r)) for r in run.truth.values())
    assert conv["rows"] == conv["conversation_rows"] == len(run.truth) == s["conversation_rows"]
    assert conv["traces_kept_conversation"] == kept == s["traces_kept_conversation"] < traces
    print(f"\n{fmt}: {len(want)} generations -> {len(rows)} rows, {traces} traces rendered "
          f"(conversation rows: {len(run.truth)} rows, {kept} traces rendered)")


def test_specforge_qwen35_trains_exactly_each_rows_answer(run: Exports) -> None:
    """SpecForge's build_eagle3_dataset, template qwen3.5 (assistant header ending in
    `<think>\\n`), train_only_last_turn: the loss mask is the row's answer, nothing else."""
    import datasets

    want = generations_in(run)
    path = run.gen["specforge"]
    by_id = {r["id"]: r for r in lines(path)}
    assert set(by_id) == set(want)
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(run.folder / "hf"))
    order = ds.shuffle(seed=42)["id"]
    tok = tokenizer()
    masks: dict[bool, list[str]] = {}
    traced = {rid for rid, turn in want.items() if trace(turn) is not None}
    for last_only in (True, False):
        with trainer_code.numpy_for_torch_format():
            built = trainer_code.specforge().preprocessing.build_eagle3_dataset(
                ds, tok, chat_template="qwen3.5", max_length=4096, num_proc=1, train_only_last_turn=last_only)
        assert len(built) == len(order) == len(want)
        accepted = unmasked = 0
        trained_texts = []
        for rid, out in zip(order, built, strict=True):
            row = by_id[rid]
            messages = [{k: v for k, v in m.items() if k in ("role", "content", "reasoning_content", "tool_calls",
                                                           "tool_call_id")} for m in row["conversations"]]
            full, answer = answer_text({"messages": messages, "tools": row.get("tools")})
            ids, mask = np.asarray(out["input_ids"]).reshape(-1), np.asarray(out["loss_mask"]).reshape(-1)
            trained = tok.decode(ids[mask == 1])
            trained_texts.append(trained)
            # the header SpecForge matches ends in "<think>\n": what follows it is the answer; an
            # answer without thinking has none in this template (Qwen3's own writes an empty
            # block for the last turn): no loss on that row at all, nothing else trained
            assert tok.decode(ids) == full
            if answer.startswith(QWEN35_HEADER):
                accepted += trained == answer[len(QWEN35_HEADER):]
            else:
                unmasked += rid not in traced and trained == ""
        assert accepted == len(traced) and unmasked == len(want) - len(traced), last_only
        assert len(traced) >= 0.9 * len(want)
        masks[last_only] = trained_texts
    # the history's answers, rendered without their thinking, lack the header: untrained either way
    assert masks[True] == masks[False]


def test_specforge_qwen35_on_conversation_rows_trains_only_the_last_user_turns_answers(run: Exports) -> None:
    """The same template on conversation rows: only the answers after the last user message
    have the `<think>\\n` header, so the earlier answers get no loss at all."""
    import datasets

    ds = datasets.load_dataset("json", data_files=str(run.files["specforge"]), split="train",
                               cache_dir=str(run.folder / "hf"))
    order = ds.shuffle(seed=42)["id"]
    tok = tokenizer()
    with trainer_code.numpy_for_torch_format():
        built = trainer_code.specforge().preprocessing.build_eagle3_dataset(
            ds, tok, chat_template="qwen3.5", max_length=4096, num_proc=1)
    trained_answers = total = 0
    for rid, out in zip(order, built, strict=True):
        ids, mask = np.asarray(out["input_ids"]).reshape(-1), np.asarray(out["loss_mask"]).reshape(-1)
        trained = tok.decode(ids[mask == 1])
        msgs = run.truth[rid]["messages"]
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        for i, m in enumerate(msgs):
            if m["role"] == "assistant" and m["content"]:
                total += 1
                trained_answers += m["content"] in trained
                assert (m["content"] in trained) == (i > last_user), (rid, i)
    assert 0 < trained_answers < total
    print(f"\nSpecForge qwen3.5 on conversation rows: {trained_answers} of {total} answers with text trained")


def test_llamafactory_mask_history_trains_exactly_each_rows_answer(run: Exports) -> None:
    """LLaMA-Factory's align_dataset with the entry the export writes, then mask_history
    (processor/supervised.py: every pair but the last labelled IGNORE_INDEX): the trained
    turn is the row's answer, its thought the generation's thinking, the history without any."""
    import shutil

    import datasets

    lf = trainer_code.llamafactory()
    want = generations_in(run)
    folder = run.folder / "lf-gen"
    folder.mkdir(exist_ok=True)
    data = run.gen["sharegpt"]
    shutil.copy(data, folder / data.name)
    info = data.with_name("g.sg.dataset_info.json")
    (folder / "dataset_info.json").write_text(info.read_text())
    [attr] = lf.parser.get_dataset_list(list(orjson.loads(info.read_text())), str(folder))
    ds = datasets.load_dataset("json", data_files=str(folder / attr.dataset_name), split="train",
                               cache_dir=str(run.folder / "hf"))
    aligned = lf.converter.align_dataset(ds, attr, _Args(streaming=False, preprocessing_num_workers=None,
                                                         overwrite_cache=True, media_dir=str(folder)),
                                         _Args(local_process_index=0))
    rows = lines(data)
    assert len(rows) == len(aligned) == len(want) and {r["id"] for r in rows} == set(want)
    accepted = 0
    for row, out in zip(rows, aligned, strict=True):
        turn = want[row["id"]]
        [trained] = loaders.llamafactory_trained_turns(row, mask_history=True)
        value = row["conversations"][trained]["value"]
        thought, _ = loaders.llamafactory_thought(value)
        history = [t["value"] for t in row["conversations"][:trained] if t["from"] in ("gpt", "function_call")]
        accepted += (trained == len(row["conversations"]) - 1 and len(out["_response"]) == 1
                     and out["_response"][0]["content"] == value and thought == turn["reasoning"]
                     and all(loaders.llamafactory_thought(h)[0] is None for h in history)
                     and len(out["_prompt"]) % 2 == 1)
    assert accepted == len(want)


def test_speculators_reads_conversation_rows_as_one_row_per_generation(run: Exports, endpoint: str) -> None:
    """speculators renders each assistant turn of a row as a training row of its own, masked
    from its render boundary: the conversation rows give one row per generation with the loss
    on exactly that answer; the generation rows would give their history answers rows again."""
    sp = trainer_code.speculators().preprocessing
    tok = tokenizer()
    conv_generations = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in run.truth.values())

    def build(path: Path) -> list[tuple[str, str]]:
        raw, _ = sp.load_raw_dataset(str(path))
        with trainer_code.numpy_for_torch_format():
            built = sp.build_speculator_training_dataset(raw, tok, max_length=4096, num_proc=1,
                                                         render_endpoint=endpoint)
        return [(tok.decode(np.asarray(r["input_ids"])), tok.decode(np.asarray(r["input_ids"])[
            np.asarray(r["loss_mask"]) == 1])) for r in built]

    rows = build(run.files["specforge"])
    assert len(rows) == conv_generations
    accepted = 0
    for text, trained in rows:
        # the trained part is exactly one answer: a generation prompt's continuation, ended once
        accepted += trained.endswith("<|im_end|>\n") and trained.count("<|im_end|>") == 1 and text.endswith(trained)
    assert accepted == conv_generations
    gen_rows = lines(run.gen["specforge"])
    fanned = build(run.gen["specforge"])
    assert len(fanned) == sum(sum(t["role"] == "assistant" for t in r["conversations"]) for r in gen_rows)
    assert len(fanned) > len(gen_rows)
    print(f"\nspeculators: conversation rows -> {len(rows)} training rows ({conv_generations} generations); "
          f"{len(gen_rows)} generation rows -> {len(fanned)} training rows")
