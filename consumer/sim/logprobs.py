"""The stand-in's log-probabilities, as vLLM 0.32's chat completions return them: with `logprobs:
true` and `top_logprobs: N`, `choices[0].logprobs.content` holds one entry per generated token, its
`token`, `logprob` and `top_logprobs`: the generated token first, then the most likely in rank
order (the generated one not again), cut at N, as vLLM builds its dict (sampled first, then the
top N, a repeated id keeping its first place). With `return_tokens_as_token_ids` a token is named
`"token_id:<id>"`, else by a text piece.

The distribution is a fixed function of the generated ids (`standin_tables` gives its true top K,
for tests): at position t the rank-j token (j from 1) has log-probability -j ln 2 less a small step
by position, so probabilities sum below 1; the generated token sits at rank 1 + (id + t) % 8, so it
is often not the most likely and sometimes outside the top K, as sampling makes it. A request for
more than the stand-in's `--max-logprobs` is refused with vLLM's own 400. `processed` answers as an
engine started with a processed `--logprobs-mode` does: the values over the request's temperature.
`prompt_tables` answers a
completion's `prompt_logprobs` with the same distribution, a prompt position p as position t = p
(`garbled`: that share scores one prompt id wrong, prompt_scored).
`garbled` plants a broken
engine (tests): that share of the answers, drawn from the request, names one generated token by
another id than the one generated.
"""

from __future__ import annotations

import math
import random
from typing import Any

#: vLLM's default --max-logprobs.
MAX_LOGPROBS = 20
#: The other ids of a distribution step through the ids by this (a prime: distinct ids).
_STRIDE = 7919
_VOCAB = 1 << 17
_RANKS = 8  # the generated token's rank runs over 1.._RANKS
_GARBLE_STREAM = 0x10B5


def _ranked(tok: int, t: int, n: int) -> list[tuple[int, float]]:
    """The N most likely (id, log-probability) at position T whose generated token is TOK."""
    rank = 1 + (tok + t) % _RANKS
    others = ((tok + _STRIDE * m) % _VOCAB for m in range(1, n + 1))
    ids = [tok if j == rank else next(others) for j in range(1, n + 1)]
    return [(i, -j * math.log(2) - 0.001 * (t % 7)) for j, i in enumerate(ids, start=1)]


def _sampled(tok: int, t: int) -> float:
    return -(1 + (tok + t) % _RANKS) * math.log(2) - 0.001 * (t % 7)


def standin_tables(output_ids: list[int], k: int, start: int = 0) -> tuple[list[float], list[list[int]],
                                                                           list[list[float]]]:
    """The sampled log-probabilities [T], the true top-K ids [T][K] and their log-probabilities
    [T][K], most likely first, of an answer whose generated ids are OUTPUT_IDS (a prompt's
    positions from START on: `prompt_logprobs`' tables of ids whose first is at START)."""
    sampled, top_ids, top_lps = [], [], []
    for t, tok in enumerate(output_ids, start=start):
        top = _ranked(tok, t, k)
        top_ids.append([i for i, _ in top])
        top_lps.append([v for _, v in top])
        sampled.append(_sampled(tok, t))
    return sampled, top_ids, top_lps


def too_many(body: dict[str, Any], max_logprobs: int) -> str | None:
    """vLLM's 400 message for a request asking for more top log-probabilities than MAX_LOGPROBS."""
    k = body.get("top_logprobs")
    if body.get("logprobs") and isinstance(k, int) and k > max_logprobs:
        return f"Requested sample logprobs of {k}, which is greater than max allowed: {max_logprobs}"
    return None


def too_many_prompt(body: dict[str, Any], max_logprobs: int) -> str | None:
    """vLLM's 400 message for a completion asking for more prompt log-probabilities than MAX_LOGPROBS."""
    k = body.get("prompt_logprobs")
    if isinstance(k, int) and k > max_logprobs:
        return f"Requested prompt logprobs of {k}, which is greater than max allowed: {max_logprobs}"
    return None


def prompt_scored(ids: list[int], digest: int, garbled: float) -> list[int]:
    """The ids a completion's prompt_logprobs score for a prompt of IDS: IDS, but for a GARBLED
    share of the requests (drawn from DIGEST) one in the middle replaced by the next id, as an
    engine that scored other ids than those sent (its prompt_token_ids say so)."""
    if not garbled or len(ids) < 2 or random.Random(digest ^ _GARBLE_STREAM).random() >= garbled:
        return ids
    wrong = list(ids)
    wrong[len(ids) // 2] += 1
    return wrong


def prompt_tables(body: dict[str, Any], ids: list[int]) -> list[dict[str, Any] | None] | None:
    """`choices[0].prompt_logprobs` for a /v1/completions BODY whose prompt is IDS (None: it asked
    for none): None for the first position, then a dict id -> {logprob, rank, decoded_token} per
    position, the N most likely and the position's own token (with its own rank), the distribution
    at position p that of a generated token ids[p] at t = p (standin_tables with START)."""
    n = body.get("prompt_logprobs")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    out: list[dict[str, Any] | None] = [None]
    for p in range(1, len(ids)):
        tok = ids[p]
        rank = 1 + (tok + p) % _RANKS
        table = {str(i): {"logprob": lp, "rank": j, "decoded_token": f"w{i}"}
                 for j, (i, lp) in enumerate(_ranked(tok, p, n), start=1)}
        table.setdefault(str(tok), {"logprob": _sampled(tok, p), "rank": rank, "decoded_token": f"w{tok}"})
        out.append(table)
    return out


def content(body: dict[str, Any], output_ids: list[int], digest: int, garbled: float,
            processed: bool = False) -> dict[str, Any] | None:
    """`choices[0].logprobs` for a request BODY answered with OUTPUT_IDS (None: it asked for none)."""
    if not body.get("logprobs") or not output_ids:
        return None
    n = body.get("top_logprobs") or 0
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    temperature = body.get("temperature")
    scale = 1 / temperature if processed and isinstance(temperature, int | float) and temperature > 0 else 1.0

    def entry(i: int, lp: float) -> dict[str, Any]:
        return {"token": f"token_id:{i}" if as_ids else f"w{i}", "logprob": lp * scale, "bytes": None}

    wrong = len(output_ids) // 2 if garbled and random.Random(digest ^ _GARBLE_STREAM).random() < garbled else -1
    out = []
    for t, tok in enumerate(output_ids):
        listed = {tok: _sampled(tok, t)}  # vLLM's order: the sampled token first, then by rank
        for i, lp in _ranked(tok, t, n):
            listed.setdefault(i, lp)
        top = [entry(i, lp) for i, lp in list(listed.items())[:n]]
        out.append({**entry(tok + 1 if t == wrong else tok, _sampled(tok, t)), "top_logprobs": top})
    return {"content": out}
