"""Pure arithmetic for progress: rates over a window, and durations in words (the run's ETA is
producer/status/figures.py eta_view's, alone)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    completions: int
    prompt_tokens: int
    completion_tokens: int


class RateWindow:
    """Cumulative counters sampled over time; rates over the last `window` seconds."""

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self.samples: deque[Sample] = deque()

    def add(self, s: Sample) -> None:
        self.samples.append(s)
        # keep one sample older than the window, so the rate always spans a full window
        while len(self.samples) > 2 and self.samples[1].t <= s.t - self.window:
            self.samples.popleft()

    def rates(self) -> dict[str, float]:
        """Per-second rates of each counter between the oldest kept sample and the newest."""
        if len(self.samples) < 2:
            return {"completions_per_s": 0.0, "prompt_tokens_per_s": 0.0, "completion_tokens_per_s": 0.0}
        a, b = self.samples[0], self.samples[-1]
        dt = b.t - a.t
        if dt <= 0:
            return {"completions_per_s": 0.0, "prompt_tokens_per_s": 0.0, "completion_tokens_per_s": 0.0}
        return {
            "completions_per_s": (b.completions - a.completions) / dt,
            "prompt_tokens_per_s": (b.prompt_tokens - a.prompt_tokens) / dt,
            "completion_tokens_per_s": (b.completion_tokens - a.completion_tokens) / dt,
        }


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    s = round(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m"
    return f"{m}m {s:02d}s"
