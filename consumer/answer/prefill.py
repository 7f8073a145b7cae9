"""A capture pass's item (`producer capture`, common/prefill.py): one prefill-only request over the
source run's token ids, its hidden states, or its generated tokens' log-probability tables, kept
as the source's feature row.

The ids go to /v1/completions as the prompt, with `max_tokens: 1`. For hidden states the body
carries `kv_transfer_params` asking for the prompt's alone (common/prefill.py's PREFILL_FIELDS):
the engine writes a file of exactly the ids sent. The FeatureSink checks the file's ids are
those ids (a capture that is not is a BadCaptureError: the item's error, class bad_capture,
nothing stored) and stores the row under the source's row id before the record is built.

For a --logprobs K pass the body asks `prompt_logprobs: K + 1` (prompt_fields). vLLM answers
`choices[0].prompt_logprobs`: per prompt position (None for the first) a dict id -> {logprob,
rank, decoded_token} of the position's own token and the most likely ones. The positions of the
answer's generated tokens (the item's `completion` last ids) are put in the shape of a chat
completion's `logprobs.content` (`prompt_content`), the position's own token as the sampled one,
and handed to the TableSink: parse, checks and row as an in-generation table's. A list not of
one entry per id sent, a position whose dict lacks its own token, or ids scored
(`prompt_token_ids`) that are not those sent, is a BadLogprobsError: nothing stored.

The request is retried as every request is (Generator.retrying); its one token is not kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from genqueue.common.contracts import ErrorClass, Item
from genqueue.common.prefill import PREFILL_FIELDS, prompt_fields
from genqueue.common.records import error_info
from genqueue.common.settings import RunSettings
from genqueue.consumer.answer import records
from genqueue.consumer.answer.completion import snippet
from genqueue.consumer.answer.faults import BadLogprobsError, BadResponseError, PermanentError, TransientError
from genqueue.consumer.answer.sinks import FeatureSink, TableSink

#: Why a prefill answer is not usable when the server named no capture file.
NO_CAPTURE = ("a capture pass's prefill came back without kv_transfer_params.hidden_states_path (an engine started "
              "without extract_hidden_states and its connector?)")
#: A chat completion's name for a token given by id (return_tokens_as_token_ids).
TOKEN_PREFIX = "token_id:"


def prefill_body(model: str, token_ids: list[int], logprobs: int | None = None) -> dict[str, object]:
    """The /v1/completions body of a prefill over TOKEN_IDS that captures them (hidden states),
    or that scores them with the top LOGPROBS (+ 1) log-probabilities at each position."""
    extra = prompt_fields(logprobs) if logprobs is not None else PREFILL_FIELDS
    return {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0, **extra}


def capture_path(resp: object) -> str:
    """The capture file a /v1/completions answer names. Raises BadResponseError."""
    if not isinstance(resp, dict) or not isinstance(resp.get("choices"), list):
        raise BadResponseError("a prefill's answer is not a completion (no choices)", snippet=snippet(str(resp)))
    kv = resp.get("kv_transfer_params")
    path = kv.get("hidden_states_path") if isinstance(kv, dict) else None
    if not isinstance(path, str) or not path:
        raise BadResponseError(NO_CAPTURE, snippet="")
    return path


def prompt_logprobs(resp: object) -> tuple[list[Any], object]:
    """`choices[0].prompt_logprobs` of a /v1/completions answer, and its `prompt_token_ids` (None:
    the engine returned none). Raises BadResponseError."""
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadResponseError("a prefill's answer is not a completion (no choices)", snippet=snippet(str(resp)))
    listed = choices[0].get("prompt_logprobs")
    if not isinstance(listed, list):
        raise BadResponseError("a --logprobs pass's prefill came back without choices[0].prompt_logprobs (an "
                               "engine that does not score prompts?)", snippet="")
    return listed, choices[0].get("prompt_token_ids")


def prompt_content(listed: list[Any], ids: list[int], completion: int,
                   scored: object = None) -> list[dict[str, Any]]:
    """The last COMPLETION positions of LISTED (vLLM's prompt_logprobs for the prompt IDS) in the
    shape of a chat completion's `logprobs.content` with tokens named by id: the position's own
    token as `token` and `logprob`, every listed entry in `top_logprobs`, in vLLM's order. Raises
    BadLogprobsError when SCORED (the engine's prompt_token_ids, when it returned them) are not
    IDS, LISTED is not one entry per id, or a position lacks its own token."""
    if scored is not None and scored != ids:
        theirs = scored if isinstance(scored, list) else []
        at = next((p for p, (a, b) in enumerate(zip(ids, theirs, strict=False)) if a != b), min(len(ids), len(theirs)))
        raise BadLogprobsError(f"the engine scored other ids than those sent (prompt_token_ids differ at position "
                               f"{at} of {len(ids)})")
    if len(listed) != len(ids):
        raise BadLogprobsError(f"the prompt's log-probabilities hold {len(listed)} positions, the prompt sent "
                               f"{len(ids)}: not the ids sent")
    if not 0 < completion < len(ids):
        raise BadLogprobsError(f"a pass's row of {len(ids)} ids names {completion} generated ones")
    out = []
    for p in range(len(ids) - completion, len(ids)):
        table = listed[p]
        where = f"prompt_logprobs[{p}]"
        if not isinstance(table, dict):
            raise BadLogprobsError(f"{where} is no table of log-probabilities")
        own = table.get(str(ids[p]))
        if not isinstance(own, dict):
            raise BadLogprobsError(f"{where} does not list the position's own token (vLLM lists it beside the "
                                   "most likely): not the ids sent")
        top = [{"token": TOKEN_PREFIX + tid, "logprob": e.get("logprob") if isinstance(e, dict) else None}
               for tid, e in table.items()]
        out.append({"token": f"{TOKEN_PREFIX}{ids[p]}", "logprob": own.get("logprob"), "top_logprobs": top})
    return out


async def prefill(item: Item, run: str, settings: RunSettings, model: str, *, sink: FeatureSink | None,
                  complete: Callable[[dict[str, object]], Awaitable[object]],
                  retrying: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]],
                  request_id: Callable[[], str] | None, tables: TableSink | None = None) -> records.Ending:
    """What ITEM, a capture pass's item of RUN, comes to: its row stored in SINK (hidden states)
    or TABLES (log-probabilities), or why not. COMPLETE posts a /v1/completions body, RETRYING
    runs a request under the generator's retry policy, REQUEST_ID names this consumer on the
    engine's capture file."""
    if settings.prefill is None:
        return records.Refused([], error_info(ErrorClass.INVALID_ITEM, "InvalidItem",
                                              "a capture pass's item in a run that is no capture pass"))
    if settings.logprobs is not None:
        return await _tables(item, run, settings, model, settings.prefill.source, tables, complete, retrying)
    spec = item["prefill"]
    capture = settings.capture
    if capture is None or sink is None:
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
    return records.Prefilled(ref, settings.prefill.source, len(ids))


async def _tables(item: Item, run: str, settings: RunSettings, model: str, source: str, tables: TableSink | None,
                  complete: Callable[[dict[str, object]], Awaitable[object]],
                  retrying: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> records.Ending:
    """A --logprobs pass's item: its completion positions' tables stored in TABLES."""
    spec = item["prefill"]
    ids, completion = spec["token_ids"], spec.get("completion", 0)
    if tables is None or not completion:
        why = ("a --logprobs pass's item names no generated ids to score" if tables is not None
               else "a --logprobs pass's item reached a consumer with no table sink")
        return records.Refused([], error_info(ErrorClass.INVALID_ITEM, "InvalidItem", why))
    body = prefill_body(model, ids, settings.logprobs)

    async def once() -> tuple[list[Any], object]:
        return prompt_logprobs(await complete(body))

    try:
        listed, scored = await retrying(once)
        content = await asyncio.to_thread(prompt_content, listed, ids, completion, scored)
        ref = await tables.keep(run, settings, model, spec["row"], content, ids[len(ids) - completion:])
    except (PermanentError, TransientError) as e:
        return records.Failed([], e)
    return records.Prefilled(None, source, len(ids), ref)
