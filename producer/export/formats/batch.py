"""`--format batch`: OpenAI Batch API output lines, `{"id", "custom_id", "response":
{"status_code", "request_id", "body": <chat.completion>}, "error": null}`, the record's id as
`custom_id`; the body holds the last answer (in mode regenerate, the final turn), and the line's
`acceptance` is that answer's. Never Parquet: it is the Batch API's JSONL output file.

Error records become the Batch error file's lines: an HTTP error as a response with its status
and `{"error": {...}}` body, anything else as `"response": null, "error": {"code", "message"}`.
"""

from __future__ import annotations

from collections.abc import Mapping

from genqueue.common.records import ErrorRecord, JobFailedRecord, ResultRecord, Usage
from genqueue.producer.export.formats.lines import META, line_id, record_figures, with_acceptance, with_meta
from genqueue.producer.export.formats.spec import FormatSpec, Line


def to_batch(rec: ResultRecord, *, per_turn: bool = False) -> Line:
    """The OpenAI Batch API output line of a success record."""
    key = str(rec.get("key", ""))
    turns = rec.get("turns") or []
    found: Usage = (turns[-1].get("usage") if turns else None) or rec.get("usage") or {}
    usage: Usage = {**found}
    if "total_tokens" not in usage:
        usage["total_tokens"] = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    message: Line = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning") is not None:
        message["reasoning"] = rec["reasoning"]
    if rec.get("tool_calls"):
        message["tool_calls"] = rec["tool_calls"]
    timings = rec.get("timings")
    finished = timings.get("finished_at") if timings else None
    body = {
        "id": f"chatcmpl-{key}",
        "object": "chat.completion",
        "created": int(finished or 0),
        "model": rec.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": rec.get("finish_reason"), "logprobs": None}],
        "usage": usage,
        "system_fingerprint": rec.get("fingerprint"),
    }
    out: Line = {"id": f"batch_req_{key}", "custom_id": line_id(rec, per_turn=per_turn),
                 "response": {"status_code": 200, "request_id": f"req_{key}", "body": body}, "error": None}
    with_meta(rec, out, META + ("model", "fingerprint", "outcome", "stopped"))
    return with_acceptance(out, record_figures(rec)[-1:])  # the body's answer: the last


def batch_error(rec: ErrorRecord | JobFailedRecord, *, per_turn: bool = False) -> Line:
    """The OpenAI Batch API error-file line of an error record: an HTTP error (the server's
    status is known) as a response holding the error body, anything else as `error`."""
    key = str(rec.get("key", ""))
    err: Mapping[str, object] = rec.get("error") or {}
    status, message, cls = err.get("status"), str(err.get("message", "")), str(err.get("class", "unknown"))
    out: Line = {"id": f"batch_req_{key}", "custom_id": line_id(rec, per_turn=per_turn)}
    if isinstance(status, int) and not isinstance(status, bool):
        body = {"error": {"message": message, "type": str(err.get("type", "")), "param": None, "code": cls}}
        out["response"] = {"status_code": status, "request_id": f"req_{key}", "body": body}
        out["error"] = None
    else:
        out["response"] = None
        out["error"] = {"code": cls, "message": message}
    return with_meta(rec, out, META + ("fingerprint",))


SPEC = FormatSpec("OpenAI Batch API output lines", to_batch, error_line=batch_error,
                  not_parquet="the Batch API's JSONL output file")
