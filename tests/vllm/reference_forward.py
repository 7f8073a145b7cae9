"""The reference for captured hidden states: a transformers forward pass over given token ids.

Run with vLLM's python (it has torch and transformers; genqueue's virtualenv has neither):

    python tests/vllm/reference_forward.py MODEL

then one JSON line per sequence on stdin, `{"ids": [...], "layers": [...], "out": "x.npz"}`: it
writes the features [tokens, layers, hidden] to `out`, as float32 arrays `float32` (the model's
bf16 weights widened, computed in float32: the reference) and `bfloat16` (computed in bf16, as
the engine computes: how far bf16 arithmetic alone strays), and answers with a line
`{"out": "x.npz", "shape": [...]}`. The models load once.

Layer ids as vLLM's extract_hidden_states numbers them: k < L is transformers' hidden_states[k]
(0 = the embeddings); L, the layer count, is the last decoder layer's own output, taken by a
hook: transformers' hidden_states[L] has the final norm applied, vLLM's does not.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


class Forward:
    """One model in one dtype, with the hook that keeps the last decoder layer's output."""

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.model.eval()
        self.n_layers = self.model.config.num_hidden_layers
        self.last: dict[str, torch.Tensor] = {}
        self.model.model.layers[-1].register_forward_hook(self._keep)

    def _keep(self, _module: object, _args: object, out: object) -> None:
        self.last["h"] = out[0] if isinstance(out, tuple) else out  # type: ignore[assignment]

    def features(self, ids: list[int], layers: list[int]) -> np.ndarray:
        with torch.no_grad():
            result = self.model(torch.tensor([ids], dtype=torch.long), output_hidden_states=True)
        picked = [self.last["h"][0] if k == self.n_layers else result.hidden_states[k][0] for k in layers]
        return torch.stack(picked, dim=1).float().numpy()


def main() -> None:
    passes = {"float32": Forward(sys.argv[1], torch.float32), "bfloat16": Forward(sys.argv[1], torch.bfloat16)}
    for line in sys.stdin:
        job = json.loads(line)
        features = {name: f.features(job["ids"], job["layers"]) for name, f in passes.items()}
        np.savez(job["out"], **features)
        print(json.dumps({"out": job["out"], "shape": list(features["float32"].shape)}), flush=True)


if __name__ == "__main__":
    main()
