"""One error tree for genqueue.

`GenqueueError` is the root. Below it, `UserError` covers everything a user can fix
(bad options, unreadable files, a conflicting run): the CLIs print its message on one line
and exit non-zero, never a traceback. Trouble with the generation endpoint (`EndpointError`:
retried or recorded) is the consumer's answering wing's, beside the faults it maps to
(consumer/answer/faults.py).
"""

from __future__ import annotations


def as_clause(err: object) -> str:
    """ERR's text without its closing full stop, to be joined into a longer line
    ("...: Connection refused; waited 3s", not "Connection refused.; waited 3s")."""
    return str(err).rstrip().rstrip(".").rstrip()


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


class CorruptStateError(GenqueueError):
    """A key genqueue keeps in Redis holds what genqueue never writes (garbage, another tool's
    data, a hand edit): named with the key and the way out; exit status 1."""


class WriteFailedError(GenqueueError):
    """A file the producer writes failed part way (disk full, quota spent, I/O error, read-only):
    one line naming the file, what was written and the option that moves it; exit status 1.
    A place refused before anything is done is a UserError (exit 2) instead."""


class PackError(GenqueueError):
    """A pack of prompts (common/packs.py) cannot be read: the job naming it fails with this
    class, never skipping its items in silence. `where` names the pack (a path, an s3:// URL, or
    what the caller called it). A subclass says why; a fetched pack that fails may be fetched
    again (a cache or a transfer can garble it), a stored one that fails the same way is lost."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"pack {where}: {reason}")
        self.where = where
        self.reason = reason


class PackTruncatedError(PackError):
    """The pack ends before what its header, footer or index say it holds."""


class PackCorruptError(PackError):
    """The pack's bytes are not what was written: a checksum does not match, or a block does
    not decode to the items the index promises."""


class PackVersionError(PackError):
    """Not a pack, or a pack of a format version this genqueue does not read."""


class PackRangeError(PackError):
    """A range of items the pack does not hold (a job naming items past its end)."""


class FeatureError(GenqueueError):
    """Captured features (common/features/: the target's hidden states of a row) cannot be
    encoded, stored or read as asked. A subclass says why."""


class FeatureValueError(FeatureError):
    """Hidden states that cannot be encoded: not [tokens, layers, hidden], no tokens, a value
    that is not finite (a broken engine's output, refused rather than stored)."""


class FeatureCorruptError(FeatureError):
    """A stored row's bytes are not what was written (checksum, framing, or a row that names
    another row id, shape or dtype than its index entry): names the row, the shard and the
    offset, so the bad block can be found and re-captured."""

    def __init__(self, row: str, shard: str, offset: int, reason: str) -> None:
        super().__init__(f"features of row {row!r} in shard {shard} at offset {offset}: {reason}")
        self.row = row
        self.shard = shard
        self.offset = offset
        self.reason = reason


class FeatureManifestConflictError(FeatureError, UserError):
    """The output already holds a capture manifest with other settings (model, layers, dtype...):
    features of two recipes would be mixed under one run."""


class JobItemsUnreadableError(GenqueueError):
    """The items of a job by reference cannot be read now (its pack is gone or garbled, or the
    store does not answer), for a reader that can go on without them: export notes the job among
    the entries it could not read (their items stay missing, never silently counted), where the
    reconcile, which would queue them twice, stops instead (a UserError)."""


class ModelNotServedError(UserError):
    """The run names a model that the consumer's endpoint does not serve."""
