"""Runs in Redis: a run's record (settings, recipes, placement, priority), sources and counters.

Keys (all under genqueue:, rq's own keys keep rq's prefix):
  genqueue:runs                 zset  run -> creation time
  genqueue:run:<run>            hash  settings (JSON), fingerprint, created_at, version,
                                      started_at; fingerprints: every recipe the run has had
                                      (JSON list of settings.FingerprintEntry, oldest first);
                                      output_host and shared_fs: where a local output lives
                                      (common/placement.py); priority: the run's share of the
                                      fleet (an integer, higher first, absent = 0; not part of
                                      the recipe, so not in the fingerprint)
  genqueue:run:<run>:sources    hash  source id -> JSON summary of its last enqueue
  genqueue:run:<run>:stats      hash  counters the consumers increment (items done, errors...)
  genqueue:run:<run>:warnings   hash  worker -> what that consumer warned of the run

Consumers watch `fingerprint`: when it changes they re-read `settings` for the jobs they take
from then on, and read `priority` every few seconds. A run's other keys are its keepers' (the
item table, its claim sets, its lock...: this package's docstring names them).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import orjson
import redis
from redis.commands.core import Script

from genqueue.common import __version__
from genqueue.common.errors import CorruptStateError, GenqueueError, RunConflictError, RunNotFoundError
from genqueue.common.keepers.checkpoints import CheckpointStore
from genqueue.common.keepers.items import IN_RUN, ItemTable
from genqueue.common.keepers.keeper import KEY_PREFIX, run_key
from genqueue.common.keepers.redisconn import redis_location
from genqueue.common.placement import Placement
from genqueue.common.redact import redact
from genqueue.common.settings import (
    FIXED_SETTINGS,
    FingerprintEntry,
    RunSettings,
    check_update,
    fingerprint_entry,
)

RUNS = f"{KEY_PREFIX}:runs"

#: The run's counters (in its stats) of the feature rows shipped to its output (--capture), and
#: their bytes: a redone item's second row is counted too.
FEATURE_ROWS = "features_rows"
FEATURE_BYTES = "features_bytes"
#: ... and the tokens their rows hold (--logprobs: the generated tokens with tables).
FEATURE_TOKENS = "features_tokens"

#: Consumers' last snapshots: a sorted set of worker names by last-seen time, and one key each.
CONSUMERS = f"{KEY_PREFIX}:consumers"


def consumer_key(worker: str) -> str:
    return f"{KEY_PREFIX}:consumer:{worker}"


class RunLockedError(GenqueueError):
    """Another producer holds the run's lock: new claims wait until it is released."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"held by {holder}")
        self.holder = holder


def key_digest(item_key: str) -> bytes:
    """The 16 raw bytes of a 32-hex item key, as stored in Redis (half the memory of hex)."""
    return bytes.fromhex(item_key)


@dataclass(frozen=True, slots=True)
class RunInfo:
    name: str
    settings: RunSettings
    created_at: float
    version: str
    fingerprints: list[FingerprintEntry] = field(default_factory=list)
    placement: Placement = field(default_factory=Placement)

    @property
    def fingerprint(self) -> str:
        return self.settings.fingerprint


class RunStore:
    """Thin adapter over Redis for everything genqueue keeps about runs."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    @cached_property
    def _set_priority(self) -> Script:
        # registered on first use (registering sends nothing to Redis): a store made per call,
        # as the consumer's ack makes one, costs no script hash
        return self.conn.register_script(_SET_PRIORITY)

    def get(self, run: str) -> RunInfo | None:
        """RUN's record, None when Redis has none; CorruptStateError when it cannot be read."""
        data = self.conn.hgetall(run_key(run))
        if not data or b"settings" not in data:
            return None
        try:
            settings = RunSettings.from_json(data[b"settings"])
            problem = settings.stored_shape_problem()
            if problem is not None:
                raise TypeError(problem)
            created_at = float(data.get(b"created_at", b"0"))
            history: list[FingerprintEntry] = orjson.loads(data[b"fingerprints"]) if b"fingerprints" in data else []
            if not isinstance(history, list) or not all(
                    isinstance(e, dict) and isinstance(e.get("fingerprint"), str)
                    and isinstance(e.get("since"), int | float) for e in history):
                raise TypeError("fingerprints is not a list of {fingerprint, since}")
        except Exception as e:  # noqa: BLE001 - whatever is there, the run cannot be used as it is
            raise CorruptStateError(
                f"run {run}'s record in Redis ({run_key(run)}) is unreadable ({type(e).__name__}: {str(e)[:120]}): "
                f"delete it (`producer delete --run {run} --yes`) and enqueue again; its shipped results and "
                f"run.json stay in the output") from None
        return RunInfo(
            name=run,
            settings=settings,
            created_at=created_at,
            version=_text(data.get(b"version", b"?")),
            # runs made before the history was kept have had one recipe
            fingerprints=history or [fingerprint_entry(settings, created_at)],
            placement=Placement.from_fields(data),
        )

    def require(self, run: str) -> RunInfo:
        info = self.get(run)
        if info is None:
            raise self.not_found(run)
        return info

    def not_found(self, run: str) -> RunNotFoundError:
        """The error for RUN, which this Redis does not hold: naming the Redis asked (another
        REDIS_URL, or none set, is the usual reason)."""
        return RunNotFoundError(not_found_line(self.conn, run))

    def check(self, run: str, settings: RunSettings) -> bool:
        """Whether RUN exists; RunConflictError when it has other settings. Writes nothing: the
        producer asks before it reads a byte of the input."""
        existing = self.get(run)
        if existing is not None and existing.settings != settings:
            raise conflict(run, existing.settings, settings)
        return existing is not None

    def create_or_check(self, run: str, settings: RunSettings, placement: Placement | None = None) -> bool:
        """Create RUN with SETTINGS, or check that it already has exactly them. PLACEMENT: where
        its local output lives (default: on this host, for a local output).

        Returns True when the run was created. Raises RunConflictError when the name is taken
        by other settings: re-using it would mix two recipes in one dataset.
        """
        now = time.time()
        if placement is None:
            placement = Placement.new(settings.output, shared_fs=False)
        return self._create(run, settings, now, __version__, [fingerprint_entry(settings, now)], placement)

    def recreate(self, run: str, settings: RunSettings, created_at: float, version: str,
                 fingerprints: list[FingerprintEntry], placement: Placement) -> bool:
        """Put RUN back in Redis as its output's run.json describes it (Redis lost it): the same
        settings, creation time, version and fingerprint history. True when this call made it."""
        return self._create(run, settings, created_at, version, fingerprints, placement, recreated_at=time.time())

    def declare_shared(self, run: str) -> None:
        """RUN's local output is a filesystem every node mounts (`--shared-fs`): any host ships."""
        self.conn.hset(run_key(run), mapping=Placement(None, True).fields())  # type: ignore[arg-type]

    def _create(self, run: str, settings: RunSettings, created_at: float, version: str,
                fingerprints: list[FingerprintEntry], placement: Placement,
                recreated_at: float | None = None) -> bool:
        created = self.conn.hsetnx(run_key(run), "settings", settings.to_json())
        if created:
            fields: dict[str, str | bytes] = {
                "fingerprint": settings.fingerprint,
                "created_at": repr(created_at),
                "version": version,
                "fingerprints": orjson.dumps(fingerprints),
                **placement.fields(),
            }
            if recreated_at is not None:
                fields["recreated_at"] = repr(recreated_at)
            with self.conn.pipeline() as p:
                p.hset(run_key(run), mapping=fields)  # type: ignore[arg-type]
                p.zadd(RUNS, {run: created_at}, nx=True)
                p.execute()
            return True
        self.check(run, settings)
        return False

    def update_settings(self, run: str, settings: RunSettings) -> tuple[RunInfo, RunInfo]:
        """Give RUN new SETTINGS (`--update-settings`): a new fingerprint, added to the run's
        history. Consumers notice the new fingerprint and use the new settings for the jobs they
        take from then on; results keep the fingerprint that produced them. Returns the run
        before and after. Raises UserError for a setting that may not change (settings.py)."""
        key = run_key(run)
        for _ in range(10):
            with self.conn.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]
                    old = self.require(run)
                    if old.settings == settings:
                        return old, old
                    check_update(old.settings, settings)
                    history = [*old.fingerprints, fingerprint_entry(settings, time.time())]
                    pipe.multi()
                    pipe.hset(key, mapping={"settings": settings.to_json(), "fingerprint": settings.fingerprint,
                                            "fingerprints": orjson.dumps(history)})
                    pipe.execute()
                except redis.exceptions.WatchError:
                    continue
            return old, RunInfo(run, settings, old.created_at, old.version, history, old.placement)
        raise RunConflictError(f"the settings of run {run!r} kept changing while they were updated; try again")

    def set_priority(self, run: str, priority: int) -> None:
        """Give RUN a priority (higher is served first); its settings and fingerprint stay."""
        # Only on a run that exists: a delete racing this must not leave a record without settings.
        if not self._set_priority(keys=[run_key(run)], args=[str(priority)]):
            raise self.not_found(run)

    def priorities(self, names: list[str]) -> dict[str, int]:
        """Each run's priority (0 when never set, or not an integer), one round trip."""
        with self.conn.pipeline(transaction=False) as p:
            for n in names:
                p.hget(run_key(n), "priority")
            raws = p.execute()
        return {n: _int_or_zero(raw) for n, raw in zip(names, raws, strict=True)}

    def count(self) -> int:
        """How many runs Redis holds (O(1): consumers poll it to find a new run at once)."""
        return int(self.conn.zcard(RUNS))

    def names(self) -> list[str]:
        """Every run, oldest first."""
        return [_text(n) for n in self.conn.zrange(RUNS, 0, -1)]

    def item_count(self, run: str) -> int:
        return ItemTable(self.conn, run).counts().in_run

    def record_source(self, run: str, source: str, summary: dict[str, Any]) -> None:
        self.conn.hset(run_key(run, "sources"), source, orjson.dumps(summary))

    def sources(self, run: str) -> dict[str, dict[str, Any]]:
        """Each input source's summary; an entry that is not one (garbage) is left out."""
        raw = self.conn.hgetall(run_key(run, "sources"))
        out: dict[str, dict[str, Any]] = {}
        for k, v in raw.items():
            try:
                summary = orjson.loads(v)
            except orjson.JSONDecodeError:
                continue
            if isinstance(summary, dict):
                out[_text(k)] = summary
        return out

    def stats(self, run: str) -> dict[str, int]:
        """The run's counters; a field that is not an integer (garbage) is left out."""
        raw = self.conn.hgetall(run_key(run, "stats"))
        out: dict[str, int] = {}
        for k, v in raw.items():
            try:
                out[_text(k)] = int(v)
            except ValueError:
                continue
        return out

    def started_at(self, run: str) -> float | None:
        """When RUN's first job started (a consumer's ack sets it once), or None."""
        raw = self.conn.hget(run_key(run), "started_at")
        return float(_text(raw)) if raw else None

    def warnings(self, run: str) -> dict[str, str]:
        """What the consumers warned of RUN (`genqueue:run:<run>:warnings`: worker -> message)."""
        return {_text(k): _text(v) for k, v in self.conn.hgetall(run_key(run, "warnings")).items()}

    # --- reads and writes of a run's record for the producer's reconcile and the consumers -----
    def add_keys(self, run: str, digests: list[bytes]) -> None:
        """Put DIGESTS in RUN (items a consumer marked that this producer had not claimed)."""
        ItemTable(self.conn, run).change(digests, add=IN_RUN)

    def source_summary(self, run: str, source: str) -> object:
        """SOURCE's last enqueue summary as stored (any JSON; None when there is none). Raises
        orjson.JSONDecodeError when what is stored is not JSON."""
        raw = self.conn.hget(run_key(run, "sources"), source)
        return orjson.loads(raw) if raw is not None else None

    def fingerprints(self, names: list[str]) -> dict[str, str]:
        """The fingerprint of each run among NAMES that is in Redis (one round trip)."""
        with self.conn.pipeline(transaction=False) as p:
            for n in names:
                p.hget(run_key(n), "fingerprint")
            return {n: fp.decode() if isinstance(fp, bytes) else str(fp)
                    for n, fp in zip(names, p.execute(), strict=True) if fp is not None}

    def add_warning(self, run: str, worker: str, message: str) -> None:
        """Say MESSAGE about RUN from consumer WORKER (`genqueue:run:<run>:warnings`, one per worker)."""
        self.conn.hset(run_key(run, "warnings"), worker, message)

    def count_features(self, run: str, rows: int, size: int, tokens: int = 0) -> None:
        """A feature shard of RUN is stored (--capture, --logprobs): ROWS rows of SIZE bytes
        holding TOKENS tokens join the run's counters (FEATURE_ROWS, FEATURE_BYTES, FEATURE_TOKENS)."""
        with self.conn.pipeline() as p:
            p.hincrby(run_key(run, "stats"), FEATURE_ROWS, rows)
            p.hincrby(run_key(run, "stats"), FEATURE_BYTES, size)
            p.hincrby(run_key(run, "stats"), FEATURE_TOKENS, tokens)
            p.execute()

    def count_acked(self, run: str, counts: Mapping[str, int], started_at: float, *,
                    clear_checkpoints: Sequence[str] = ()) -> None:
        """Acked jobs' part of RUN's record, in one MULTI/EXEC: their COUNTS added to the run's
        counters, the run's first start (STARTED_AT, kept when set), and the regenerate checkpoints
        of their items CLEAR_CHECKPOINTS deleted (common/keepers/checkpoints.py)."""
        with self.conn.pipeline() as p:
            for k, v in counts.items():
                p.hincrby(run_key(run, "stats"), k, v)
            p.hsetnx(run_key(run), "started_at", repr(started_at))
            CheckpointStore.clear(p, run, list(clear_checkpoints))
            p.execute()


def not_found_line(conn: redis.Redis, run: str) -> str:
    """The line for RUN, which the Redis of CONN does not hold, naming that Redis (its URL, the
    password masked): with REDIS_URL unset, it is 127.0.0.1:6379, perhaps not the one meant."""
    return f"no run named {run!r} in Redis at {redis_location(conn)} (see `producer runs` for the runs there)"


def conflict(run: str, existing: RunSettings, asked: RunSettings, where: str = "exists") -> RunConflictError:
    """The refusal of a run name taken by other settings, naming the ones that differ; the way
    out `--update-settings` is offered only when it would take them all (FIXED_SETTINGS)."""
    changed = asked.differences(existing)
    diff = ", ".join(changed)
    fixed = [name for name in changed if name in FIXED_SETTINGS]
    if fixed:
        name = fixed[0]
        return RunConflictError(
            f"run {run!r} {where} with other settings ({diff}); its {name} cannot change (the run's "
            f"{_setting_text(existing, name)}, this command's {_setting_text(asked, name)}: "
            f"{FIXED_SETTINGS[name]}): leave {_option(name)} out to keep the run's, or name a new run with --run"
        )
    return RunConflictError(
        f"run {run!r} {where} with other settings ({diff}); leave those options out to keep the run's, "
        "name a new run with --run, or add --update-settings to give the run these settings for its items "
        "not done yet"
    )


def _setting_text(settings: RunSettings, name: str) -> str:
    """A top-level setting's value as a user gives it (an enum by its value, an output redacted)."""
    value = getattr(settings, name)
    return redact(str(getattr(value, "value", value)))


def _option(name: str) -> str:
    """The `producer enqueue` option of a top-level setting: multi_turn -> --multi-turn."""
    return "--" + name.replace("_", "-")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _int_or_zero(raw: object) -> int:
    """A stored priority; garbage counts as the default (0), never as a reason to stop serving."""
    if raw is None:
        return 0
    try:
        return int(_text(raw))
    except ValueError:
        return 0


#: Lua: CALL(cmd, key, list) runs a whole-list command in parts of 4096 (Lua's unpack limit),
#: returning the concatenated replies (for other scripts of the run's keys, too).
LUA_CALL_IN_PARTS = """
local function call(cmd, key, list)
  local out = {}
  for i = 1, #list, 4096 do
    local part = redis.call(cmd, key, unpack(list, i, math.min(i + 4095, #list)))
    if type(part) == 'table' then
      for _, v in ipairs(part) do out[#out + 1] = v end
    end
  end
  return out
end
"""

# KEYS: the run's hash. ARGV: the priority. Set only on a run that exists (has its settings).
_SET_PRIORITY = """
if redis.call('HEXISTS', KEYS[1], 'settings') == 0 then return 0 end
redis.call('HSET', KEYS[1], 'priority', ARGV[1])
return 1
"""
