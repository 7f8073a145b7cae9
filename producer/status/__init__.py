"""The status wing: `producer status` reads a run's state from Redis (genqueue's bookkeeping,
rq's registries, what every consumer last reported) and draws it as a screen or as JSON.

- command.py: the click command, its options, and --watch (on a terminal, into a pipe);
- core.py: run_status (the run's state, as a StatusReport) and format_status (its text);
- report.py: the shape of what status reports (its --json), types only;
- figures.py: the figures made to agree with each other (placement, outcomes, ETA), pure;
- cost.py: GPU-hours (and money) spent and projected, pure;
- screen.py: the screen's rows, pure; speculation.py and tables.py: the speculation and
  --logprobs tables sections, pure;
- frame.py: the screen as ranked blocks, and --watch's frame fitted to a terminal's height, pure.

Others import the wing through this module (run_status, format_status, WIDTH), but for
producer/cli.py, which registers command.py's status_command.

May import: genqueue.common, genqueue.producer.rungone
"""

from __future__ import annotations

from genqueue.producer.status.core import format_status, run_status
from genqueue.producer.status.screen import WIDTH

__all__ = ["WIDTH", "format_status", "run_status"]
