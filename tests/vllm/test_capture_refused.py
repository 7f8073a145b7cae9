"""A --capture run on a real vLLM started without capture (no extract_hidden_states, no connector:
vLLM takes the request's kv_transfer_params and names no file): refused at the consumer's
pre-flight in one line naming the flags to start vLLM with, before any item is taken."""

from __future__ import annotations

from genqueue.common.contracts import ExitCode
from tests.conftest import sharegpt
from tests.vllm.conftest import VllmServer
from tests.vllm.pipeline import consume, enqueue, results, rq_counts


def test_a_capture_run_on_an_engine_that_does_not_capture_is_refused_before_any_item(
        tmp_path, redis_url, conn, vllm: VllmServer) -> None:
    enqueue(tmp_path, redis_url, "nocap", [sharegpt(i, turns=2) for i in range(6)], "--capture", "hidden-states",
            "--capture-layers", "1,2", "--token-ids", "--batch-size", "2")
    c = consume(tmp_path, redis_url, vllm.url, "nocap", code=ExitCode.PREFLIGHT)
    lines = [line for line in c.output().splitlines() if "pre-flight failed" in line]
    assert len(lines) == 1, c.output()
    assert "named no capture file in the probe's answer" in lines[0], lines[0]
    assert "start vLLM with --speculative-config" in lines[0] and '"eagle_aux_hidden_state_layer_ids":[1,2]' in lines[0]
    assert "--kv-transfer-config" in lines[0] and "PYTHONPATH=" in lines[0]
    assert rq_counts(conn, "nocap") == {"queued": 3, "started": 0, "finished": 0, "failed": 0}, "no job was taken"
    assert results(tmp_path, "nocap") == []
