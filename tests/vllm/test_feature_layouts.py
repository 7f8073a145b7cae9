"""The trainers' own loaders, with torch, read what `producer export-features` writes and build
training batches from it: speculators 0.9.0's ArrowDataset and CollateFn (through hs_connectors'
FileTransfer), SpecForge a6b6b023's offline reader, feature store, eagle3 normalizer and
collator. Every row in is a row accepted, each row's features are the stored ones (fp8 within
its bound, then bf16) aligned with its input_ids and loss mask, and SpecForge's hidden_state is
the tiny model's final norm as transformers' own module computes it.

Here because they need torch: the vLLM virtualenv's python runs them, with the genqueue
virtualenv's site-packages after its own (datasets, speculators, specforge and hs_connectors
installed there with --no-deps by scripts/setup --tests; torch and numpy are the vLLM venv's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from genqueue.common.features import LocalFeatureStore
from genqueue.producer.export.featurelayouts import final_norm
from genqueue.producer.export.features import ROWS_FILE, FeatureIndex, FeatureLayout
from genqueue.producer.export.featurescmd import FeaturePlan, export_features
from genqueue.producer.export.featurewriters import TorchWriter
from tests.producer.export.featurestore import LAYERS, RUN, features_of, make_run, token_rows
from tests.vllm.conftest import VLLM_PYTHON

RANDOM_MODEL = os.environ.get("GENQUEUE_TINY_RANDOM_MODEL", "")
HIDDEN = 128  # the random tiny model's (4 layers: LAYERS' last is its final layer)

TRAINER_SIDE = r"""
import json, sys
sys.path.append(sys.argv[1])
import numpy as np, torch
layout, folder, out = sys.argv[2], sys.argv[3], sys.argv[4]
arrays, info = {}, {}
if layout == "speculators":
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.recovery import SampleUnavailable
    ds = ArrowDataset(max_len=100000, datapath=folder, on_missing="raise")
    items = [ds[i] for i in range(len(ds))]
    info["unavailable"] = sum(isinstance(x, SampleUnavailable) for x in items)
    for i, it in enumerate(items):
        arrays[f"aux{i}"] = it["hidden_states"].float().numpy()
        arrays[f"last{i}"] = it["verifier_last_hidden_states"].float().numpy()
        arrays[f"ids{i}"] = it["input_ids"].numpy()
        arrays[f"mask{i}"] = it["loss_mask"].numpy()
    total = sum(int(it["lengths"][0]) for it in items)
    batch = CollateFn(max_len=total, hidden_size=int(sys.argv[5]), num_target_layers=3)(items)
    info["batch"] = {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")}
    info["error_records"] = int(batch["error_records"])
    info["rows"] = len(items)
    info["files"] = [str(i) for i in range(len(items))]
else:
    from transformers import AutoModelForCausalLM
    from specforge.runtime.data_plane.offline_reader import list_feature_files
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.data.utils import DataCollatorWithPadding
    norm = AutoModelForCausalLM.from_pretrained(sys.argv[5], dtype=torch.bfloat16).model.norm
    files = list_feature_files(folder)
    samples = []
    for i, f in enumerate(files):
        s = normalize_offline_sample(load_feature_file(f), max_len=100000)
        samples.append(s)
        arrays[f"aux{i}"] = s["hidden_state"][0].float().numpy()
        arrays[f"last{i}"] = s["target"][0].float().numpy()
        arrays[f"ids{i}"] = s["input_ids"][0].numpy()
        arrays[f"mask{i}"] = s["loss_mask"][0].numpy()
        prenorm = torch.from_numpy(np.load(sys.argv[6])[f"{f.rsplit('/', 1)[-1]}"]).to(torch.bfloat16)
        with torch.no_grad():
            arrays[f"theirs{i}"] = norm(prenorm).float().numpy()
    batch = DataCollatorWithPadding()(samples)
    info["batch"] = {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")}
    info["rows"] = len(samples)
    info["files"] = [f.rsplit("/", 2)[-2] + "/" + f.rsplit("/", 1)[-1] for f in files]
np.savez(out, **arrays)
print(json.dumps(info))
"""


def trainer_reads(layout: str, folder: Path, out: Path, *extra: str) -> dict[str, object]:
    site = sysconfig.get_paths()["purelib"]
    proc = subprocess.run([VLLM_PYTHON, "-c", TRAINER_SIDE, site, layout, str(folder), str(out), *extra],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def within_fp8_then_bf16(got: np.ndarray, want: np.ndarray) -> bool:
    scale = np.abs(want).max(axis=-1, keepdims=True) / 448
    return bool(np.all(np.abs(got - want) <= (np.abs(want) * (1 / 17 + 2**-8) + 2**-10 * scale) * 1.01))


def test_speculators_loader_trains_on_the_exported_folder(tmp_path: Path) -> None:
    rows = token_rows(5)
    made = make_run(tmp_path, rows, hidden=HIDDEN, full=frozenset({3}))
    torch = TorchWriter(VLLM_PYTHON)
    plan = FeaturePlan(RUN, FeatureLayout.SPECULATORS, tmp_path / "spec", made.tokens, False, None, torch)
    r = export_features(plan, FeatureIndex(LocalFeatureStore(made.output), RUN), "here")
    assert r.rows_exported == 5 and (tmp_path / "spec" / "token_freq.pt").is_file()
    info = trainer_reads("speculators", tmp_path / "spec", tmp_path / "got.npz", str(HIDDEN))
    assert (info["rows"], info["unavailable"], info["error_records"]) == (5, 0, 0)  # rows in = rows accepted
    got = np.load(tmp_path / "got.npz")
    total = 0
    for i, row in enumerate(rows):
        n = len(row["input_ids"]) - (0 if i == 3 else 1)  # row 3: a prefill pass's features cover every id
        total += n
        ids = got[f"ids{i}"].tolist()
        assert ids == row["input_ids"][:n] and got[f"mask{i}"].tolist() == row["loss_mask"][:n]
        want = features_of(ids, HIDDEN)
        assert got[f"aux{i}"].shape == (n, 3 * HIDDEN) and got[f"last{i}"].shape == (n, HIDDEN)
        assert within_fp8_then_bf16(got[f"aux{i}"], want[:, :-1].reshape(n, -1))
        assert within_fp8_then_bf16(got[f"last{i}"], want[:, -1])
    assert info["batch"]["input_ids"] == [1, total] and info["batch"]["hidden_states"] == [1, total, 3 * HIDDEN]


@pytest.mark.skipif(not RANDOM_MODEL, reason="GENQUEUE_TINY_RANDOM_MODEL unset (scripts/vllm-tier sets it)")
def test_specforge_loader_trains_on_the_exported_files(tmp_path: Path) -> None:
    rows = token_rows(4)
    made = make_run(tmp_path, rows, hidden=HIDDEN)
    norm = final_norm(Path(RANDOM_MODEL))
    plan = FeaturePlan(RUN, FeatureLayout.SPECFORGE, tmp_path / "sf", made.tokens, False, norm,
                       TorchWriter(VLLM_PYTHON))
    r = export_features(plan, FeatureIndex(LocalFeatureStore(made.output), RUN), "here")
    assert r.rows_exported == 4 and r.notes == []
    index = {json.loads(line)["file"]: json.loads(line) for line in (tmp_path / "sf" / ROWS_FILE).read_text().splitlines()}
    # the pre-norm final layer as stored, decoded: transformers' norm module is applied to it there
    by_file = {f.rsplit("/", 1)[-1]: (features_of(rows[e["index"]]["input_ids"][:e["tokens"]], HIDDEN))
               for f, e in index.items()}
    from genqueue.common.features import FeatureReader
    reader = FeatureReader(LocalFeatureStore(made.output), RUN)
    prenorm = {f.rsplit("/", 1)[-1]: reader.row(e["feature_row"]).features()[:, -1] for f, e in index.items()}
    np.savez(tmp_path / "prenorm.npz", **prenorm)
    info = trainer_reads("specforge", tmp_path / "sf", tmp_path / "got.npz", RANDOM_MODEL, str(tmp_path / "prenorm.npz"))
    assert info["rows"] == 4 and sorted(info["files"]) == sorted(index)  # rows in = rows accepted
    got = np.load(tmp_path / "got.npz")
    for i, name in enumerate(info["files"]):
        e = index[name]
        row = rows[e["index"]]
        n = e["tokens"]
        assert got[f"ids{i}"].tolist() == row["input_ids"][:n]
        assert got[f"mask{i}"].tolist() == row["loss_mask"][:n - 1] + [0]  # SpecForge zeroes the last position
        want = by_file[name.rsplit("/", 1)[-1]]
        assert got[f"aux{i}"].shape == (n, 3 * HIDDEN) and got[f"last{i}"].shape == (n, HIDDEN)
        assert within_fp8_then_bf16(got[f"aux{i}"], want[:, :-1].reshape(n, -1))
        # our numpy norm and transformers' module, on the same stored states: equal up to one bf16 step
        theirs = got[f"theirs{i}"]
        assert np.all(np.abs(got[f"last{i}"] - theirs) <= np.abs(theirs) * 2**-7 + 1e-6)
    assert info["batch"]["hidden_state"][0] == 4 and info["batch"]["target"][2] == HIDDEN
    assert LAYERS[-1] == norm.layers
