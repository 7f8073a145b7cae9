"""A run's state, one for every screen: `producer runs` and `producer status` read it through
`read_pulse` (what decides it, in one transaction: its items' marks and counters, rq's counts of
its jobs, its pause) and name it through `run_state`, one function over that read.

  done        every item has a result, none only an error;
  failed      every item has a record, some only an error (`--retry-failed` queues them again);
  paused      items are left and the run is paused (its breaker tripped, or an operator);
  running     items are left and a consumer holds some of its jobs;
  queued      items are left and jobs wait, none held;
  incomplete  items are left and no job waits or is held (`settle` says where they are).

A run whose every item has its record is done (or failed) whatever rq still holds: a job left
queued or held then has nothing to do (the consumer that takes it skips its done items and acks
it). `producer runs` once said `queued` there while status said "run complete".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

import redis

from genqueue.common.keepers.claims import stalled_line
from genqueue.common.keepers.marks import Marks, Progress
from genqueue.common.keepers.pause import Pause, PauseInfo
from genqueue.common.keepers.redismem import pipeline_read
from genqueue.common.keepers.rqaccess import JobCounts, job_counts_of, stage_job_counts


class RunState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    FAILED = "failed"  # every item has a record, some only an error
    INCOMPLETE = "incomplete"  # items left, in no job that waits or is held (`settle` says why)
    DONE = "done"
    UNREADABLE = "unreadable"  # its record in Redis is not genqueue's (CorruptStateError): delete it


@dataclass(frozen=True, slots=True)
class RunPulse:
    """What decides a run's state, read at one moment."""

    progress: Progress
    jobs: JobCounts
    pause: PauseInfo | None


def read_pulse(conn: redis.Redis, run: str) -> RunPulse:
    """RUN's marks and counters, job counts and pause, in one transaction (one round trip)."""
    marks, pause = Marks(conn, run), Pause(conn, run)

    def build(p: object) -> None:
        marks.stage_progress(p)
        stage_job_counts(p, run)  # type: ignore[arg-type]  # a pipeline, typed loosely by pipeline_read
        pause.stage_get(p)

    table, stats, *counts, paused = pipeline_read(conn, build, raise_on_error=False)
    return RunPulse(Marks.progress_of(table, stats), job_counts_of(counts), Pause.of(paused))


def run_state(pulse: RunPulse) -> RunState:
    """The state of the run PULSE was read of (module docstring): INCOMPLETE for items left with
    no job waiting or held, which `settle` tells from jobs rq keeps elsewhere."""
    p = pulse.progress
    if p.items and p.done + p.failed_only >= p.items:
        return RunState.FAILED if p.failed_only else RunState.DONE
    if pulse.pause is not None:
        return RunState.PAUSED
    if pulse.jobs["started"] or pulse.jobs["dequeuing"]:
        return RunState.RUNNING
    if pulse.jobs["queued"]:
        return RunState.QUEUED
    return RunState.INCOMPLETE


def settle(conn: redis.Redis, run: str, pulse: RunPulse, sources: Iterable[str]) -> tuple[RunState, str]:
    """run_state, and for INCOMPLETE where its items are and what queues them (claims.stalled_line):
    a run whose jobs wait in rq's scheduled, deferred or ready registry is QUEUED."""
    state = run_state(pulse)
    if state is not RunState.INCOMPLETE:
        return state, ""
    p = pulse.progress
    stalled = stalled_line(conn, run, max(p.items - p.done - p.failed_only, 0), sources)
    return (RunState.QUEUED, "") if stalled is None else (RunState.INCOMPLETE, stalled)
