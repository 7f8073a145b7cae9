"""DistillKit's own data path, with torch, reads what `producer export-logprobs --layout
distillkit` writes: its `_load_dataset` (the HfRepoDataset a run config names, here the export's
folder), `pack_logits._truncate_row` and `iterative_packing` (its packer, which trims input_ids and
labels to the tables), `collate_packed_batch`, the `OfflineSignalSource` its `create_signal_source`
builds from the run config's `teacher.logprob_compressor` (the export's compression_config.yaml),
and its KL loss, masked as its trainer masks it (`labels >= 0`). Every row in is a row accepted,
the positions its mask selects are exactly the ones after a generated token's table, and there
its decompressed tables are the stored ones: the same ids, the values within bf16's rounding for
exact values, and for a polynomial fit within the error the export's summary reports.

DistillKit is not on PyPI: its package at the pinned commit (arcee-ai/DistillKit
a61c2e7d25c2e990d45832e12bd8542bdee9c810, Apache-2.0) is kept under tests/vendor/ and put first on
the path; the vLLM virtualenv's python runs it (torch, transformers, pydantic), with the genqueue
virtualenv's site-packages after its own (datasets, pyarrow). trl and accelerate, which its
main.py imports for the trainer class and never for the data, are stand-ins when absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import yaml

from genqueue.common.features import feature_store_for
from genqueue.common.features.logprobs import LogprobsReader
from genqueue.producer.export import distillkit as dk
from genqueue.producer.export.logprobrows import Layout
from genqueue.producer.export.logprobscmd import LogprobPlan, export_logprobs, plan_k
from tests.conftest import cli, sharegpt
from tests.producer.export.logprobtables import VOCAB, run_of, write_tokens
from tests.vllm.conftest import TINY_MODEL, VLLM_PYTHON, VllmServer
from tests.vllm.pipeline import consume, enqueue

VENDOR = Path(__file__).resolve().parents[1] / "vendor" / "distillkit-a61c2e7"
K = 20

TRAINER_SIDE = r"""
import importlib.util, json, sys, types
vendor, site, folder, out = sys.argv[1:5]
sys.path.insert(0, vendor)
sys.path.append(site)
import transformers  # before the stand-ins: it asks whether accelerate is installed
for name, attrs in (("trl", ("SFTTrainer", "SFTConfig")), ("accelerate", ("Accelerator",))):
    if importlib.util.find_spec(name) is None:
        stub = types.ModuleType(name)
        for a in attrs:
            setattr(stub, a, type(a, (), {}))
        sys.modules[name] = stub
import numpy as np, torch, yaml
from types import SimpleNamespace
from distillkit.configuration import DistillationRunConfig
from distillkit.main import _load_dataset, collate_packed_batch, create_signal_source
from distillkit.pack_logits import _truncate_row, iterative_packing
from distillkit.lossfuncs.kl import KLDLoss
from distillkit.sample_common import compressed_logit_schema

compressor = yaml.safe_load(open(folder + "/compression_config.yaml"))
config = DistillationRunConfig.model_validate({
    "model": "student", "sequence_length": 64, "output_path": out + ".run",
    "dataset": {"train_dataset": {"repo_id": folder, "split": "train"}, "seed": None},
    "teacher": {"kind": "dataset", "logprob_compressor": compressor},
})
ds = _load_dataset(config.dataset.train_dataset, config.dataset.seed, None, tokenizer=None)
info = {"rows": len(ds), "columns": ds.column_names}
theirs = compressed_logit_schema()
info["schema_as_theirs"] = all(str(ds.features[f.name].feature) in (str(f.type.value_type), "List(Value('uint8'))",
                                                                   "Sequence(feature=Value(dtype='uint8'))")
                               or ds.data.schema.field(f.name).type == f.type for f in theirs)
source = create_signal_source(config, vocab_size=compressor["d"])
kl = KLDLoss(temperature=1.0, missing_probability_handling="zero")
arrays, losses = {}, []
torch.manual_seed(0)
for i, row in enumerate(ds.map(_truncate_row)):
    batch = collate_packed_batch([row])
    signal = source.get_signal(batch)
    mask = batch["labels"] >= 0
    student = SimpleNamespace(logits=torch.randn(1, batch["input_ids"].shape[1], compressor["d"]))
    losses.append(float(kl(student, signal, mask=mask.unsqueeze(-1))))
    arrays[f"ids{i}"] = signal.sparse_ids[0].numpy()
    arrays[f"values{i}"] = signal.sparse_values[0].float().numpy()
    arrays[f"mask{i}"] = mask[0].numpy()
    arrays[f"input{i}"] = batch["input_ids"][0].numpy()
info["losses"] = losses
packed = iterative_packing(ds, max_len=48)
info["packed_tokens"] = sum(len(x) for x in packed["input_ids"])
info["packed_aligned"] = all(len(a) == len(b) == len(c) for a, b, c in
                             zip(packed["input_ids"], packed["labels"], packed["compressed_logprobs"]))
batch = collate_packed_batch([packed[0]])
signal = source.get_signal(batch)
info["packed_signal"] = list(signal.sparse_ids.shape)
info["packed_batch"] = list(batch["input_ids"].shape)
np.savez(out, **arrays)
print(json.dumps(info))
"""

LOSSLESS_BF16 = {"d": VOCAB, "k": K, "exact_k": K, "exact_dtype": "bfloat16", "residual_bins": [],
                 "delta_encoding": False}
RECOMMENDED = {"d": VOCAB, "k": 16, "exact_k": 8, "exact_dtype": "bfloat16",
               "polynomial_terms": [0, 1, 2, 3, 4, "sqrt"], "term_dtype": "float32", "residual_bins": [],
               "delta_encoding": False, "error_diffusion": False}
DELTA_BINS = {"d": VOCAB, "k": K, "exact_k": 2, "exact_dtype": "float16", "polynomial_terms": [0, 1, 2],
              "residual_bins": [{"scale_dtype": "float16", "element_bits": 4, "num_elements": 18}],
              "delta_encoding": True, "error_diffusion": True}


def trainer_reads(folder: Path, out: Path) -> dict[str, Any]:
    site = sysconfig.get_paths()["purelib"]
    proc = subprocess.run([VLLM_PYTHON, "-c", TRAINER_SIDE, str(VENDOR), site, str(folder), str(out)],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                               "HF_DATASETS_CACHE": str(out.parent / "hf-cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


#: DistillKit's README "recommended" config itself (its t reaches 111: its own float32 fit strays
#: far, BENCHMARKS.md; genqueue's float64 one, decoded by its code, is within the summary's figure)
RECOMMENDED_128 = {**RECOMMENDED, "k": 128, "exact_k": 16}


@pytest.mark.parametrize("config", [LOSSLESS_BF16, RECOMMENDED, DELTA_BINS, RECOMMENDED_128],
                         ids=["exact-bf16", "fit", "delta-bins", "recommended-128"])
def test_distillkit_reads_the_export_aligned_to_its_loss_mask(tmp_path: Path, config: dict[str, Any]) -> None:
    rows, src = run_of(6, max(K, config["k"]))
    tokens = write_tokens(tmp_path / "tokens.jsonl", rows)
    cfg = dk.DistillKitConfig.from_mapping(config, where="test")
    folder = tmp_path / "dk"
    plan = LogprobPlan("lp-run", Layout.DISTILLKIT, folder, tokens, False, plan_k(Layout.DISTILLKIT, cfg,
                                                                                  src.manifest), cfg)
    r = export_logprobs(plan, src, "memory")
    assert (r.rows_read, r.rows_exported) == (6, 6)
    info = trainer_reads(folder, tmp_path / "theirs.npz")
    assert info["rows"] == r.rows_exported  # rows in = rows accepted
    assert info["schema_as_theirs"], info["columns"]
    assert all(np.isfinite(x) for x in info["losses"])
    got = np.load(tmp_path / "theirs.npz")
    worst = 0.0
    for i, row in enumerate(rows):
        n = len(row["input_ids"]) - 1  # _truncate_row: input_ids and labels cut to the tables
        assert np.array_equal(got[f"input{i}"], row["input_ids"][:n])
        assert got[f"ids{i}"].shape == (n, cfg.k) and got[f"values{i}"].shape == (n, cfg.k)
        # their KL mask is exactly the positions after which a token was generated
        assert got[f"mask{i}"].tolist() == [bool(m) for m in row["loss_mask"][1:]]
        t = src.tables[row["key"]]
        at = got[f"mask{i}"]
        assert np.array_equal(got[f"ids{i}"][at], t.topk_ids[:, : cfg.k])
        err = np.abs(got[f"values{i}"][at] - t.topk_logprobs[:, : cfg.k])
        if config is LOSSLESS_BF16:
            assert np.all(err <= np.abs(t.topk_logprobs) * 2.0**-8)
        worst = max(worst, float(err.max()))
    assert r.max_error is not None and worst <= r.max_error + 1e-5  # the summary's bound is what DistillKit reads
    # its packer fills sequences of max_len, cutting the row that overflows one: aligned all the same
    assert 0 < info["packed_tokens"] <= sum(len(x["input_ids"]) - 1 for x in rows) and info["packed_aligned"]
    assert info["packed_signal"][:2] == info["packed_batch"]


def test_distillkit_reads_a_real_runs_tables(tmp_path: Path, redis_url: str, vllm: VllmServer) -> None:
    """The tables vLLM itself returned during generation (a multi-turn regenerate run with
    --logprobs 16: the engine is asked for K + 1, within its --max-logprobs of 20), through the
    commands a user runs, then DistillKit's data path: every tokens row accepted, its mask on the
    tables after each generated token, the ids and values the reader's within the export's
    reported bound."""
    env = {"REDIS_URL": redis_url}
    enqueue(tmp_path, redis_url, "lpr", [sharegpt(i, turns=2) for i in range(4)], "--token-ids", "--logprobs", "16",
            "--max-tokens", "32")
    consume(tmp_path, redis_url, vllm.url, "lpr")
    tokens = tmp_path / "tokens.jsonl"
    cli("producer", "export", "--run", "lpr", "--format", "tokens", "-o", str(tokens), "--include-outcomes", "all", env=env)
    rows = [orjson.loads(x) for x in tokens.read_bytes().splitlines()]
    vocab = int(json.loads((Path(TINY_MODEL) / "config.json").read_text())["vocab_size"])
    config = tmp_path / "compression.yaml"
    config.write_text(yaml.safe_dump({"d": vocab, "k": 16, "exact_k": 8, "exact_dtype": "bfloat16",
                                      "polynomial_terms": [0, 1, 2, "sqrt"], "term_dtype": "float32",
                                      "residual_bins": [], "delta_encoding": False}))
    folder = tmp_path / "dk"
    res = cli("producer", "export-logprobs", "--run", "lpr", "--tokens", str(tokens), "-o", str(folder), "--layout",
              "distillkit", "--distillkit-config", str(config), "--json", env=env)
    summary = orjson.loads(res.stdout)
    assert summary["rows_read"] == summary["rows_exported"] == len(rows) == 8, summary
    assert summary["tables_without_rows"] == 0, summary
    info = trainer_reads(folder, tmp_path / "theirs.npz")
    assert info["rows"] == len(rows) and all(np.isfinite(x) for x in info["losses"])
    got = np.load(tmp_path / "theirs.npz")
    reader = LogprobsReader(feature_store_for(str(tmp_path / "out")), "lpr")
    for i, row in enumerate(rows):
        t = reader.row(f"{row['key']}:{row['turn']}")
        at = got[f"mask{i}"]
        assert at.tolist() == [bool(m) for m in row["loss_mask"][1:]]
        assert np.array_equal(got[f"ids{i}"][at], t.topk_ids)
        assert np.abs(got[f"values{i}"][at] - t.topk_logprobs).max() <= summary["max_error"] + 1e-5
