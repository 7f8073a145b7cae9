"""The stand-in's speculative decoding, per request (pure: the caller passes the random source).

With --spec-tokens K each answer is decoded in verify steps: K drafts proposed, each accepted
with probability P given the ones before it were (vLLM verifies a draft only after the ones
before it), so a step accepts j drafts and yields j + 1 tokens. P is --spec-acceptance, or the
P of the first --spec-acceptance-for rule the request matches:

    text=SUBSTR:P   a request whose messages contain SUBSTR (a source's marker, for instance)
    tokens>=N:P     an answer of at least N tokens

so a test can plant a category where the drafter is weak. Each request's steps are drawn from
a random source seeded by the request, and the counts are what vLLM returns as
`metrics.speculative_decoding` (--per-request-spec-decode-metrics summary|detailed) and adds to
its /metrics counters. A step's accepted drafts are not cut at the answer's end (vLLM counts
what it verified): the expected draft acceptance rate is (P + P^2 + ... + P^K) / K.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class SpecMetrics(StrEnum):
    """vLLM's --per-request-spec-decode-metrics: whether answers carry their figures."""

    NONE = "none"
    SUMMARY = "summary"
    DETAILED = "detailed"


@dataclass(frozen=True, slots=True)
class SpecRule:
    """A category of requests whose drafts are accepted with their own probability."""

    acceptance: float
    text: str | None = None  # the messages contain it
    min_tokens: int | None = None  # the answer has at least this many tokens

    def matches(self, text: str, n_out: int) -> bool:
        if self.text is not None:
            return self.text in text
        return self.min_tokens is not None and n_out >= self.min_tokens

    def __str__(self) -> str:
        where = f"text={self.text}" if self.text is not None else f"tokens>={self.min_tokens}"
        return f"{where}:{self.acceptance:g}"


_RULE = re.compile(r"^(?:text=(?P<text>.+)|tokens>=(?P<tokens>\d+)):(?P<p>[0-9.]+)$", re.DOTALL)


def parse_rule(raw: str) -> SpecRule:
    """RAW (`text=SUBSTR:P` or `tokens>=N:P`) as a SpecRule; ValueError with the expected shape."""
    m = _RULE.match(raw)
    try:
        p = float(m["p"]) if m is not None else -1.0
    except ValueError:
        p = -1.0
    if m is None or not 0 <= p <= 1:
        raise ValueError(f"{raw!r} is not text=SUBSTR:P or tokens>=N:P with P from 0 to 1")
    if m["text"] is not None:
        return SpecRule(p, text=m["text"])
    return SpecRule(p, min_tokens=int(m["tokens"]))


def acceptance_for(rules: Sequence[SpecRule], default: float, messages: list[Any], n_out: int) -> float:
    """The acceptance probability of a request with MESSAGES and an answer of N_OUT tokens."""
    if not rules:
        return default
    text = "\n".join(m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
    for rule in rules:
        if rule.matches(text, n_out):
            return rule.acceptance
    return default


def draw(rng: random.Random, k: int, p: float, n_out: int, level: SpecMetrics) -> dict[str, Any]:
    """The figures of an answer of N_OUT tokens decoded with K drafts a step, each accepted with
    probability P given those before it: vLLM's `metrics.speculative_decoding` block (the
    per-step arrays at DETAILED). The first token comes from the prefill, not from a step."""
    hist = [0] * (k + 1)
    per_step: list[int] = []
    made = 1
    while made < n_out:
        j = 0
        while j < k and rng.random() < p:
            j += 1
        hist[j] += 1
        made += j + 1
        if level == SpecMetrics.DETAILED:
            per_step.append(j)
    steps = sum(hist)
    accepted = sum(j * n for j, n in enumerate(hist))
    block: dict[str, Any] = {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / (k * steps) if steps else 0.0,
        "acceptance_histogram": hist, "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": k * steps, "num_spec_tokens": k, "per_step_accepted": None, "per_step_drafted": None}
    if per_step:
        block["per_step_accepted"] = per_step
        block["per_step_drafted"] = [k] * len(per_step)
    return block
