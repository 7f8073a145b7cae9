"""An answer's log-probability tables kept as a feature row, or refused (--logprobs runs).

vLLM returns, in `choices[0].logprobs.content`, one entry per generated token: its `token`
(`"token_id:123"` with return_tokens_as_token_ids), its `logprob`, and `top_logprobs` in the same
form: the K + 1 a run asks for (common/logprobs.py), the sampled token first and then the most
likely in rank order. `parse_tables` reads them into a LogprobsTable, each position's list sorted
by log-probability (stable) and cut to its K most likely: the true top K whatever the order; `TableKeeper.keep`
checks it against the answer's completion ids and the run's K and mode
(common/features/logprobs.py: check_table) and stores it as a row of the run's feature shard
(through APPEND: the outbox's FeatureSpool, durable when it returns). Tables that do not fit raise
BadLogprobsError naming the first place they differ: a misaligned row is never stored.

A spool disk that refuses the row is a pause, as it is for hidden states: the answer waits, the
outbox pauses admission (FeatureSpool.disk_error) and the row is stored again after a backoff.
The parsing, checks and fsync run in a thread of their own, so the event loop never waits on them.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import operator
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from genqueue.common import __version__
from genqueue.common.backoff import store_backoff
from genqueue.common.errors import FeatureValueError
from genqueue.common.features import IndexEntry
from genqueue.common.features.tables import LogprobsManifest, LogprobsTable, check_table
from genqueue.common.logprobs import RUN_MODE, asked
from genqueue.common.records import LogprobsRef, TokenIds
from genqueue.common.settings import RunSettings
from genqueue.consumer.answer.faults import BadLogprobsError

#: A table moving more than this between temperatures 1 and 0.25 is processed: raw values move by rounding only.
LOGPROBS_MODE_GAP = 0.25

#: Stores one row: (run, manifest, row id, table) -> its index entry.
AppendTable = Callable[[str, LogprobsManifest, str, LogprobsTable], IndexEntry]
TOKEN_PREFIX = "token_id:"


def manifest_for(settings: RunSettings, model: str) -> LogprobsManifest:
    """The manifest of a run's tables as this consumer answers it (MODEL: the served name)."""
    if settings.logprobs is None:
        raise ValueError("a run without --logprobs has no table manifest")
    return LogprobsManifest(model=model, k=settings.logprobs, mode=RUN_MODE,
                            temperature=settings.sampling.temperature, genqueue_version=__version__)


def _token_id(entry: object, where: str) -> int:
    token = entry.get("token") if isinstance(entry, dict) else None
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX) or not token[len(TOKEN_PREFIX):].isdigit():
        raise BadLogprobsError(f"{where} names its token {token!r}, not {TOKEN_PREFIX}<id> "
                               "(vLLM's return_tokens_as_token_ids)")
    return int(token[len(TOKEN_PREFIX):])


def _logprob(entry: object, where: str) -> float:
    value = entry.get("logprob") if isinstance(entry, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadLogprobsError(f"{where} has no numeric logprob")
    return float(value)


def parse_tables(content: object, k: int) -> LogprobsTable:
    """The top-K tables in vLLM's `choices[0].logprobs.content` (a list, one entry per generated
    token, each with at least asked(K) top_logprobs). Raises BadLogprobsError for anything else,
    naming the first token that is not: too few entries, an id listed twice, the sampled token
    listed with another log-probability than its own.

    An answer as vLLM writes it is read in one pass into arrays and checked and sorted whole
    (`_parse_arrays`); anything that pass cannot vouch for, every refusal included, is read entry
    by entry (`_parse_entries`), which gives the refusal its words. Both give the same table."""
    table = _parse_arrays(content, k)
    return table if table is not None else _parse_entries(content, k)


_ENTRY_KEYS = (operator.itemgetter("token"), operator.itemgetter("logprob"), operator.itemgetter("top_logprobs"))
_PREFIX = TOKEN_PREFIX.encode()
_COMMA, _ZERO, _NINE = ord(","), ord("0"), ord("9")
#: Digits of an id on the fast path: 18 always fit int64 (a longer one goes through the slow parse and its refusal).
_MAX_DIGITS = 18


def _parse_arrays(content: object, k: int) -> LogprobsTable | None:
    """The table of CONTENT when it is an answer as vLLM writes it: every entry a dict, every
    token `token_id:<ASCII digits>`, every logprob a finite float, every top list of one length
    (at least asked(K)) without a repeated id and with the sampled token at its own value; else
    None (then `_parse_entries` reads it). The same arithmetic as `_parse_entries`: float64
    values, math.isclose's test, a stable sort on the negated values."""
    if not isinstance(content, list) or not content or k < 1:
        return None
    get_token, get_logprob, get_top = _ENTRY_KEYS
    try:
        if set(map(type, content)) != {dict}:
            return None
        tops = list(map(get_top, content))
        if set(map(type, tops)) != {list}:
            return None
        widths = set(map(len, tops))
        width = widths.pop()
        if widths or width < asked(k):
            return None
        listed = list(itertools.chain.from_iterable(tops))
        if set(map(type, listed)) != {dict}:
            return None
        values = list(map(get_logprob, content))
        values.extend(map(get_logprob, listed))
        tokens = list(map(get_token, content))
        tokens.extend(map(get_token, listed))
        if set(map(type, values)) != {float}:
            return None
        text = ",".join(tokens).encode("ascii")  # a token other than a str raises TypeError
    except (KeyError, TypeError, UnicodeEncodeError):
        return None
    ids = _token_ids(text, len(tokens))
    lps = np.array(values, dtype=np.float64)
    if ids is None or not np.isfinite(lps).all():
        return None
    rows = len(content)
    ids_top, lps_top = ids[rows:].reshape(rows, width), lps[rows:].reshape(rows, width)
    ids_sampled, lps_sampled = ids[:rows], lps[:rows]
    ordered = np.sort(ids_top, axis=1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        return None
    at = ids_top == ids_sampled[:, None]
    a, b = lps_top[at], lps_sampled[at.any(axis=1)]  # ids are unique a row: one match where any
    gap = np.abs(b - a)
    if not ((a == b) | (gap <= np.abs(1e-6 * b)) | (gap <= np.abs(1e-6 * a)) | (gap <= 1e-6)).all():
        return None
    best = np.argsort(-lps_top, axis=1, kind="stable")[:, :k]
    try:
        return LogprobsTable.of(ids_sampled, lps_sampled, np.take_along_axis(ids_top, best, axis=1),
                                np.take_along_axis(lps_top, best, axis=1))
    except FeatureValueError:
        return None


def _token_ids(text: bytes, n: int) -> npt.NDArray[np.int64] | None:
    """The N ids of TEXT, N tokens `token_id:<ASCII digits>` joined by commas, or None when it is not."""
    raw = np.frombuffer(text, dtype=np.uint8)
    commas = np.flatnonzero(raw == _COMMA)
    # no comma inside a token, each starts with the prefix, and every byte but those is a digit
    if commas.size != n - 1 or not text.startswith(_PREFIX) or text.count(b"," + _PREFIX) != n - 1:
        return None
    ends = np.append(commas, raw.size)
    digits = ends - np.insert(commas + 1, 0, 0) - len(_PREFIX)
    if digits.min() < 1 or digits.max() > _MAX_DIGITS \
            or int(np.count_nonzero((raw >= _ZERO) & (raw <= _NINE))) != int(digits.sum()):
        return None
    first, ids = ends - digits, np.zeros(n, dtype=np.int64)
    width = int(digits.max())
    for j in range(width, 0, -1):  # the figures right-aligned: the j-th from each id's end
        at = ends - j
        np.copyto(ids, ids * 10 + raw[at].astype(np.int64) - _ZERO, where=at >= first)
    return ids


def _parse_entries(content: object, k: int) -> LogprobsTable:
    """parse_tables entry by entry: any content, refusals named by the first entry that is wrong."""
    if not isinstance(content, list) or not content:
        raise BadLogprobsError("the server returned no logprobs.content for the answer's tokens (a run of "
                               "--logprobs asks for logprobs and top_logprobs)")
    ids: list[int] = []
    lps: list[float] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for t, entry in enumerate(content):
        where = f"logprobs.content[{t}]"
        ids.append(_token_id(entry, where))
        lps.append(_logprob(entry, where))
        top = entry.get("top_logprobs") if isinstance(entry, dict) else None
        if not isinstance(top, list) or len(top) < asked(k):
            raise BadLogprobsError(f"{where}.top_logprobs holds {len(top) if isinstance(top, list) else 'no'} "
                                   f"entries, the run asks for {asked(k)}")
        listed = {}
        for j, e in enumerate(top):
            i = _token_id(e, f"{where}.top_logprobs[{j}]")
            if i in listed:
                raise BadLogprobsError(f"{where}.top_logprobs lists token {i} twice")
            listed[i] = _logprob(e, f"{where}.top_logprobs[{j}]")
        # vLLM writes both from one tensor: the same float, give or take JSON's printing
        if ids[-1] in listed and not math.isclose(listed[ids[-1]], lps[-1], rel_tol=1e-6, abs_tol=1e-6):
            raise BadLogprobsError(f"{where}: the sampled token's log-probability {lps[-1]} is listed as "
                                   f"{listed[ids[-1]]}")
        best = sorted(listed.items(), key=lambda kv: -kv[1])[:k]  # stable: ties keep the engine's order
        top_ids.append([i for i, _ in best])
        top_lps.append([v for _, v in best])
    try:
        return LogprobsTable.of(ids, lps, top_ids, top_lps)
    except FeatureValueError as e:
        raise BadLogprobsError(f"the log-probability tables do not fit: {e}") from None


class _SpoolRefused(Exception):
    """The spool's disk refused a row (the OSError is its cause)."""


class TableKeeper:
    """Turns answers' logprobs into feature rows (the generator's TableSink)."""

    def __init__(self, append: AppendTable) -> None:
        self._append = append
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprobs")

    async def keep(self, run: str, settings: RunSettings, model: str, row: str, content: object,
                   expected: list[int]) -> LogprobsRef:
        """Store the tables in CONTENT (vLLM's logprobs.content) as ROW of RUN (of SETTINGS, answered
        by MODEL), once their sampled ids are EXPECTED (the answer's completion ids); their
        reference. Raises BadLogprobsError. While the spool's disk refuses the row, it is stored
        again after a backoff."""
        manifest = manifest_for(settings, model)
        loop = asyncio.get_running_loop()
        refused = 0
        while True:
            try:
                return await loop.run_in_executor(self._pool, self._keep, run, manifest, row, content, expected)
            except _SpoolRefused:
                refused += 1
                await asyncio.sleep(store_backoff(refused))

    def _keep(self, run: str, manifest: LogprobsManifest, row: str, content: object,
              expected: list[int]) -> LogprobsRef:
        table = parse_tables(content, manifest.k)
        try:
            # no ids in a message's first words: the breaker groups failures by what they say, less numbers
            check_table(table, k=manifest.k, mode=manifest.mode, expected_ids=expected)
        except FeatureValueError as e:
            raise BadLogprobsError(f"the log-probability tables are not the answer's: {e}") from None
        try:
            entry = self._append(run, manifest, row, table)
        except FeatureValueError as e:
            raise BadLogprobsError(f"the log-probability tables do not fit the run's: {e}") from None
        except OSError as e:  # the spool's disk (FeatureSpool says so and pauses admission)
            raise _SpoolRefused() from e
        return {"shard": entry.shard, "row": row, "tokens": table.tokens, "k": table.k,
                "dtype": manifest.values.value}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


#: The pre-flight's probe of a --logprobs run: a short answer whose tables are judged.
PROBE_MESSAGES = [{"role": "user", "content": "Count from 1 to 5."}]
#: Tokens the --logprobs pre-flight generates: enough tables to judge ids, order and sums (capped by max_tokens).
PROBE_TOKENS = 16
_BOUND = re.compile(r"logprobs of (\d+)\D+?(\d+)")


def refused(k: int, endpoint: str, error: Exception) -> str:
    """Why a run of --logprobs K is not served when the engine refused the probe with ERROR: one
    line naming the engine's --max-logprobs when vLLM's 400 says K is above it."""
    text = str(error)
    if "logprobs" in text and "max" in text:
        m = _BOUND.search(text)
        bound = f" is {m[2]}" if m else ""
        fits = str(int(m[2]) - 1) if m else "N - 1"
        return (f"--logprobs {k} is more than the engine at {endpoint} returns (its --max-logprobs{bound}; a run "
                f"asks for K + 1, as vLLM lists the sampled token first): start vLLM with --max-logprobs "
                f"{asked(k)} or more, or queue the run with --logprobs {fits} or less")
    return f"the engine refuses a request that asks for log-probabilities: {text}"


def judge(k: int, endpoint: str, content: object, token_ids: TokenIds | None) -> str | None:
    """Why the probe's answer shows the engine cannot give a --logprobs K run its tables (none,
    not named by id, not the answer's tokens, not sorted, not log-probabilities: an engine whose
    --logprobs-mode is not the run's), or None."""
    if token_ids is None:
        return None  # the thinking probe says so in its own line
    try:
        table = parse_tables(content, k)
        check_table(table, k=k, mode=RUN_MODE, expected_ids=token_ids["completion"])
    except (BadLogprobsError, FeatureValueError) as e:
        return (f"the engine at {endpoint} does not return the run's log-probability tables ({e}); vLLM returns "
                f"them with logprobs, top_logprobs and return_tokens_as_token_ids, as {RUN_MODE.value} "
                "(--logprobs-mode)")
    return None


#: The mode probe's two temperatures: raw values do not depend on the temperature, processed ones
#: are the logits over it (a quarter of it moves every value of a table by whole units).
MODE_TEMPERATURES = (1.0, 0.25)


async def probe_mode(chat: Callable[[dict[str, object]], Awaitable[dict[str, object]]], body: dict[str, object],
                     k: int, endpoint: str) -> str | None:
    """Why the engine's values are not RUN_MODE's, or None: BODY (the run's shape on the probe's
    prompt) asked at two temperatures for one token; the first position's table is the same
    prompt's distribution, so raw values come back the same and processed ones do not (the
    engine's --logprobs-mode cannot be read from its API)."""
    tables: list[LogprobsTable] = []
    for t in MODE_TEMPERATURES:
        answer = await chat({**body, "temperature": t, "max_tokens": 1, "seed": 0})
        try:
            choice = answer["choices"][0]  # type: ignore[index]
            content = choice["logprobs"]["content"][:1]
        except (KeyError, IndexError, TypeError):
            content = None
        try:
            tables.append(parse_tables(content, k))
        except BadLogprobsError as e:
            return f"the engine at {endpoint} returns no usable log-probability table to the mode probe: {e}"
    gap = float(abs(tables[0].topk_logprobs[0] - tables[1].topk_logprobs[0]).max())
    if gap > LOGPROBS_MODE_GAP:
        return (f"the engine at {endpoint} returns log-probabilities that change with the temperature (by {gap:.2f} "
                f"between {MODE_TEMPERATURES[0]} and {MODE_TEMPERATURES[1]}): its --logprobs-mode is a processed "
                f"one, the run stores {RUN_MODE.value}; start vLLM with --logprobs-mode {RUN_MODE.value} (its default)")
    return None
