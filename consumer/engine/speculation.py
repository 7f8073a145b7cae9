"""Whether speculative decoding pays at the engine's load (pure policy, no I/O): from the
draft tokens a verify step proposes (k) and the share accepted, at the batch the engine runs.

A verify step of B sequences with k drafts computes B x (1 + k) tokens: under the compute knee
(memory-bound) that costs about one step, past it time grows with the tokens; each draft adds
its drafter's own pass. The gain is the tokens a step yields over its cost, against one token a
sequence without speculation (docs/operations.md, "Does speculation pay"). The doctor
(doctor.py) judges its window with `judge_spec` and holds the judgement as it holds its verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from genqueue.common.engineview import SpecPays

Numbers = dict[str, float | int | str | None]


class SpecCosts(Protocol):
    """The settings judge_spec reads (the doctor's DoctorSettings)."""

    @property
    def spec_knee(self) -> int: ...
    @property
    def spec_draft_cost(self) -> float: ...
    @property
    def spec_margin(self) -> float: ...


class SpecRegime(StrEnum):
    """Where a verify step of the engine's batch stands against the compute knee."""

    MEMORY_BOUND = "memory-bound"  # under it: the drafts' tokens are computed nearly free
    COMPUTE_BOUND = "compute-bound"  # past it: every token a step computes costs time


@dataclass(frozen=True, slots=True)
class SpecJudgement:
    """Whether speculative decoding pays at the window's load, and what to change."""

    pays: SpecPays
    regime: SpecRegime
    k: int  # num_speculative_tokens (draft tokens / drafts)
    acceptance: float  # a draft's chance of acceptance given those before it were (from the rate)
    mean_length: float  # tokens a verify step yields: 1 + accepted / drafts
    batch: float  # running, averaged over the window
    gain: float  # expected throughput with speculation over without, less 1
    best_k: int  # the k of 0..k with the highest expected gain (0: off)
    best_gain: float
    pays_under: int | None  # at this many running or fewer K's steps are memory-bound and it pays (None: no advice)
    advice: str
    share: float = 1.0  # of the sequences' steps, those that drafted (n-gram drafts only on a match)

    def numbers(self) -> Numbers:
        return {"spec_verdict": self.pays.value, "spec_regime": self.regime.value, "spec_k": self.k,
                "spec_draft_acceptance": round(self.acceptance, 3), "spec_batch": round(self.batch, 1),
                "spec_drafted_share": round(self.share, 3),
                "spec_tokens_per_step": round(self.batch * (1 + self.share * self.k)), "spec_gain": round(self.gain, 3),
                "spec_best_k": self.best_k, "spec_best_gain": round(self.best_gain, 3),
                "spec_pays_under": self.pays_under}


def step_cost(batch: float, k: int, knee: int, draft_cost: float) -> float:
    """A verify step's time in memory-bound steps: BATCH sequences with K drafts compute
    BATCH x (1 + K) tokens; under KNEE (0: none) that costs one step, past it time grows with the
    tokens; each draft adds DRAFT_COST of a step (the drafter's own pass)."""
    compute = batch * (1 + k) / knee if knee > 0 else 0.0
    return max(1.0, compute) + draft_cost * k


def spec_gain(k: int, p: float, batch: float, knee: int, draft_cost: float, share: float = 1.0) -> float:
    """Expected throughput with K drafts (each accepted with P given those before it were) over
    without, less 1, at BATCH, when a SHARE of the steps draft (n-gram drafts only where the text
    repeats): a step yields 1 + share x (p + ... + p^K) tokens per sequence and computes
    1 + share x K, against one token a sequence for step_cost(0)."""
    length = 1 + share * sum(p**i for i in range(1, k + 1))
    drafted = step_cost(batch * (1 + share * k), 0, knee, 0.0) + draft_cost * share * k
    return length * step_cost(batch, 0, knee, 0.0) / drafted - 1


def draft_acceptance(k: int, accepted_per_step: float) -> float:
    """P such that p + p^2 + ... + p^K = ACCEPTED_PER_STEP (vLLM verifies a draft only after the
    ones before it were accepted): the per-draft acceptance the window's rate implies."""
    target = min(max(accepted_per_step, 0.0), float(k))
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _batch_text(batch: float) -> str:
    """A window's mean batch as the advice shows it: whole when it is, else to a tenth, so that
    "batch B x (1 + k) = T tokens a step" multiplies out (7.5 x 4 = 30, never "8 x 4 = 30")."""
    return f"{batch:.0f}" if abs(batch - round(batch)) < 0.05 else f"{batch:.1f}"


def judge_spec(k: int, accepted_per_step: float, batch: float, s: SpecCosts,
               share: float = 1.0) -> SpecJudgement:
    """Whether K drafts a step, ACCEPTED_PER_STEP of them accepted, pay at BATCH running when a
    SHARE of the steps draft (docs/operations.md, "Does speculation pay"), and the change that
    would pay most."""
    p = draft_acceptance(k, accepted_per_step)
    knee, cost = s.spec_knee, s.spec_draft_cost
    gain = spec_gain(k, p, batch, knee, cost, share)
    best_k, best_gain = max(((j, spec_gain(j, p, batch, knee, cost, share)) for j in range(k + 1)),
                            key=lambda x: x[1])
    tokens = batch * (1 + share * k)
    regime = SpecRegime.COMPUTE_BOUND if knee > 0 and tokens > knee else SpecRegime.MEMORY_BOUND
    pays = (SpecPays.PAYS if gain >= s.spec_margin else SpecPays.COSTS if gain <= -s.spec_margin
            else SpecPays.EVEN)
    # the most running at which K's steps stay memory-bound: where it pays its best
    under = knee // (1 + k) if knee > 0 else 0
    pays_under = (under if pays != SpecPays.PAYS and 1 <= under < batch
                  and spec_gain(k, p, under, knee, cost, share) >= s.spec_margin else None)
    length = 1 + accepted_per_step
    where = "past" if regime == SpecRegime.COMPUTE_BOUND else "within"
    drafting = f"(1 + {k})" if share >= 0.95 else f"(1 + {k} in the {share:.0%} of steps that draft)"
    why = (f"{regime.value}: batch {_batch_text(batch)} x {drafting} = {tokens:.0f} tokens a step, {where} the knee of "
           f"{knee}; mean accepted length {length:.2f}")
    better = best_k != k and best_gain - gain >= s.spec_margin
    if pays == SpecPays.COSTS:
        advice = f"speculation costs ~{-gain:.0%} at this load ({why}): turn it off or lower num_speculative_tokens"
        advice += (f" to {best_k} (~{best_gain:+.0%})" if best_k > 0
                   else f" (no num_speculative_tokens from 1 to {k} pays at this batch)")
    elif pays == SpecPays.EVEN:
        advice = f"speculation about breaks even at this load ({gain:+.0%}; {why})"
        if better:
            advice += (f": num_speculative_tokens {best_k} would pay ~{best_gain:+.0%}" if best_k > 0
                       else ": off would do better")
    else:
        advice = f"speculation pays ~{gain:.0%} at this load ({why})"
        if better:
            advice += f"; num_speculative_tokens {best_k} would pay ~{best_gain:+.0%}"
    if pays_under is not None:
        advice += (f", or lower concurrency to {pays_under} running or fewer, where it pays "
                   f"~{spec_gain(k, p, pays_under, knee, cost, share):.0%}")
    return SpecJudgement(pays, regime, k, p, length, batch, gain, best_k, best_gain, pays_under, advice, share)
