"""Read exported files back as the trainers do, under whichever `datasets` release this process
imports: `python -m tests.producer.export.readback PLAN OUT`.

test_trainers_roundtrip.py runs it twice, once as the virtualenv has it (datasets 5.x) and once
with PYTHONPATH=.venv/datasets4 (datasets 4.0.0, scripts/setup --tests), since one process
cannot hold two releases of a package. PLAN (JSON) names:

- `files`: name -> {"path", "kind": "json"|"parquet"}: each loaded whole with
  `datasets.load_dataset(kind, data_files=path, split="train")`, its rows written out as read;
- `specforge`: a JSONL export SpecForge's `prepare_prompt_tasks` (specforge/data/prompt_builder.py,
  its online trainer's entry: `load_dataset("json")`, then `build_eagle3_dataset`) prepares,
  with `train_only_last_turn`; every `apply_chat_template` call its parser makes is recorded
  (the messages and the tools it hands the template);
- `speculators`: a JSONL export speculators' `load_raw_dataset` + `build_speculator_training_dataset`
  prepare, against a `/render` endpoint served here that records every body it is sent (the
  messages and tools speculators would send vLLM).

OUT (JSON): the `datasets` version, each file's rows, and what each trainer handed its
template or render endpoint, plus how many rows it built.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading
from pathlib import Path
from typing import Any


def _rows(path: str, kind: str, cache: str) -> list[dict[str, Any]]:
    import datasets

    ds = datasets.load_dataset(kind, data_files=path, split="train", cache_dir=cache)
    return [dict(row) for row in ds]


def _recording_tokenizer(log: Path) -> Any:
    """The trainer tests' tokenizer (Qwen3's template), each apply_chat_template call appended
    to LOG (a file: datasets 5.x runs a map of num_proc=1 in a worker process)."""
    from tests.producer.export.test_trainer_loaders import tokenizer

    tok = tokenizer()
    render = tok.apply_chat_template

    def apply_chat_template(messages: Any, *args: Any, **kwargs: Any) -> Any:
        with open(log, "a") as fh:
            fh.write(json.dumps({"messages": messages, "tools": kwargs.get("tools")}, default=_plain) + "\n")
        return render(messages, *args, **kwargs)

    tok.apply_chat_template = apply_chat_template
    return tok


def _specforge(path: str, log: Path) -> dict[str, Any]:
    from tests.producer.export import trainer_code

    trainer_code.specforge()  # its preprocessing imported under the torch stand-in
    import importlib

    builder = importlib.import_module("specforge.data.prompt_builder")
    tok = _recording_tokenizer(log)
    try:
        with trainer_code.numpy_for_torch_format():
            tasks = builder.prepare_prompt_tasks(path, tok, chat_template="qwen3-thinking", max_length=4096,
                                                 is_preformatted=False, train_only_last_turn=True, cache_dir=None,
                                                 cache_key=None, num_proc=1)
            built = len(tasks)
    finally:
        del tok.apply_chat_template  # the class's again: the render endpoint below shares the tokenizer
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {"built": built, "calls": calls}


def _speculators(path: str) -> dict[str, Any]:
    from tests.producer.export import trainer_code
    from tests.producer.export.test_trainer_loaders import RenderHandler, tokenizer

    bodies: list[dict[str, Any]] = []

    class Render(RenderHandler):
        """vLLM's /v1/chat/completions/render as speculators calls it; every body recorded."""

        heard = bodies

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Render)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sp = trainer_code.speculators().preprocessing
        raw, _ = sp.load_raw_dataset(path)
        with trainer_code.numpy_for_torch_format():
            built = sp.build_speculator_training_dataset(raw, tokenizer(), max_length=4096, num_proc=1,
                                                         render_endpoint=f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    return {"built": len(built), "calls": bodies}


def main(plan_path: str, out_path: str) -> None:
    import datasets

    plan = json.loads(Path(plan_path).read_text())
    out: dict[str, Any] = {"datasets": datasets.__version__, "rows": {}}
    for name, f in plan.get("files", {}).items():
        out["rows"][name] = _rows(f["path"], f["kind"], plan["cache"])
    if plan.get("specforge"):
        out["specforge"] = _specforge(plan["specforge"], Path(out_path).with_suffix(".specforge.jsonl"))
    if plan.get("speculators"):
        out["speculators"] = _speculators(plan["speculators"])
    Path(out_path).write_text(json.dumps(out, default=_plain))


def _plain(value: Any) -> Any:
    """numpy values a loader may hand back, as JSON has them."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


if __name__ == "__main__":
    main(*sys.argv[1:3])
