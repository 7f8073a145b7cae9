"""A stored row read by torch as a trainer reads it: `safetensors.torch.load` gives
torch.float8_e4m3fn codes that are byte for byte torch's own quantization of the same input
(speculators' fp8 connector's arithmetic), and bf16 rows as torch.bfloat16.

Needs a Python with torch and safetensors (the real-vLLM tier's virtualenv has both):
GENQUEUE_TORCH_PYTHON, or GENQUEUE_VLLM_PYTHON as scripts/vllm-tier sets it. Skipped without.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from genqueue.common.features import FeatureDtype, encode, pack_row

PYTHON = os.environ.get("GENQUEUE_TORCH_PYTHON") or os.environ.get("GENQUEUE_VLLM_PYTHON", "")

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not PYTHON, reason="no Python with torch (GENQUEUE_TORCH_PYTHON)")]

# What a trainer runs: torch's reading of the row, and speculators' quantization of the input.
TORCH_SIDE = r"""
import json, sys
import numpy as np, torch
from safetensors.torch import load
x = torch.from_numpy(np.load(sys.argv[1]))
out = {}
for dtype in ("fp8_e4m3", "bf16"):
    row = load(open(f"{sys.argv[2]}/{dtype}.safetensors", "rb").read())
    hs = row["hidden_states"]
    out[dtype] = {"dtype": str(hs.dtype), "shape": list(hs.shape), "ids": row["token_ids"].tolist()}
    if dtype == "fp8_e4m3":
        fp32 = x.float()
        amax = fp32.abs().amax(dim=(1, 2), keepdim=True)
        scale = (amax / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
        theirs = (fp32 / scale).to(torch.float8_e4m3fn)
        out[dtype]["codes_equal"] = bool(torch.equal(hs.view(torch.uint8), theirs.view(torch.uint8)))
        out[dtype]["scales_equal"] = bool(torch.equal(row["hidden_states_scales"], scale))
        decoded = hs.float() * row["hidden_states_scales"]
        out[dtype]["max_rel_err"] = float(((decoded - fp32).abs() / fp32.abs().clamp(min=1e-30))
                                          [fp32.abs() >= amax / 28672].max())
    else:
        out[dtype]["equal"] = bool(torch.equal(hs, x.to(torch.bfloat16)))
print(json.dumps(out))
"""


def test_torch_reads_rows_as_its_own_quantization_writes_them(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    # bf16 values as vLLM hands them over, layers of different magnitudes, a zero token
    x = (rng.normal(size=(40, 4, 96)) * np.array([0.05, 1.0, 8.0, 300.0])[None, :, None]).astype(ml_dtypes.bfloat16)
    x[7] = 0
    x32 = x.astype(np.float32)
    np.save(tmp_path / "x.npy", x32)
    ids = np.arange(40) * 7
    for dtype in FeatureDtype:
        (tmp_path / f"{dtype.value}.safetensors").write_bytes(
            pack_row("r", "00" * 8, (2, 10, 20, 30), ids, encode(x, dtype)))
    proc = subprocess.run([PYTHON, "-c", TORCH_SIDE, str(tmp_path / "x.npy"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    fp8, bf16 = got["fp8_e4m3"], got["bf16"]
    assert (fp8["dtype"], fp8["shape"], fp8["ids"]) == ("torch.float8_e4m3fn", [40, 4, 96], ids.tolist())
    assert fp8["codes_equal"] and fp8["scales_equal"]
    assert fp8["max_rel_err"] <= 1 / 17 + 2**-22
    assert (bf16["dtype"], bf16["shape"], bf16["equal"]) == ("torch.bfloat16", [40, 4, 96], True)
