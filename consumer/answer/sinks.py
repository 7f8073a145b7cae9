"""Where an answer's extras go once it is kept: a --capture run's hidden states (FeatureSink,
consumer/capture/features.py) and a --logprobs run's tables (TableSink, consumer/capture/tables.py).
The generator and a capture pass's prefill (prefill.py) both hand them over through these.
"""

from __future__ import annotations

from typing import Protocol

from genqueue.common.capture import CaptureSettings
from genqueue.common.records import FeatureRef, LogprobsRef
from genqueue.common.settings import RunSettings


class FeatureSink(Protocol):
    """Where a --capture run's answers' hidden states go (consumer/capture/features.py)."""

    async def keep(self, run: str, capture: CaptureSettings, model: str, row: str, path: str,
                   expected: list[int]) -> FeatureRef:
        """Store the capture at PATH as ROW once its token ids are EXPECTED; raises BadCaptureError."""
        ...

    def discard(self, path: str) -> None:
        """Remove the capture of an answer that is not kept."""
        ...

    async def admits(self, run: str, capture: CaptureSettings) -> bool:
        """Whether an answer of RUN may ask for capture now (--capture-budget not spent)."""
        ...


class TableSink(Protocol):
    """Where a --logprobs run's answers' tables go (consumer/capture/tables.py)."""

    async def keep(self, run: str, settings: RunSettings, model: str, row: str, content: object,
                   expected: list[int]) -> LogprobsRef:
        """Store CONTENT's tables as ROW once their sampled ids are EXPECTED; raises BadLogprobsError."""
        ...
