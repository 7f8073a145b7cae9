"""The function every genqueue job names.

genqueue jobs are executed by `consumer run`, which reads their items and never calls this.
It exists so that a plain `rq worker` pointed at a genqueue queue fails the job with a clear
message instead of an import error.
"""

from __future__ import annotations

from typing import Any, NoReturn


def generate(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise RuntimeError("genqueue jobs are run by `consumer run`, not by a plain `rq worker`")
