"""The run an enqueue writes into: found in Redis, re-created from its output, or made new.

`prepare` reads only (Redis, and the output's run.json when Redis has no such run) and refuses a
conflicting run before a byte of the input is read. `RunSetup.apply`, once the input's first
record is read, makes the run what the command asks:
- in Redis with the same settings (a setting the command line did not give counts as the run's
  own): nothing to do but write run.json where the output lacks it;
- not in Redis, no run.json at the output: a new run, and its run.json;
- not in Redis, a run.json at the output (Redis lost the run): the done and failed marks rebuilt
  from the shipped shards, the run re-created with the same settings, creation time and
  fingerprint history; shards with no run.json beside them get their marks rebuilt too, and the
  run takes the command's settings;
- other settings: refused as a conflict, unless --update-settings (a new fingerprint, added to
  the run's history, for its items not done yet).
The run's priority (--priority, else run.json's for a re-created run, else Redis's) is set before
any job is queued and kept in run.json (keep_priority). A run whose local output is another
host's is refused unless --shared-fs (common/placement.py). run.json is written through the
output's store by the run's first enqueue; an enqueue that skipped the output's probe
(--no-output-check) and cannot reach it goes on with a warning, without run.json.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from genqueue.common.contracts import PromptMode
from genqueue.common.errors import UserError
from genqueue.common.features import feature_store_for
from genqueue.common.keepers.marks import Marks
from genqueue.common.keepers.packs import PackTable
from genqueue.common.keepers.runs import RunInfo, RunStore, conflict
from genqueue.common.placement import Placement, this_host
from genqueue.common.settings import RunSettings, check_update, check_variant_params
from genqueue.common.storage import LocalStore, OutputMissingError, OutputStore, ShardInfo, StoreError, store_for
from genqueue.common.storage.runfile import RunFile, RunFileError, read_run_file, where, write_run_file

log = logging.getLogger(__name__)

#: Gets each line worth telling the user, starting "note: " or "warning: ".
Note = Callable[[str], None]


@dataclass
class RunSetup:
    """What prepare() found; apply() acts on it."""

    conn: redis.Redis
    run: str
    settings: RunSettings
    update: bool
    output: OutputStore
    existing: RunInfo | None
    run_file: RunFile | None
    run_file_read: bool
    unreachable: str | None = None  # why the output could not be read: run.json is left alone
    shared_fs: bool = False  # --shared-fs: the local output is one filesystem every node mounts
    outcome: dict[str, Any] = field(default_factory=dict)

    def apply(self, note: Note, priority: int | None = None) -> RunInfo:
        """Make the run (see the module docstring); NOTE gets each line worth telling the user;
        PRIORITY: give the run this priority (None: keep the one it has, or run.json's for a run
        re-created from it). Returns the run as it is now."""
        store = RunStore(self.conn)
        if self.unreachable is not None:
            note(f"warning: {self.unreachable}; the run's settings are not kept at its output, and it cannot be "
                 "re-created from there should Redis lose it")
        if self.existing is None and self.run_file is not None:
            rf = self.run_file
            rebuilt = Marks(self.conn, self.run).rebuild(self.output, feature_store_for(rf.settings.output))
            placement = Placement.new(self.settings.output, shared_fs=self.shared_fs or rf.placement.shared_fs)
            if store.recreate(self.run, rf.settings, rf.created_at, rf.version, rf.fingerprints, placement):
                self.outcome["recreated_run"] = True
                PackTable(self.conn, self.run).put_back(rf.packs)  # by reference: its packs found again
                if priority is None and rf.priority:
                    priority = rf.priority
                    note(f"note: run {self.run}: priority {rf.priority}, as its run.json kept it")
                self.outcome["marks_rebuilt"] = {"shards": rebuilt.shards, "records": rebuilt.records,
                                                 "done": rebuilt.done, "failed": rebuilt.failed}
                note(f"note: run {self.run} was not in Redis: re-created from {where(self.output, self.run)} "
                     f"(fingerprint {rf.fingerprint}, created {_when(rf.created_at)}); marks rebuilt from "
                     f"{rebuilt.line()}")
        elif self.existing is None:
            shards = self._shards(note)
            if shards:
                rebuilt = Marks(self.conn, self.run).rebuild(self.output, feature_store_for(self.settings.output))
                self.outcome["recreated_run"] = store.create_or_check(self.run, self.settings, self._placement())
                self.outcome["marks_rebuilt"] = {"shards": rebuilt.shards, "records": rebuilt.records,
                                                 "done": rebuilt.done, "failed": rebuilt.failed}
                note(f"note: run {self.run} was not in Redis and its output has shards but no run.json: created "
                     f"with this command's settings (fingerprint {self.settings.fingerprint}); marks rebuilt "
                     f"from {rebuilt.line()}")
            else:
                self.outcome["created_run"] = store.create_or_check(self.run, self.settings, self._placement())
        info = store.require(self.run)
        # before the first job: a consumer must never serve a high run's items at the default
        if priority is not None:
            store.set_priority(self.run, priority)
        level = store.priorities([self.run])[self.run]
        self.outcome["priority"] = level
        if self.shared_fs and info.placement.host is not None:
            store.declare_shared(self.run)
            info = store.require(self.run)
            note(f"note: run {self.run}: output {self.settings.output} declared a shared filesystem: consumers on "
                 "any host ship to it")
        if self.update and info.settings != self.settings:
            old, info = store.update_settings(self.run, self.settings)
            changed = self.settings.differences(old.settings)
            self.outcome["settings_updated"] = {"from": old.fingerprint, "to": info.fingerprint, "changed": changed}
            note(f"note: run {self.run}: settings updated ({', '.join(changed)}): fingerprint {old.fingerprint} -> "
                 f"{info.fingerprint}; items not done yet are generated with the new settings, results "
                 "already shipped keep the fingerprint that produced them")
        if self.unreachable is not None:
            return info
        try:  # a local output directory not made yet is made here (_put_whole)
            current = self.run_file if self.run_file_read else _read(self.output, self.run, note)
            if current is None or current.settings != info.settings or current.fingerprints != info.fingerprints \
                    or current.placement != info.placement or current.priority != level:
                sources = current.sources if current is not None else {}
                self.run_file = RunFile(self.run, info.settings, info.created_at, info.version, info.fingerprints,
                                        sources, info.placement, level)
                if current is not None:  # the mode and packs the enqueues by reference wrote stay named
                    self.run_file.prompts, self.run_file.packs = current.prompts, current.packs
                write_run_file(self.output, self.run_file)
            else:
                self.run_file = current
            self.run_file_read = True
        except StoreError as e:
            self.unreachable = str(e)
            note(f"warning: {e}; the run's settings are not kept at its output")
        return info

    def _placement(self) -> Placement:
        return Placement.new(self.settings.output, shared_fs=self.shared_fs)

    def _shards(self, note: Note) -> list[ShardInfo]:
        """The run's shards at its output ([] when it cannot be listed, with a warning)."""
        if self.unreachable is not None or not _output_exists(self.output):
            return []
        try:
            return self.output.list_shards(self.run)
        except OutputMissingError:  # seen a moment ago: another command's probe made it, and removed it again
            return []
        except StoreError as e:
            note(f"warning: {e}; the run is created without looking for its shards")
            return []

    def record_source(self, source: str, summary: dict[str, Any], *, packs: dict[int, str] | None = None) -> None:
        """Add SOURCE's last summary to run.json (re-read first: another producer may have
        added its own since), and PACKS, the packs its jobs by reference name (the run's mode
        becomes `reference`). Best effort: Redis holds them too."""
        try:
            if self.unreachable is not None or not _output_exists(self.output):
                return
            rf = _read(self.output, self.run, _log_note) or self.run_file
            if rf is None and packs:  # the packs made the output directory: run.json goes beside them
                info = RunStore(self.conn).require(self.run)
                rf = RunFile(self.run, info.settings, info.created_at, info.version, info.fingerprints, {},
                             info.placement, RunStore(self.conn).priorities([self.run])[self.run])
            if rf is None:
                return
            rf.sources[source] = summary
            if packs:
                rf.prompts = PromptMode.REFERENCE
                rf.packs.update(packs)
            write_run_file(self.output, rf)
        except StoreError as e:
            log.warning("could not add source %s to run.json of run %s: %s", source, self.run, e)


def keep_priority(run: str, output: str, priority: int) -> str | None:
    """Write PRIORITY into RUN's run.json at OUTPUT (`producer priority`), so a run re-created
    from it keeps it. Returns why it could not (no run.json there, the output unreachable), or None."""
    store = store_for(output)
    try:
        if not _output_exists(store):
            return f"{output} does not exist yet"
        rf = read_run_file(store, run)
        if rf is None:
            return f"{where(store, run)} does not exist yet"
        if rf.priority != priority:
            rf.priority = priority
            write_run_file(store, rf)
        return None
    except StoreError as e:
        return str(e)


def prepare(conn: redis.Redis, run: str, settings: RunSettings, *, update: bool,
            shared_fs: bool = False, given: frozenset[str] | None = None) -> RunSetup:
    """Find RUN in Redis, or its run.json at the output SETTINGS names. Writes nothing. Raises
    RunConflictError for other settings without UPDATE, UserError for a setting UPDATE may not
    change, and for a run whose local output is another host's (without SHARED_FS). An output
    that cannot be read is noted (`unreachable`), not an error.

    GIVEN names the settings the command line gave (SETTING_NAMES; None: all of them): for an
    existing run the others are the run's own, so that only an option given with another value
    is a conflict (or, with UPDATE, a change). The setup's `settings` are the ones that result."""
    existing = RunStore(conn).get(run)
    run_file, unreachable = None, None
    if existing is not None:
        settings = _asked(settings, existing.settings, given)
        _check(run, existing.settings, settings, update, "exists")
    output = store_for(settings.output)  # the run's, for a run in Redis the command gave no --output
    if existing is not None:
        refusal = None if shared_fs else existing.placement.refusal(run, existing.settings.output, this_host())
        if refusal is not None:
            raise UserError(refusal)
    else:
        try:
            run_file = _read(output, run, _log_note)
        except StoreError as e:
            unreachable = str(e)
        if run_file is not None:  # found at the output asked for: that one is the run's
            settings = _asked(settings, run_file.settings, None if given is None else given | {"output"})
            _check(run, run_file.settings, settings, update,
                   f"is not in Redis, and {where(output, run)} holds it")
    return RunSetup(conn, run, settings, update, output, existing, run_file, run_file_read=existing is None,
                    unreachable=unreachable, shared_fs=shared_fs)


def _read(output: OutputStore, run: str, note: Note) -> RunFile | None:
    """RUN's run.json; None when there is none, or when it is not one (said: it is replaced).
    Raises StoreError when the output cannot be read."""
    try:
        return read_run_file(output, run)
    except RunFileError as e:
        note(f"warning: {e}; it is written again")
        return None


def _log_note(line: str) -> None:
    log.warning("%s", line.split(": ", 1)[-1])


def _asked(settings: RunSettings, stored: RunSettings, given: frozenset[str] | None) -> RunSettings:
    """SETTINGS where GIVEN names them, STORED's elsewhere (None: SETTINGS as they are). A
    sampling field or variant given is checked again over the run's others (a variant's fields
    merged over the run's sampling, say), as when a run is made."""
    if given is None:
        return settings
    asked = settings.keeping(stored, given)
    if asked != settings and any(name == "variants" or name.startswith("sampling.") for name in given):
        asked.sampling.check()
        check_variant_params(asked.sampling, asked.variants)
    return asked


def _check(run: str, have: RunSettings, asked: RunSettings, update: bool, where_: str) -> None:
    if have == asked:
        return
    if not update:
        raise conflict(run, have, asked, where_)
    check_update(have, asked)


def _output_exists(output: OutputStore) -> bool:
    """False for a local output directory that does not exist yet (see the module docstring)."""
    return not isinstance(output, LocalStore) or output.root.is_dir()


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))

