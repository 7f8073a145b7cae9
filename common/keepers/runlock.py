"""A run's lock: one producer at a time checks the run's items against its queue.

Re-queueing an item that is in the run but in no job (the reconcile) is safe only while no
other producer can put that item in a job behind the reconcile's back. The lock gives that:

  genqueue:run:<run>:lock   SET NX PX, value "<host>:<pid>:<random>" (the holder's token)

- taken (lazily) by a producer the first time it meets an item that is in the run but not done;
  held until that producer ends, renewed every LOCK_SECONDS / 3 by a thread; a producer killed
  with SIGKILL frees it after LOCK_SECONDS;
- while it is held, the claim script refuses other producers (runs.RunLockedError, before any
  write): they wait for it to be free, then go on;
- every re-queue is fenced by the token: the re-claim script and the transaction that enqueues
  it check that the lock still holds this token, so a producer that lost its lock (stopped for
  longer than LOCK_SECONDS) re-queues nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

import redis

from genqueue.common.errors import GenqueueError
from genqueue.common.keepers.keeper import RUN_KEY, RunKeeper

log = logging.getLogger(__name__)

#: Seconds a run's lock outlives a producer killed with SIGKILL (the holder renews it every third).
LOCK_SECONDS = 30
#: Polling a held lock starts at this many seconds, doubling up to POLL_MAX.
POLL_MIN = 0.05
#: The longest wait between two looks at a held lock: a freed lock is taken within a second.
POLL_MAX = 1.0


class LockLostError(GenqueueError):
    """This producer's lock on the run expired and may be another's: it must stop re-queueing."""


# KEYS: the lock. ARGV: the token, the TTL in ms. Renew only a lock this token holds.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS: the lock. ARGV: the token. Delete only a lock this token holds.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RunLock(RunKeeper):
    """One producer's handle on a run's lock (its key). Not held until acquire()."""

    key_template = RUN_KEY + ":lock"

    def __init__(self, conn: redis.Redis, run: str, *, ttl: float = LOCK_SECONDS) -> None:
        super().__init__(conn, run)
        self.ttl_ms = int(ttl * 1000)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.held = False
        self.lost = False
        self._renew = conn.register_script(_RENEW)
        self._release = conn.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> str | None:
        raw = self.conn.get(self.key(self.run))
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)

    def acquire(self) -> None:
        """Take the lock, waiting while another producer holds it."""
        if self.held:
            return
        delay, said = POLL_MIN, False
        while not self.conn.set(self.key(self.run), self.token, nx=True, px=self.ttl_ms):
            holder = self.holder()
            if holder is not None and not said:
                log.warning("run %s: waiting for the producer that holds its lock (%s) to finish", self.run, holder)
                said = True
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX)
        self.held, self.lost = True, False
        self._stop.clear()
        self._thread = threading.Thread(target=self._keep, name=f"lock-{self.run}", daemon=True)
        self._thread.start()

    def wait_free(self) -> None:
        """Wait until no other producer holds the lock (this one's own lock counts as free)."""
        delay, said = POLL_MIN, False
        while (holder := self.holder()) is not None and holder != self.token:
            if not said:
                log.warning("run %s: waiting for the producer that holds its lock (%s) to finish", self.run, holder)
                said = True
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX)

    def check(self) -> None:
        """Raise LockLostError if the lock was held and is no longer this producer's."""
        if self.held and self.lost:
            raise LockLostError(
                f"this producer lost the lock of run {self.run} (was it stopped for over "
                f"{self.ttl_ms / 1000:.0f} s?); what it did not re-queue, the next `producer enqueue` will"
            )

    def _keep(self) -> None:
        period = self.ttl_ms / 3000
        while not self._stop.wait(period):
            try:
                if not self._renew(keys=[self.key(self.run)], args=[self.token, self.ttl_ms]):
                    self.lost = True
                    log.error("run %s: this producer's lock expired before it was renewed", self.run)
                    return
            except redis.exceptions.RedisError as e:  # a blip: the next period tries again
                log.warning("run %s: could not renew the run's lock (%s)", self.run, type(e).__name__)

    def release(self) -> None:
        """Free the lock if this producer holds it; best effort (it expires by itself)."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.held = False
        try:
            self._release(keys=[self.key(self.run)], args=[self.token])
        except redis.exceptions.RedisError as e:
            log.warning("run %s: could not release the run's lock (%s); it expires in %.0f s", self.run,
                        type(e).__name__, self.ttl_ms / 1000)
