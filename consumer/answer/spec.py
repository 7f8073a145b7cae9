"""An answer's speculative-decoding figures, read from the chat completion (pure, no I/O).

vLLM started with a drafter (`--speculative-config`) and `--per-request-spec-decode-metrics
summary|detailed` puts each request's figures in the body: `metrics.speculative_decoding`,
with `num_spec_tokens`, `acceptance_histogram` (index j: the verify steps that accepted
exactly j drafts, length num_spec_tokens + 1), `num_spec_steps`, `num_draft_tokens`,
`num_accepted_draft_tokens`, the derived `mean_acceptance_length` and `draft_acceptance_rate`,
and at `detailed` the per-step arrays. It is null for n > 1 and absent from an engine that
does not speculate or was not asked for them.

The figures are advisory: the answer is the same with or without them. A block that is
missing or null is no figures, silently; a block that is there but does not hold together
(a count of the wrong type, a histogram of the wrong length, totals that contradict it) is
ignored, with the reason returned so the caller can count and log it, and never fails the item.
Only counts are kept (common.contracts.SpecFigures); the engine's floats are derived from them.
"""

from __future__ import annotations

from genqueue.common.acceptance import PER_REQUEST_SPEC_FLAG
from genqueue.common.records import SpecFigures

__all__ = ["SpecFigures", "read_spec"]

#: A k past this is not a real engine's (vLLM's drafters propose a handful of tokens per step).
MAX_SPEC_TOKENS = 64


def read_spec(body: dict[str, object]) -> tuple[SpecFigures | None, str | None]:
    """The figures of the completion BODY, and why a block that was there was ignored:
    (figures, None), (None, None) when there is none, (None, reason) when it is malformed."""
    metrics = body.get("metrics")
    if metrics is None:
        return None, None
    if not isinstance(metrics, dict):
        return None, "metrics is not an object"
    block = metrics.get("speculative_decoding")
    if block is None:
        return None, None
    if not isinstance(block, dict):
        return None, "metrics.speculative_decoding is not an object"
    k, hist = block.get("num_spec_tokens"), block.get("acceptance_histogram")
    steps, drafted, accepted = (block.get(name) for name in
                                ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens"))
    for name, value in (("num_spec_tokens", k), ("num_spec_steps", steps), ("num_draft_tokens", drafted),
                        ("num_accepted_draft_tokens", accepted)):
        if not _count(value):
            return None, f"{name} is {value!r}, not a count"
    assert isinstance(k, int) and isinstance(steps, int) and isinstance(drafted, int) and isinstance(accepted, int)
    if not 1 <= k <= MAX_SPEC_TOKENS:
        return None, f"num_spec_tokens is {k}, not 1 to {MAX_SPEC_TOKENS}"
    if not (isinstance(hist, list) and all(_count(n) for n in hist)):
        return None, "acceptance_histogram is not a list of counts"
    if len(hist) != k + 1:
        return None, f"acceptance_histogram has {len(hist)} entries, not num_spec_tokens + 1 = {k + 1}"
    if sum(hist) != steps:
        return None, f"acceptance_histogram counts {sum(hist)} steps, num_spec_steps says {steps}"
    if sum(j * n for j, n in enumerate(hist)) != accepted:
        return None, (f"acceptance_histogram accepts {sum(j * n for j, n in enumerate(hist))} drafts, "
                      f"num_accepted_draft_tokens says {accepted}")
    if accepted > drafted:
        return None, f"num_accepted_draft_tokens {accepted} is more than num_draft_tokens {drafted}"
    if drafted > k * steps:
        return None, f"num_draft_tokens {drafted} is more than num_spec_tokens x num_spec_steps = {k * steps}"
    return {"k": k, "steps": steps, "drafted": drafted, "accepted": accepted, "hist": list(hist)}, None


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def speculation_note(probe: SpecFigures | None, engine_metrics: bool, engine_spec: bool, *,
                     capturing: bool = False) -> tuple[bool, str]:
    """The pre-flight's line on the engine's speculation: (a warning?, the line). PROBE: the
    figures of the probe's answer; ENGINE_METRICS: the engine's /metrics answered; ENGINE_SPEC:
    they have spec_decode counters (vLLM exports them only when a drafter runs). CAPTURING: the
    run captures hidden states, so the engine's speculative slot holds extract_hidden_states
    (counted as a drafter whose every draft is accepted): no drafter's figures to record."""
    if capturing:
        return False, ("the run captures hidden states, so the engine's speculative slot holds "
                       "extract_hidden_states, not a drafter: no acceptance figures to record")
    if probe is not None:
        return False, (f"the engine speculates, {probe['k']} draft tokens per step (its /metrics do not name the "
                       f"method); each answer's figures are recorded (the probe's answer: {probe['accepted']} of "
                       f"{probe['drafted']} draft tokens accepted in {probe['steps']} steps)")
    if engine_spec:
        return True, (f"the engine speculates (its /metrics has spec_decode counters) but its answers carry no "
                      f"per-request figures, so none is recorded: start vLLM with {PER_REQUEST_SPEC_FLAG} summary")
    if engine_metrics:
        return False, "the engine does not speculate (no spec_decode counters on its /metrics)"
    return False, "whether the engine speculates is unknown (its /metrics did not answer, its answer has no figures)"
