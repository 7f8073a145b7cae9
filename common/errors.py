"""One error tree for genqueue.

`GenqueueError` is the root. Below it, `UserError` covers everything a user can fix
(bad options, unreadable files, a conflicting run): the CLIs print its message on one line
and exit non-zero, never a traceback. `TransientError` and `PermanentError` classify
trouble with the generation endpoint: the first is retried with backoff, the second becomes
an error record and is not retried.
"""

from __future__ import annotations


class GenqueueError(Exception):
    """Root of every error genqueue raises on purpose."""


class UserError(GenqueueError):
    """A mistake the user can fix; shown as one line, exit status 2."""

    exit_code = 2


class InputError(UserError):
    """An input file cannot be opened or is not in any format genqueue reads."""


class RunConflictError(UserError):
    """A run of this name exists with other settings; re-using the name would mix recipes."""


class RunNotFoundError(UserError):
    """The named run does not exist in Redis."""


class RedisUnavailableError(UserError):
    """Redis cannot be reached at the configured URL."""


class EndpointError(GenqueueError):
    """Trouble talking to the generation endpoint."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TransientError(EndpointError):
    """Connection refused or reset, timeout, 408/429/5xx: retried with jittered backoff."""


class PermanentError(EndpointError):
    """400/404/413/422 and the like: the request itself is wrong; recorded, never retried."""


class ModelNotServedError(UserError):
    """The run names a model that the consumer's endpoint does not serve."""
