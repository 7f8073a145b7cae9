"""What a run costs: GPU-hours (and money) spent and projected (pure arithmetic, no I/O).

GPU-hours spent are each consumer's GPUs times its wall time while it held the run's work (jobs,
items waiting or in flight, records written), split between the runs it held work of by the
completion tokens each generated meanwhile: each consumer adds its part at every report to the
run's spent hash (common/keepers/snapshots.py), so what was spent stays spent when consumers
drain, crash or give their jobs back. Without that hash, consumer_hours works it out from the
live snapshots (each consumer's time from the later of its start and the run's first job to its
last report). A consumer's GPUs are its snapshot's `gpus` (`consumer run --engine-gpus N`, which
`consumer launch` sets to --gpus-per-engine x --data-parallel); a snapshot that does not say
counts one.
Projected: spent, plus the live consumers' GPUs for as long as the remaining tokens take at the
fleet's completion-token rate of the last minute. The input's estimate of the run's output
tokens is the enqueue's (common/estimate.py).
"""

from __future__ import annotations

from typing import TypedDict

from genqueue.common.estimate import CHARS_PER_TOKEN
from genqueue.common.keepers.snapshots import ConsumerReport


class CostBasis(TypedDict):
    gpu_hours_spent: str
    gpu_hours_projected: str
    price: str
    estimated_output_tokens: str


class CostView(TypedDict):
    """GPU-hours (and money) spent and projected, and how each was found: `producer status`'s cost."""

    gpu_hours_spent: float
    gpu_hours_projected: float | None
    live_gpus: int
    price: float | None
    spent_money: float | None
    projected_money: float | None
    estimated_output_tokens: int | None
    basis: CostBasis


def gpus_of(c: ConsumerReport) -> int:
    """GPUs consumer C fronts: its snapshot's `gpus` when it says, else 1."""
    n = c.get("gpus")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def consumer_hours(c: ConsumerReport, run: str, run_started_at: float | None, *, complete: bool = False) -> float:
    """GPU-hours consumer C spent on RUN (module docstring). COMPLETE: RUN is over, so C's time
    on it ends at its last upload of RUN's results, not at its last report (a consumer left
    idle after a run does not go on spending the run's money)."""
    start = max(float(c.get("started_at") or 0.0), run_started_at or 0.0)
    if not start:
        return 0.0
    runs = c.get("runs") or {}
    end = float(c.get("last_seen") or 0.0)
    ship = (runs.get(run) or {}).get("shipping")
    last_upload = ship.get("last_upload_at") if isinstance(ship, dict) else None
    if complete and isinstance(last_upload, int | float) and not isinstance(last_upload, bool):
        end = min(end, float(last_upload))
    wall = max(end - start, 0.0)
    tokens = {k: float(v.get("completion_tokens", 0) or 0) for k, v in runs.items() if isinstance(v, dict)}
    total = sum(tokens.values())
    share = tokens.get(run, 0.0) / total if total else 1.0 / max(len(runs), 1)
    return gpus_of(c) * wall * share / 3600.0


def remaining_tokens(items: int, done: int, failed: int, generated: int,
                     estimate: int | None, *, answered: int | None = None) -> tuple[float | None, str]:
    """(output tokens still to generate, how it was found): the tokens per item measured on what
    was answered (GENERATED tokens over ANSWERED items; default: DONE) once something has been,
    else the input's estimate per item."""
    left = max(items - done - failed, 0)
    if not left:
        return 0.0, "nothing left"
    per = done if answered is None else answered
    if per and generated:
        return generated / per * left, f"{generated / per:,.0f} tok per item done so far x {left:,} items left"
    if estimate is not None and items:
        return estimate / items * left, f"the input's estimate ({estimate / items:,.0f} tok per item) x {left:,} left"
    return None, "no estimate and nothing shipped yet"


def run_cost(consumers: list[ConsumerReport], run: str, *, run_started_at: float | None, remaining: float | None,
             rate: float | None, price: float | None, estimate: int | None, remaining_basis: str,
             complete: bool = False, spent_hours: float | None = None) -> CostView:
    """The `cost` figures of `producer status` for RUN. CONSUMERS: the snapshots of those that
    served it (`live` set); REMAINING: its output tokens still to generate; RATE: the fleet's
    completion tokens a second for it now; PRICE: money a GPU-hour (None: not given); COMPLETE:
    RUN is over (consumer_hours); SPENT_HOURS: the GPU-hours the consumers added up as they
    went (the run's spent hash, common/keepers/snapshots.py), which never go down; None: worked out
    from the snapshots of CONSUMERS (consumer_hours)."""
    durable = spent_hours is not None
    spent = spent_hours if spent_hours is not None else \
        sum(consumer_hours(c, run, run_started_at, complete=complete) for c in consumers)
    live_gpus = sum(gpus_of(c) for c in consumers if c.get("live"))
    assumed = any(gpus_of(c) == 1 and "gpus" not in c for c in consumers)
    projected: float | None
    if remaining == 0:
        projected, how = spent, "the run needs nothing more"
    elif remaining is None or not rate or not live_gpus:
        projected, how = None, "no completion rate yet" if remaining is not None else remaining_basis
    else:
        projected = spent + remaining / rate * live_gpus / 3600.0
        how = (f"spent + {remaining:,.0f} tok left ({remaining_basis}) / {rate:,.0f} tok/s x {live_gpus} live GPU(s)")
    return {
        "gpu_hours_spent": spent,
        "gpu_hours_projected": projected,
        "live_gpus": live_gpus,
        "price": price,
        "spent_money": None if price is None else spent * price,
        "projected_money": None if price is None or projected is None else projected * price,
        "estimated_output_tokens": estimate,
        "basis": {
            "gpu_hours_spent": (("GPUs x wall time of each consumer while it held the run's work, added up at "
                                 "each of its reports, split between its runs by completion tokens") if durable else
                                ("GPUs x wall time of each consumer since the run's first job (or its start) "
                                 + ("to its last upload of the run" if complete else "to its last report")
                                 + ", split between its runs by completion tokens"
                                 + ("; 1 GPU per consumer assumed (its report does not say)" if assumed else ""))),
            "gpu_hours_projected": how,
            "price": "--gpu-hour-price / GENQUEUE_GPU_HOUR_PRICE" if price is not None else "not given",
            "estimated_output_tokens": (f"the original answers' characters / {CHARS_PER_TOKEN:g}, recorded by "
                                        "`producer enqueue`" if estimate is not None else
                                        "none: the input has no original answers (or was enqueued before estimates)"),
        },
    }
