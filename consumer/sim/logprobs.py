"""The stand-in's log-probabilities, as vLLM's chat completions return them: with `logprobs: true`
and `top_logprobs: K`, `choices[0].logprobs.content` holds one entry per generated token, its
`token`, `logprob` and `top_logprobs` (K entries, most likely first); with
`return_tokens_as_token_ids` a token is named `"token_id:<id>"`, else by a text piece.

The tables are a fixed function of the generated ids (`standin_tables`): at each position the
generated token is the most likely, then K - 1 other ids, with log-probabilities -(j + 1) ln 2
less a small step by position, so each table is sorted and sums to less than 1. A K above the
stand-in's `--max-logprobs` is refused with vLLM's own 400. `garbled` plants a broken engine's
table (tests): that share of the answers, drawn from the request, has one table out of order.
"""

from __future__ import annotations

import math
import random
from typing import Any

#: vLLM's default --max-logprobs.
MAX_LOGPROBS = 20
#: The other ids of a table step through the stand-in's ids by this (a prime: distinct ids).
_STRIDE = 7919
_VOCAB = 1 << 17
_GARBLE_STREAM = 0x10B5


def standin_tables(output_ids: list[int], k: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """The sampled log-probabilities [T], top-K ids [T][K] and log-probabilities [T][K] of an
    answer whose generated ids are OUTPUT_IDS."""
    sampled, top_ids, top_lps = [], [], []
    for t, tok in enumerate(output_ids):
        lps = [-(j + 1) * math.log(2) - 0.001 * (t % 7) for j in range(k)]
        top_ids.append([tok] + [(tok + _STRIDE * j) % _VOCAB for j in range(1, k)])
        top_lps.append(lps)
        sampled.append(lps[0])
    return sampled, top_ids, top_lps


def too_many(body: dict[str, Any], max_logprobs: int) -> str | None:
    """vLLM's 400 message for a request asking for more top log-probabilities than MAX_LOGPROBS."""
    k = body.get("top_logprobs")
    if body.get("logprobs") and isinstance(k, int) and k > max_logprobs:
        return f"Requested sample logprobs of {k}, which is greater than max allowed: {max_logprobs}"
    return None


def content(body: dict[str, Any], output_ids: list[int], digest: int, garbled: float) -> dict[str, Any] | None:
    """`choices[0].logprobs` for a request BODY answered with OUTPUT_IDS (None: it asked for none)."""
    if not body.get("logprobs") or not output_ids:
        return None
    k = body.get("top_logprobs") or 0
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    def name(i: int) -> str:
        return f"token_id:{i}" if as_ids else f"w{i}"

    sampled, top_ids, top_lps = standin_tables(output_ids, k)
    if k >= 2 and garbled and random.Random(digest ^ _GARBLE_STREAM).random() < garbled:
        at = len(output_ids) // 2
        top_lps[at][0], top_lps[at][1] = top_lps[at][1], top_lps[at][0]
    return {"content": [{"token": name(tok), "logprob": lp, "bytes": None,
                         "top_logprobs": [{"token": name(i), "logprob": v, "bytes": None} for i, v in zip(ids, lps)]}
                        for tok, lp, ids, lps in zip(output_ids, sampled, top_ids, top_lps)]}
