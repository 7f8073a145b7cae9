"""The reference forward pass of `producer check-features`: transformers, the model's own
weights, in float32, run by a Python with torch and transformers (genqueue's own need neither),
kept running while rows are checked so the model loads once.

The protocol, one JSON line each way per row: `{"ids": [...], "layers": [...], "out": "x.npy"}`
in; the features [tokens, layers, hidden] as float32 written to `out`, then `{"out": ..., "shape":
[...]}` (or `{"error": ...}`, then exit) back. Layer ids as a capture names them: k < L is
transformers' hidden_states[k] (0: the embeddings); L, the layer count, the last decoder layer's
own output, taken by a hook (transformers' hidden_states[L] has the final norm applied, vLLM's
capture does not).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any, Self

import numpy as np

from genqueue.common.errors import FeatureError, UserError
from genqueue.common.features.codec import Float32Array

REFERENCE_FORWARD = r"""
import json, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM
torch.set_grad_enabled(False)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).to(device).eval()
config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
n_layers = config.num_hidden_layers
decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
kept = {}
decoder.layers[-1].register_forward_hook(lambda m, a, out: kept.__setitem__("h", out[0] if isinstance(out, tuple) else out))
print(json.dumps({"ready": n_layers}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    bad = [k for k in job["layers"] if not 0 <= k <= n_layers]
    if bad:
        print(json.dumps({"error": f"layer ids {bad} outside the model's 0..{n_layers}"}), flush=True)
        sys.exit(1)
    result = model(torch.tensor([job["ids"]], dtype=torch.long, device=device), output_hidden_states=True)
    picked = [kept["h"][0] if k == n_layers else result.hidden_states[k][0] for k in job["layers"]]
    out = torch.stack(picked, dim=1).float().cpu().numpy()
    np.save(job["out"], out)
    print(json.dumps({"out": job["out"], "shape": list(out.shape)}), flush=True)
"""

#: Quiet, offline: the model is a local folder, and the protocol owns stdout.
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
       "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def check_python(python: str) -> None:
    """Refuse (UserError) a Python that cannot import torch and transformers."""
    try:
        proc = subprocess.run([python, "-c", "import torch, transformers"], capture_output=True, text=True,
                              timeout=300, check=False)
    except OSError as e:
        raise UserError(f"--torch-python {python}: cannot run it: {e.strerror or e}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no error text"])[-1]
        raise UserError(f"--torch-python {python} cannot import torch and transformers: {last}")


class ReferenceForward:
    """REFERENCE_FORWARD run by PYTHON over MODEL_DIR; `features(ids, layers)` per row. A
    context manager: the process ends with it."""

    def __init__(self, python: str, model_dir: Path) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="gq-reference-")
        self._stderr: IO[str] = open(Path(self._tmp.name) / "stderr", "w+")  # noqa: SIM115 (closed in close)
        self._count = 0
        self.proc = subprocess.Popen([python, "-c", REFERENCE_FORWARD, str(model_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     env={**os.environ, **ENV})
        try:
            self.layers = int(self._answer("loading the model")["ready"])
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _answer(self, doing: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        try:
            answer: dict[str, Any] = json.loads(line) if line else {}
        except ValueError:
            answer = {}
        if not answer or "error" in answer:
            self._stderr.seek(0)
            last = (self._stderr.read().strip().splitlines() or ["no error text"])[-1]
            raise FeatureError(f"the reference forward pass failed {doing}: {answer.get('error') or last}")
        return answer

    def features(self, ids: list[int], layers: tuple[int, ...]) -> Float32Array:
        """The reference's features [tokens, layers, hidden] over IDS."""
        assert self.proc.stdin is not None
        self._count += 1
        out = Path(self._tmp.name) / f"row-{self._count}.npy"
        try:
            self.proc.stdin.write(json.dumps({"ids": ids, "layers": list(layers), "out": str(out)}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # its answer says why
        self._answer(f"on {len(ids)} tokens")
        got: Float32Array = np.load(out).astype(np.float32, copy=False)
        out.unlink()
        return got

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        self._tmp.cleanup()
