"""A capture pass's item (`producer capture`, common/prefill.py): one prefill-only request over the
source run's token ids, its hidden states kept as the source's feature row.

The ids go to /v1/completions as the prompt, with `max_tokens: 1` and `kv_transfer_params` asking
for the prompt's hidden states alone (common/prefill.py's PREFILL_FIELDS): the engine
writes a file of exactly the ids sent. The FeatureSink checks the file's ids are those ids (a
capture that is not is a BadCaptureError: the item's error, class bad_capture, nothing stored)
and stores the row under the source's row id before the record is built. The request is retried
as every request is (Generator.retrying); the one token generated is not kept.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from genqueue.common.contracts import ErrorClass, Item, error_info
from genqueue.common.errors import BadResponseError, PermanentError, TransientError
from genqueue.common.prefill import PREFILL_FIELDS
from genqueue.common.settings import RunSettings
from genqueue.consumer.answer import records
from genqueue.consumer.answer.completion import snippet
from genqueue.consumer.answer.sinks import FeatureSink

#: Why a prefill answer is not usable when the server named no capture file.
NO_CAPTURE = ("a capture pass's prefill came back without kv_transfer_params.hidden_states_path (an engine started "
              "without extract_hidden_states and its connector?)")


def prefill_body(model: str, token_ids: list[int]) -> dict[str, object]:
    """The /v1/completions body of a prefill over TOKEN_IDS that captures them."""
    return {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0,
            **PREFILL_FIELDS}


def capture_path(resp: object) -> str:
    """The capture file a /v1/completions answer names. Raises BadResponseError."""
    if not isinstance(resp, dict) or not isinstance(resp.get("choices"), list):
        raise BadResponseError("a prefill's answer is not a completion (no choices)", snippet=snippet(str(resp)))
    kv = resp.get("kv_transfer_params")
    path = kv.get("hidden_states_path") if isinstance(kv, dict) else None
    if not isinstance(path, str) or not path:
        raise BadResponseError(NO_CAPTURE, snippet="")
    return path


async def prefill(item: Item, run: str, settings: RunSettings, model: str, *, sink: FeatureSink | None,
                  complete: Callable[[dict[str, object]], Awaitable[object]],
                  retrying: Callable[[Callable[[], Awaitable[str]]], Awaitable[str]],
                  request_id: Callable[[], str] | None) -> records.Ending:
    """What ITEM, a capture pass's item of RUN, comes to: its row stored in SINK, or why not.
    COMPLETE posts a /v1/completions body, RETRYING runs a request under the generator's retry
    policy, REQUEST_ID names this consumer on the engine's capture file."""
    spec = item["prefill"]
    capture = settings.capture
    if capture is None or settings.prefill is None or sink is None:
        return records.Refused([], error_info(ErrorClass.INVALID_ITEM, "InvalidItem",
                                              "a capture pass's item in a run that is no capture pass"))
    ids = spec["token_ids"]
    body = prefill_body(model, ids)
    if request_id is not None:  # names this consumer on the engine's file (consumer/capture/owner.py)
        body["request_id"] = request_id()

    async def once() -> str:
        return capture_path(await complete(body))

    try:
        path = await retrying(once)
        ref = await sink.keep(run, capture, model, spec["row"], path, ids)
    except (PermanentError, TransientError) as e:
        return records.Failed([], e)
    return records.Prefilled(ref, settings.prefill.source)
