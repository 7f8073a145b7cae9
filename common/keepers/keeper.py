"""The keepers' base: one noun of one run, kept by a class built with the connection and the run.

As rq's registries share BaseRegistry and its `key_template`, a keeper of a run's noun is a
RunKeeper: built with CONN and RUN, it names its key once, in `key_template` (RUN_KEY, then the
noun: `{run}` stands for the run's name), and `key(run)` fills it in, on the class or on an
instance. A noun whose keys are made per call (an export's scratch sets) names none. Every key
of a run begins with `run_key(run)`, so deleting a run finds them all (rundelete.py).
"""

from __future__ import annotations

from typing import ClassVar

import redis

#: Prefix of every Redis key genqueue owns (rq's own keys keep rq's prefix).
KEY_PREFIX = "genqueue"
#: The start of every key of a run, `{run}` for its name: a keeper's key_template adds its noun.
RUN_KEY = f"{KEY_PREFIX}:run:{{run}}"


def run_key(run: str, suffix: str = "") -> str:
    """RUN's key named SUFFIX (the run's own hash without one)."""
    return f"{KEY_PREFIX}:run:{run}" + (f":{suffix}" if suffix else "")


class RunKeeper:
    """One noun of RUN on CONN: its key (key_template) and, in a subclass, its operations."""

    key_template: ClassVar[str]

    def __init__(self, conn: redis.Redis, run: str) -> None:
        self.conn = conn
        self.run = run

    @classmethod
    def key(cls, run: str) -> str:
        """The noun's key for RUN."""
        return cls.key_template.format(run=run)
