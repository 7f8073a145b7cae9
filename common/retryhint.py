"""What a run whose items ended as errors, or that is paused, needs once its cause is fixed:
the commands, in one wording for every screen that shows such a run (`producer runs`,
`producer status`, a --burst consumer's end). Pure: the caller reads the run's figures.

- a pause (the breaker, or an operator): `producer resume --run NAME` (its jobs are taken
  again; the items the storm cut are redone);
- items whose only record is an error (failed for good): `producer enqueue INPUT --run NAME
  --retry-failed` queues them again (INPUT: the run's own input file, as enqueued);
- items a producer claimed and stopped before queueing (its claim older than CLAIM_GRACE):
  `producer enqueue INPUT --run NAME` takes the claim over and queues them.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping


def retry_failed_command(run: str, sources: Iterable[str], output: str | None = None) -> str:
    """The enqueue that queues RUN's failed items again: its input as enqueued (INPUT when the
    run was fed from several, or none is recorded). No other option: on an existing run an
    option left out keeps the run's stored setting, its output included (OUTPUT is taken for
    the callers' sake and not repeated)."""
    return f"{enqueue_again_command(run, sources)} --retry-failed"


def failed_summary(failed: int, by_class: Mapping[str, int]) -> str:
    """"240 items ended as errors (transient_exhausted 240)"."""
    by = ", ".join(f"{k} {v:,}" for k, v in sorted(by_class.items(), key=lambda kv: -kv[1]) if v)
    return f"{failed:,} item{'s' if failed != 1 else ''} ended as errors" + (f" ({by})" if by else "")


def enqueue_again_command(run: str, sources: Iterable[str]) -> str:
    """The enqueue that reconciles RUN with its input: it queues what is in no job (claims a
    stopped producer left, CLAIM_GRACE on)."""
    names = sorted(set(sources))
    source = shlex.quote(names[0]) if len(names) == 1 else "INPUT"
    return f"producer enqueue {source} --run {run}"


def next_steps(run: str, *, paused: bool, failed: int, sources: Iterable[str], output: str | None = None,
               claimed: bool = False) -> str:
    """What to run once the cause is fixed ("" when the run needs nothing). CLAIMED: items a
    stopped producer claimed and never queued (the retry of failed items queues them too)."""
    steps = []
    if paused:
        steps.append(f"`producer resume --run {run}`")
    if failed:
        steps.append(f"`{retry_failed_command(run, sources, output)}`")
    elif claimed:
        steps.append(f"`{enqueue_again_command(run, sources)}`")
    if not steps:
        return ""
    return "once the cause is fixed: " + " and ".join(steps)
