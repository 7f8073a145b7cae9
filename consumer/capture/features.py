"""An answer's captured hidden states kept as a feature row, or refused (--capture runs).

For each answer of a capture run the engine writes a file (captured.py reads it); `keep` reads
it, checks that its token ids are the answer's prompt ids and completion ids but the last (what
vLLM's connector saves with `include_output_tokens`) and that it holds the capture's layer
count, stores it as a row of the run's feature shard (through APPEND: the outbox's FeatureSpool,
durable when it returns), and removes the file. A capture that does not fit raises
BadCaptureError naming the first place it differs: a misaligned row is never stored. A spool
disk that refuses the row is a pause, as for results: the answer waits with its capture file and
its lease while admission pauses (FeatureSpool's disk_error), and the row is stored again later.
The work (a file read, the encoding, an fsync) runs in one thread of its own: rows are appended
one at a time and the event loop never waits on a disk.

A --capture-budget run (common/keepers/captured.py): `admits` says whether an answer may still
ask (the run's bytes captured below its budget); `keep` checks again in the capture thread right
before the row is stored (else CaptureBudgetSpent) and adds the row's bytes once it is durable,
so the budget is overshot by at most one row per consumer. A Redis that does not answer a check
is a no; a count that fails is logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import redis

from genqueue.common import __version__
from genqueue.common.backoff import store_backoff
from genqueue.common.capture import CaptureBudgetSpent, CaptureDtype, CaptureSettings
from genqueue.common.errors import FeatureManifestConflictError, FeatureValueError
from genqueue.common.features import FeatureDtype, FeatureManifest, IndexEntry
from genqueue.common.features.manifest import check_manifest
from genqueue.common.features.store import feature_store_for
from genqueue.common.keepers.captured import CaptureBudget
from genqueue.common.records import FeatureRef
from genqueue.consumer.answer.faults import BadCaptureError, PermanentError
from genqueue.consumer.capture.captured import read_capture, remove_capture
from genqueue.consumer.capture.facts import EngineFacts

log = logging.getLogger(__name__)

#: How a run's --capture-dtype is stored (common/features/codec.py).
DTYPES: dict[CaptureDtype, FeatureDtype] = {CaptureDtype.FP8: FeatureDtype.FP8_E4M3, CaptureDtype.BF16: FeatureDtype.BF16}

#: Stores one row: (run, manifest, row id, token ids, hidden states) -> its index entry.
Append = Callable[[str, FeatureManifest, str, npt.NDArray[np.int64], npt.NDArray[np.float32]], IndexEntry]


def manifest_for(capture: CaptureSettings, model: str, hidden_size: int,
                 facts: EngineFacts = EngineFacts()) -> FeatureManifest:  # noqa: B008 - frozen
    """The manifest of a run's capture as this consumer answers it (MODEL: the served name;
    FACTS: its engine's, facts.py)."""
    return FeatureManifest(model=model, revision=facts.revision, layer_ids=capture.layers,
                           dtype=DTYPES[capture.dtype], hidden_size=hidden_size,
                           chat_template_hash=facts.chat_template_hash, vllm_version=facts.vllm_version,
                           genqueue_version=__version__)


def other_capture(output: str, run: str, capture: CaptureSettings, model: str, facts: EngineFacts) -> str | None:
    """Why RUN's features from this consumer (serving MODEL, its engine's FACTS) cannot join
    those at OUTPUT, in one line: the manifest there is another capture's (another engine
    version, revision or template); None when there is none yet, or it is this one."""
    stored = feature_store_for(output).get_manifest(run)
    if stored is None:
        return None
    try:
        check_manifest(f"run {run}'s output", stored.to_json(), manifest_for(capture, model, stored.hidden_size, facts))
    except FeatureManifestConflictError as e:
        return str(e)
    return None


def first_difference(found: list[int], expected: list[int]) -> str:
    """Where FOUND first differs from EXPECTED, in words."""
    n = min(len(found), len(expected))
    at = next((i for i in range(n) if found[i] != expected[i]), n)
    if at < n:
        return f"token {at} is id {found[at]}, the answer's is {expected[at]}"
    return f"{len(found)} token ids, the answer has {len(expected)} (prompt and completion but the last)"


class _SpoolRefused(Exception):
    """The spool's disk refused a row (the OSError is its cause): the capture file is kept."""


class CaptureKeeper:
    """Turns the engine's capture files into feature rows (the generator's FeatureSink)."""

    def __init__(self, append: Append, facts: Callable[[str], EngineFacts] | None = None, *,
                 budget: CaptureBudget | None = None) -> None:
        self._append = append
        self._facts = facts  # a model's engine facts for the manifest (facts.EngineFactsReader.of)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture")
        self._budget = budget
        self._spent: set[str] = set()  # runs whose budget this consumer saw spent: it asks no more

    async def admits(self, run: str, capture: CaptureSettings) -> bool:
        """Whether an answer of RUN may ask for capture now: always without --capture-budget;
        with one, while the run's bytes captured are below it (and Redis answers)."""
        if capture.budget is None or self._budget is None:
            return True
        return await asyncio.to_thread(self._within, run, capture.budget)

    def _within(self, run: str, budget: int) -> bool:
        """RUN's bytes captured are below BUDGET (False once seen otherwise: they only grow)."""
        if run in self._spent:
            return False
        if self._budget is None:
            return True
        try:
            allowed = self._budget.allows(run, budget)
        except redis.exceptions.RedisError as e:
            log.warning("run %s: the capture budget was not read (%s): this answer gets no features", run, e)
            return False
        if not allowed and run not in self._spent:
            log.info("run %s: its capture budget (%d bytes) is spent: answers from now on are generated without "
                     "features", run, budget)
            self._spent.add(run)
        return allowed

    async def keep(self, run: str, capture: CaptureSettings, model: str, row: str, path: str,
                   expected: list[int]) -> FeatureRef:
        """Store the capture at PATH as ROW of RUN, once its token ids are EXPECTED; its reference.
        Raises BadCaptureError (the file is removed), CaptureBudgetSpent when the run's budget was
        reached (the file is removed). While the spool's disk refuses the row, the file is kept and
        the row stored again after a backoff (the caller waits)."""
        loop = asyncio.get_running_loop()
        refused = 0
        while True:
            try:
                return await loop.run_in_executor(self._pool, self._keep, run, capture, model, row, path, expected)
            except _SpoolRefused:
                refused += 1
                await asyncio.sleep(store_backoff(refused))

    def _keep(self, run: str, capture: CaptureSettings, model: str, row: str, path: str,
              expected: list[int]) -> FeatureRef:
        refused = False
        try:
            if capture.budget is not None and not self._within(run, capture.budget):
                raise CaptureBudgetSpent(f"run {run}: its capture budget of {capture.budget} bytes is spent")
            try:
                cap = read_capture(path)
            except PermanentError as e:
                raise BadCaptureError(str(e)) from None
            found = cap.token_ids.tolist()
            if found != expected:
                # no path in the message: the breaker groups failures by what they say, less numbers
                raise BadCaptureError(f"the captured hidden states are not the answer's: "
                                      f"{first_difference(found, expected)}")
            tokens, layers, hidden = cap.hidden_states.shape
            if layers != len(capture.layers):
                raise BadCaptureError(f"the captured hidden states hold {layers} layers; the run captures "
                                      f"{len(capture.layers)} ({','.join(map(str, capture.layers))})")
            try:
                facts = self._facts(model) if self._facts is not None else EngineFacts()
                entry = self._append(run, manifest_for(capture, model, hidden, facts), row, cap.token_ids,
                                     cap.hidden_states)
            except FeatureValueError as e:
                raise BadCaptureError(f"the captured hidden states do not fit the capture: {e}") from None
            except OSError as e:  # the spool's disk (FeatureSpool says so and pauses admission)
                refused = True  # the capture stays for the next try
                raise _SpoolRefused() from e
            if capture.budget is not None and self._budget is not None:
                try:
                    self._budget.add(run, entry.length, entry.shard)
                except redis.exceptions.RedisError as e:
                    log.warning("run %s: row %s's %d bytes not counted against its capture budget: %s", run, row,
                                entry.length, e)
        finally:
            if not refused:
                remove_capture(path)
        return {"shard": entry.shard, "row": row, "tokens": tokens, "layers": list(capture.layers),
                "dtype": capture.dtype.value}

    def discard(self, path: str) -> None:
        """Remove the capture of an answer that is not kept (a retried or dropped one)."""
        try:
            remove_capture(path)
        except OSError as e:
            log.warning("could not remove the capture %s of an answer not kept: %s", path, e)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
