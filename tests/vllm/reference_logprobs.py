"""The reference for log-probability tables: a transformers forward pass's log-softmax over given ids.

Run with vLLM's python (it has torch and transformers; genqueue's virtualenv has neither):

    python tests/vllm/reference_logprobs.py MODEL

then one JSON line per sequence on stdin, `{"ids": [...], "start": P, "out": "x.npy"}`: it writes
the log-softmax of the next-token logits at positions P-1 .. len(ids)-2, the distributions the
tokens ids[P:] were drawn from, as float32 [len(ids) - P, vocab] (the model's bf16 weights widened,
computed in float32: what `--logprobs-mode raw_logprobs` returns before the engine's bf16
arithmetic), and answers `{"out": "x.npy", "shape": [...]}`. The model loads once.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    model.eval()
    for line in sys.stdin:
        job = json.loads(line)
        ids, start = job["ids"], job["start"]
        with torch.no_grad():
            logits = model(torch.tensor([ids], dtype=torch.long)).logits[0]
        lp = torch.log_softmax(logits[start - 1:len(ids) - 1].float(), dim=-1).numpy()
        np.save(job["out"], lp)
        print(json.dumps({"out": job["out"], "shape": list(lp.shape)}), flush=True)


if __name__ == "__main__":
    main()
